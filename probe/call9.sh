#!/usr/bin/env bash
# Device call 9 of session 10 (#19), right after call 8: the 8-bit 1b config's background saves with
# the saves far enough apart (80 steps, ~29 s) that a save never waits for the previous one's write.
set -u
cd "$(dirname "$0")/.."
W=/tmp/w; mkdir -p $W
B="python3 scripts/bench_train.py --log-freq 10 --corpus $W/cache"
C="--training.gpu_memory_limit_gib 31 --checkpoint.enable true --checkpoint.interval 80"
timeout 400 $B --steps 170 --config train_configs/rtx5090_1b_8bit.toml --workdir $W/a \
  --variant "1b_8bit_pinned_bg_i80=$C --checkpoint.async_mode async_with_pinned_mem" 2>&1 | tail -1
grep -h "stalled\|^error\|Error" $W/a/*.log | head
