#!/usr/bin/env bash
# Device call 3 of session 9 (#19): the 31 GiB cap at global batch 6 (the uncapped batch) with
# 8-bit moments and fused loss chunks of 2048: float8 and bf16 at micro-batch 3, float8 in one
# micro-batch of 6 under a memory budget.
set -u
cd "$(dirname "$0")/.."
W=/tmp/w; mkdir -p $W
B="python3 scripts/bench_train.py --log-freq 4 --corpus $W/cache --steps 16"
K="--training.loss_chunk_tokens 2048 --optimizer.state_dtype 8bit --training.gpu_memory_limit_gib 31 --training.global_batch_size 6"
timeout 110 $B --config train_configs/rtx5090_1b.toml --workdir $W/j \
  --variant "cap_tw_8bit_mb3_g6_c2048=--fp8.recipe tensorwise $K --activation_checkpoint.mode none --training.local_batch_size 3" \
  -- --compile.enable 2>&1 | tail -1
timeout 110 $B --config train_configs/rtx5090_1b.toml --workdir $W/k \
  --variant "cap_bf16_8bit_mb3_g6_c2048_b07=--fp8.recipe none $K --activation_checkpoint.mode budget --activation_checkpoint.memory_budget 0.7 --training.local_batch_size 3" \
  -- --compile.enable 2>&1 | tail -1
timeout 110 $B --config train_configs/rtx5090_1b.toml --workdir $W/l \
  --variant "cap_tw_8bit_mb6_g6_c2048_b04=--fp8.recipe tensorwise $K --activation_checkpoint.mode budget --activation_checkpoint.memory_budget 0.4 --training.local_batch_size 6" \
  -- --compile.enable 2>&1 | tail -1
for f in $W/[jkl]/*.log; do echo "-- $f"; grep -E "^error|Error|out of" $f | head -3; done
