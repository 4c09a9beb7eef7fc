#!/usr/bin/env bash
# One H100: the debug model, then the 1b preset (seq 4096, local batch 6, compile, output layer in
# bf16) in bf16 and each float8 recipe. Prints the tables; results JSON and logs go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, torchao; print('torch', torch.__version__, 'torchao', torchao.__version__, torch.cuda.get_device_name())"
python3 -c "from titanlike.data import build_default_corpus; build_default_corpus('/tmp/corpus')"
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
python3 scripts/bench_train.py --config train_configs/debug_model.toml --steps ${DEBUG_STEPS:-60} --log-freq 10 \
  --corpus /tmp/corpus --workdir /tmp/bench_debug --out "$OUT/debug.json" \
  --variant "debug_bf16=" --variant "debug_bf16_compile=--compile.enable"
python3 scripts/bench_train.py --config train_configs/llama3_1b.toml --steps ${STEPS:-30} --log-freq 5 \
  --corpus /tmp/corpus --workdir /tmp/bench_1b --out "$OUT/1b.json" "$@" \
  -- --data.seq_len 4096 --training.local_batch_size 6 --compile.enable
for f in /tmp/bench_1b/*.log; do tail -n 4 "$f" > "$OUT/$(basename $f)"; done
