#!/usr/bin/env bash
# One H100, 1b: tensorwise float8 with delayed scaling (fp8.scaling = delayed) against dynamic
# scaling and bf16, back to back: speed over STEPS steps (default 200), then the losses of the same
# runs side by side. More variants: --variant "name=overrides". Written 2026-11-22 (sixth session).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, torchao; print('torch', torch.__version__, 'torchao', torchao.__version__)"
python3 -c "from titanlike.data import build_default_corpus; build_default_corpus('/tmp/corpus')"
python3 scripts/bench_train.py --config train_configs/llama3_1b.toml --steps ${STEPS:-200} --log-freq 10 \
  --corpus /tmp/corpus --workdir /tmp/d --out "$OUT/delayed.json" \
  --variant "bf16=--fp8.recipe none" --variant "tensorwise=--fp8.recipe tensorwise" \
  --variant "tw_delayed=--fp8.recipe tensorwise --fp8.scaling delayed" \
  "$@" -- --data.seq_len 4096 --training.local_batch_size 6 --compile.enable > "$OUT/bench.txt" 2>&1
for f in /tmp/d/*.log; do grep -E "converted|error|Error" "$f" | head -n 4 > "$OUT/$(basename $f)"; done
runs=(); for d in /tmp/d/*/; do d=${d%/}; runs+=("$(basename $d)=$d"); done
python3 scripts/compare_losses.py "${runs[@]}" --every 20 --last 10
echo; tail -n 8 "$OUT/bench.txt"
