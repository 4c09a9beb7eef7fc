#!/usr/bin/env bash
# Ran as probe/call4.sh in the repository root (it cd's to the parent of its own folder).
# Device call 4 of session 8 (#19): 1b under a 31 GiB cap with 8-bit AdamW moments and no
# recompute; the shipped rtx5090_124m.toml under the cap; rowwise with measure on 124m; bf16 8-bit;
# 124m with the feed-forward and the output layer in float8.
set -u
cd "$(dirname "$0")/.."
W=/tmp/w; mkdir -p $W
C="--corpus $W/cache"
K="--training.loss_chunk_tokens 4096 --optimizer.state_dtype 8bit --activation_checkpoint.mode none --training.local_batch_size 2"
B="python3 scripts/bench_train.py --log-freq 4 $C"
timeout 150 $B --config train_configs/rtx5090_1b.toml --steps 16 --workdir $W/a \
  --variant "1b_tw_8bit_mb2=--fp8.recipe tensorwise --fp8.auto_filter true $K" \
  -- --compile.enable --training.gpu_memory_limit_gib 31 2>&1 | tail -1
timeout 80 $B --config train_configs/rtx5090_124m.toml --steps 20 --workdir $W/b \
  --variant "124m_shipped_cap31=--training.gpu_memory_limit_gib 31" 2>&1 | tail -1
timeout 100 $B --config train_configs/rtx5090_124m.toml --steps 20 --workdir $W/c \
  --variant "124m_rw_measure=--fp8.recipe rowwise --fp8.scaling dynamic --fp8.auto_filter measure" \
  -- --training.local_batch_size 32 2>&1 | tail -1
timeout 110 $B --config train_configs/rtx5090_1b.toml --steps 16 --workdir $W/d \
  --variant "1b_bf16_8bit_mb2=--fp8.recipe none $K" \
  -- --compile.enable --training.gpu_memory_limit_gib 31 2>&1 | tail -1
timeout 60 $B --config train_configs/rtx5090_124m.toml --steps 20 --workdir $W/e \
  --variant "124m_twd4_ffn_out=--fp8.auto_filter false --fp8.filter_fqns attention" \
  -- --training.local_batch_size 32 2>&1 | tail -1
for f in $W/*/*.log; do echo "-- $f"; grep -E "one block|^error|Error" $f | head -5; done
