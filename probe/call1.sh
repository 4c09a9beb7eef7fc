#!/usr/bin/env bash
# Device call 1 of session 9 (#19): 1b uncapped (compiled head: the regression check and the
# reference), then under a 31 GiB cap with 8-bit moments: the fused chunked loss at micro-batch 2,
# and micro-batch 4 with compile's memory budget.
set -u
cd "$(dirname "$0")/.."
W=/tmp/w; mkdir -p $W
B="python3 scripts/bench_train.py --log-freq 4 --corpus $W/cache --steps 16"
K="--training.loss_chunk_tokens 4096 --optimizer.state_dtype 8bit --training.gpu_memory_limit_gib 31"
timeout 125 $B --config train_configs/llama3_1b.toml --workdir $W/a --variant "1b_bf16=--fp8.recipe none" \
  -- --compile.enable 2>&1 | tail -1
timeout 95 $B --config train_configs/llama3_1b.toml --workdir $W/b --variant "1b_tw=--fp8.recipe tensorwise" \
  -- --compile.enable 2>&1 | tail -1
timeout 100 $B --config train_configs/rtx5090_1b.toml --workdir $W/c \
  --variant "cap_bf16_8bit_mb2_fused=--fp8.recipe none $K --activation_checkpoint.mode none --training.local_batch_size 2" \
  -- --compile.enable 2>&1 | tail -1
timeout 105 $B --config train_configs/rtx5090_1b.toml --workdir $W/d \
  --variant "cap_tw_8bit_mb2_fused=--fp8.recipe tensorwise $K --activation_checkpoint.mode none --training.local_batch_size 2" \
  -- --compile.enable 2>&1 | tail -1
timeout 110 $B --config train_configs/rtx5090_1b.toml --workdir $W/e \
  --variant "cap_tw_8bit_mb4_budget06=--fp8.recipe tensorwise $K --activation_checkpoint.mode budget --activation_checkpoint.memory_budget 0.6 --training.local_batch_size 4" \
  -- --compile.enable 2>&1 | tail -1
for f in $W/*/*.log; do echo "-- $f"; grep -E "^error|Error|out of" $f | head -3; done
