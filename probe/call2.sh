#!/usr/bin/env bash
# Device call 2 of session 10 (#19), right after call 1 on the same machine: a profile of the best
# float8 mode on 124m (delayed tensorwise, measure), batch 32, to see where float8 time goes.
set -u
cd "$(dirname "$0")/.."
W=/tmp/w; mkdir -p $W
B="python3 scripts/bench_train.py --log-freq 4 --corpus $W/cache"
timeout 200 $B --steps 12 --config train_configs/rtx5090_124m.toml --workdir $W/p \
  --variant "124m_twd4_measure_prof=" -- --training.local_batch_size 32 \
  --profiling.enable --profiling.freq 10 --profiling.warmup 2 --profiling.active 2 2>&1 | tail -1
T=$(ls $W/p/*/profile/step-10/rank0_trace.json* 2>/dev/null | head -1); [ -z "$T" ] && T=$(find $W/p -name "rank0_trace.json*" | head -1)
echo "trace: $T"; grep -E "<- chosen" $W/p/*.log | head -3
python3 scripts/summarize_trace.py "$T" --top 45 | tee $OUT/profile.txt
