#!/usr/bin/env bash
# One H100: the README's 1b row, every recipe back to back on one machine with the defaults a user
# gets (layer choice by the size rule; rowwise_with_gw_hp with every layer but the output, as the
# speed issue's reference does). Table last. Written 2026-11-22 (fifth session).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, torchao; print('torch', torch.__version__, 'torchao', torchao.__version__)"
python3 -c "from titanlike.data import build_default_corpus; build_default_corpus('/tmp/corpus')"
python3 scripts/bench_train.py --config train_configs/llama3_1b.toml --steps ${STEPS:-20} --log-freq 5 \
  --corpus /tmp/corpus --workdir /tmp/bench_1b --out "$OUT/1b.json" \
  --variant "bf16=--fp8.recipe none" --variant "tensorwise=--fp8.recipe tensorwise" \
  --variant "rowwise=--fp8.recipe rowwise" \
  --variant "rowwise_with_gw_hp=--fp8.recipe rowwise_with_gw_hp --fp8.auto_filter false" \
  "$@" -- --data.seq_len 4096 --training.local_batch_size 6 --compile.enable
for f in /tmp/bench_1b/*.log; do grep -E "converted|error" "$f" | head -n 4 > "$OUT/$(basename $f)"; done
