#!/usr/bin/env bash
# Ran as probe/call5.sh in the repository root (it cd's to the parent of its own folder).
# Device call 5 of session 8 (#19): rowwise with measure on 124m against bf16, back to back.
set -u
cd "$(dirname "$0")/.."
W=/tmp/w; mkdir -p $W
timeout 300 python3 scripts/bench_train.py --log-freq 4 --corpus $W/cache --config train_configs/rtx5090_124m.toml \
  --steps 16 --workdir $W/r --variant "bf16=--fp8.recipe none" \
  --variant "rw_measure=--fp8.recipe rowwise --fp8.scaling dynamic --fp8.auto_filter measure" \
  -- --training.local_batch_size 32 2>&1 | tail -2
grep -hE "one block|^error" $W/r/*.log | head -5
