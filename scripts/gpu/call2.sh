#!/usr/bin/env bash
# Ran as probe/call2.sh in the repository root (it cd's to the parent of its own folder).
# Device call 2 of session 8 (#19): SDPA backends at 124m's and 1b's shapes; 1b under a 31 GiB cap
# with the chunked loss and less recompute at bigger micro-batches.
set -u
cd "$(dirname "$0")/.."
W=/tmp/w; mkdir -p $W
C="--corpus $W/cache"
echo "== attention 124m batch 32 seq 2048"
timeout 90 python3 scripts/bench_attention.py --flavor 124m --batch 32 --seq 2048 2>/dev/null
echo "== attention 1b batch 6 seq 4096"
timeout 90 python3 scripts/bench_attention.py --flavor 1b --batch 6 --seq 4096 2>/dev/null
echo "== 1b under a 31 GiB cap (rtx5090_1b.toml, global batch 8, chunked loss 4096)"
K="--training.loss_chunk_tokens 4096"
timeout 420 python3 scripts/bench_train.py --config train_configs/rtx5090_1b.toml --steps 20 --log-freq 5 $C \
  --workdir $W/c --variant "tw_selop_mb2=--fp8.recipe tensorwise --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op --training.local_batch_size 2 $K" \
  --variant "tw_full_mb4=--fp8.recipe tensorwise --activation_checkpoint.mode full --training.local_batch_size 4 $K" \
  --variant "tw_sel2_mb2=--fp8.recipe tensorwise --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option 2 --training.local_batch_size 2 $K" \
  --variant "bf16_selop_mb2=--fp8.recipe none --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op --training.local_batch_size 2 $K" \
  --variant "bf16_full_mb4=--fp8.recipe none --activation_checkpoint.mode full --training.local_batch_size 4 $K" \
  -- --compile.enable --fp8.auto_filter true --training.gpu_memory_limit_gib 31 2>&1 | tail -8
for f in $W/c/*.log; do echo "$f"; grep -m2 -E "^error|OutOfMemory" $f; done
