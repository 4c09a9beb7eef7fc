#!/usr/bin/env bash
# Device call 4 of session 10 (#19), right after call 3: the shipped 124m config with measure (now
# weighing memory) at batch 32, and bf16 on the same machine.
set -u
cd "$(dirname "$0")/.."
W=/tmp/w; mkdir -p $W
B="python3 scripts/bench_train.py --log-freq 4 --corpus $W/cache --steps 20"
timeout 200 $B --config train_configs/rtx5090_124m.toml --workdir $W/b \
  --variant "124m_bf16=--fp8.recipe none" -- --training.local_batch_size 32 2>&1 | tail -1
timeout 150 $B --config train_configs/rtx5090_124m.toml --workdir $W/c \
  --variant "124m_twd4_measure=" -- --training.local_batch_size 32 2>&1 | tail -1
for f in $W/c/*.log; do echo "-- $f"; grep -E "fp8.auto_filter = measure: one|^error|Error|out of" $f | head -5; done
