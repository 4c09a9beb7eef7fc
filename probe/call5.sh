#!/usr/bin/env bash
# Device call 5 of session 10 (#19), right after call 4: 124m at batch 64 (the batch that fills
# more of the GPU), bf16 and the shipped float8 (measure).
set -u
cd "$(dirname "$0")/.."
W=/tmp/w; mkdir -p $W
B="python3 scripts/bench_train.py --log-freq 4 --corpus $W/cache --steps 20"
timeout 150 $B --config train_configs/rtx5090_124m.toml --workdir $W/d \
  --variant "124m_bf16_b64=--fp8.recipe none" -- --training.local_batch_size 64 2>&1 | tail -1
timeout 170 $B --config train_configs/rtx5090_124m.toml --workdir $W/e \
  --variant "124m_twd4_measure_b64=" -- --training.local_batch_size 64 2>&1 | tail -1
for f in $W/e/*.log; do echo "-- $f"; grep -E "fp8.auto_filter = measure: one|^error|Error|out of" $f | head -5; done
