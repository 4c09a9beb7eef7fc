#!/usr/bin/env bash
# Two H200s: FSDP over both, 8b preset, seq 8192, local batch 2, op-level selective AC, compile;
# bf16 vs tensorwise (float8 all-gather on by default) vs rowwise. Prints the table last.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, torchao; print('torch', torch.__version__, 'torchao', torchao.__version__)"
python3 -c "from titanlike.data import build_default_corpus; build_default_corpus('/tmp/corpus')"
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
python3 scripts/bench_train.py --config train_configs/llama3_8b.toml --ngpu ${NGPU:-2} --steps ${STEPS:-15} --log-freq 5 \
  --corpus /tmp/corpus --workdir /tmp/bench_8b --out "$OUT/8b.json" "$@" \
  -- --data.seq_len 8192 --training.local_batch_size 2 --compile.enable \
     --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op
for f in /tmp/bench_8b/*.log; do grep -E "float8|model 8b|error" "$f" | head -5 > "$OUT/$(basename $f)"; tail -n 3 "$f" >> "$OUT/$(basename $f)"; done
