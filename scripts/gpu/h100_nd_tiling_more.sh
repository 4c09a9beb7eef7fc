#!/usr/bin/env bash
# One H100, 1b: does 2-D tiling help bf16 too, and do tiled reductions add to rowwise's options?
# (TL_INDUCTOR: scripts/gpu/inductor_env.) Written 2026-11-22 (fifth session).
set -uo pipefail
export PYTHONPATH=$PWD/scripts/gpu/inductor_env:${PYTHONPATH:-} TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
python3 -c "from titanlike.data import build_default_corpus; build_default_corpus('/tmp/corpus')"
python3 scripts/bench_train.py --config train_configs/llama3_1b.toml --steps 20 --log-freq 5 --corpus /tmp/corpus --workdir /tmp/k \
  --variant "bf16=--fp8.recipe none" --variant "bf16_nd=TL_INDUCTOR=triton.prefer_nd_tiling=True --fp8.recipe none" \
  --variant "rowwise=--fp8.recipe rowwise" \
  --variant "rowwise_tile_red=TL_INDUCTOR=triton.tile_reductions=True --fp8.recipe rowwise" \
  -- --data.seq_len 4096 --training.local_batch_size 6 --compile.enable
