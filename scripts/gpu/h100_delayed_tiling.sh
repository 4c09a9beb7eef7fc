#!/usr/bin/env bash
# One H100, 1b: delayed scaling's cast kernels now also reduce (the amax rows); do inductor's 2-D
# tiling options help them? (TL_INDUCTOR: scripts/gpu/inductor_env.) Written 2026-11-22 (sixth session).
set -uo pipefail
export PYTHONPATH=$PWD/scripts/gpu/inductor_env:${PYTHONPATH:-} TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
python3 -c "from titanlike.data import build_default_corpus; build_default_corpus('/tmp/corpus')"
python3 scripts/bench_train.py --config train_configs/llama3_1b.toml --steps 20 --log-freq 5 --corpus /tmp/corpus --workdir /tmp/t \
  --variant "bf16=--fp8.recipe none" --variant "tensorwise=--fp8.recipe tensorwise" \
  --variant "tw_delayed=--fp8.recipe tensorwise --fp8.scaling delayed" \
  --variant "tw_delayed_nd=TL_INDUCTOR=triton.prefer_nd_tiling=True --fp8.recipe tensorwise --fp8.scaling delayed" \
  --variant "tw_delayed_nd_red=TL_INDUCTOR=triton.prefer_nd_tiling=True,triton.tile_reductions=True --fp8.recipe tensorwise --fp8.scaling delayed" \
  -- --data.seq_len 4096 --training.local_batch_size 6 --compile.enable
