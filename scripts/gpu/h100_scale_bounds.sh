#!/usr/bin/env bash
# One H100, 1b: how far could tensorwise go past 1.17x bf16 without dynamic scaling's amax passes, or
# with fast accumulation in the gradient matmuls? Upper bounds only: the probes
# (scripts/gpu/scale_probe) make the numerics wrong on purpose. Written 2026-11-22 (sixth session).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/scripts/gpu/scale_probe:${PYTHONPATH:-} TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "from titanlike.data import build_default_corpus; build_default_corpus('/tmp/corpus')"
python3 scripts/bench_train.py --config train_configs/llama3_1b.toml --steps 20 --log-freq 5 --corpus /tmp/corpus \
  --workdir /tmp/s --out "$OUT/bounds.json" \
  --variant "bf16=--fp8.recipe none" --variant "tensorwise=--fp8.recipe tensorwise" \
  --variant "tw_static_amax=TL_SCALE_PROBE=static --fp8.recipe tensorwise" \
  --variant "tw_fast_accum=TL_SCALE_PROBE=fast_accum --fp8.recipe tensorwise" \
  --variant "tw_static_fast=TL_SCALE_PROBE=static,fast_accum --fp8.recipe tensorwise" \
  -- --data.seq_len 4096 --training.local_batch_size 6 --compile.enable
