#!/usr/bin/env bash
# Device call 3 of session 10 (#19): measure weighs memory. The GPU test of kept bytes, then the
# 8-bit 32 GB 1b config with measure (it went out of memory with the old tie-break).
set -u
cd "$(dirname "$0")/.."
W=/tmp/w; mkdir -p $W
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_float8_measure.py -o addopts="" 2>&1 | tail -4
B="python3 scripts/bench_train.py --log-freq 4 --corpus $W/cache --steps 16"
timeout 330 $B --config train_configs/rtx5090_1b_8bit.toml --workdir $W/a \
  --variant "1b_8bit_cap31_measure=--training.gpu_memory_limit_gib 31 --fp8.auto_filter measure" 2>&1 | tail -1
for f in $W/a/*.log; do echo "-- $f"; grep -E "fp8.auto_filter = measure: one|^error|Error|out of" $f | head -5; done
