#!/usr/bin/env bash
# Device call 6 of session 10 (#19), right after call 5: 124m at batch 64, float8 levers on top of
# measure's choice: the output layer in float8 too, and amaxes every 16 steps instead of 4.
set -u
cd "$(dirname "$0")/.."
W=/tmp/w; mkdir -p $W
B="python3 scripts/bench_train.py --log-freq 4 --corpus $W/cache --steps 20"
timeout 150 $B --config train_configs/rtx5090_124m.toml --workdir $W/f \
  --variant "124m_twd4_ffn_out_b64=--fp8.auto_filter false --fp8.filter_fqns wqkv,wo" -- --training.local_batch_size 64 2>&1 | tail -1
timeout 150 $B --config train_configs/rtx5090_124m.toml --workdir $W/g \
  --variant "124m_twd16_measure_b64=--fp8.amax_every 16" -- --training.local_batch_size 64 2>&1 | tail -1
for f in $W/[fg]/*.log; do echo "-- $f"; grep -E "fp8.auto_filter = measure: one|converted|^error|Error|out of" $f | head -5; done
