#!/usr/bin/env bash
# Ran as probe/call3.sh in the repository root (it cd's to the parent of its own folder).
# Device call 3 of session 8 (#19): 124m, seq 2048, batch 32, compile, one H100, back to back:
# the compiled head (final norm + output layer + loss in one graph) against main before it
# (probe/old = 8c4ba34), inductor's coordinate-descent tuning, and the float8 choices incl. measure.
# probe/old is a `git archive 8c4ba34` copy of main before the compiled head, made beside this script.
set -u
cd "$(dirname "$0")/.."
W=/tmp/w; mkdir -p $W
C="--corpus $W/cache"
COMMON="--training.local_batch_size 32 --compile.enable"
D="--fp8.recipe tensorwise --fp8.scaling delayed --fp8.amax_every 4"
echo "== before: main at 8c4ba34"
timeout 100 python3 probe/old/scripts/bench_train.py --config train_configs/rtx5090_124m.toml --steps 25 --log-freq 5 $C \
  --workdir $W/old --variant "old_bf16=--fp8.recipe none" -- $COMMON 2>&1 | tail -1
echo "== after"
timeout 480 python3 scripts/bench_train.py --config train_configs/rtx5090_124m.toml --steps 25 --log-freq 5 $C \
  --workdir $W/new --out $W/new.json \
  --variant "bf16=--fp8.recipe none" \
  --variant "bf16_cdtune=TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1 --fp8.recipe none" \
  --variant "twd4_measure=$D --fp8.auto_filter measure" \
  --variant "twd4_blocks=$D --fp8.auto_filter false" \
  --variant "twd4_all_out=$D --fp8.auto_filter false --fp8.filter_fqns ''" \
  --variant "rw_measure=--fp8.recipe rowwise --fp8.auto_filter measure" \
  -- $COMMON 2>&1 | tail -9
for f in $W/new/*.log; do echo "-- $f"; grep -E "measure|block choice|ms per block|^error" $f | head -6; done
