#!/usr/bin/env bash
# Device call 7 of session 10 (#19): what a foreground save costs the 8-bit 32 GB config (its saves
# cannot run in the background), against the fp32 config's background save; 1b capped at 31 GiB.
set -u
cd "$(dirname "$0")/.."
W=/tmp/w; mkdir -p $W
df -h /tmp | tail -1
B="python3 scripts/bench_train.py --log-freq 4 --corpus $W/cache --steps 14"
C="--training.gpu_memory_limit_gib 31 --checkpoint.enable true --checkpoint.interval 10"
timeout 300 $B --config train_configs/rtx5090_1b_8bit.toml --workdir $W/a \
  --variant "1b_8bit_save=$C" 2>&1 | tail -1
grep -h "stalled\|^error" $W/a/*.log
du -sh $W/a/*/checkpoint/step-10 2>/dev/null || find $W/a -maxdepth 3 -name "step-*" | head
rm -rf $W/a/*/checkpoint
timeout 200 $B --config train_configs/rtx5090_1b.toml --workdir $W/b \
  --variant "1b_fp32_async_save=$C" 2>&1 | tail -1
grep -h "stalled\|^error" $W/b/*.log
