#!/usr/bin/env bash
# Device call 2 of session 9 (#19): bf16 under the 31 GiB cap with 8-bit moments and the fused
# chunked loss: micro-batch 2 with a light memory budget, micro-batch 4 with a tight one; float8 at
# micro-batch 3 (global batch 6, the uncapped batch) without recompute.
set -u
cd "$(dirname "$0")/.."
W=/tmp/w; mkdir -p $W
B="python3 scripts/bench_train.py --log-freq 4 --corpus $W/cache --steps 16"
K="--training.loss_chunk_tokens 4096 --optimizer.state_dtype 8bit --training.gpu_memory_limit_gib 31"
timeout 110 $B --config train_configs/rtx5090_1b.toml --workdir $W/f \
  --variant "cap_bf16_8bit_mb2_budget08=--fp8.recipe none $K --activation_checkpoint.mode budget --activation_checkpoint.memory_budget 0.8 --training.local_batch_size 2" \
  -- --compile.enable 2>&1 | tail -1
timeout 110 $B --config train_configs/rtx5090_1b.toml --workdir $W/g \
  --variant "cap_bf16_8bit_mb4_budget045=--fp8.recipe none $K --activation_checkpoint.mode budget --activation_checkpoint.memory_budget 0.45 --training.local_batch_size 4" \
  -- --compile.enable 2>&1 | tail -1
timeout 110 $B --config train_configs/rtx5090_1b.toml --workdir $W/h \
  --variant "cap_tw_8bit_mb3_g6=--fp8.recipe tensorwise $K --activation_checkpoint.mode none --training.local_batch_size 3 --training.global_batch_size 6" \
  -- --compile.enable 2>&1 | tail -1
timeout 110 $B --config train_configs/rtx5090_1b.toml --workdir $W/i \
  --variant "cap_bf16_8bit_mb2_c2048=--fp8.recipe none $K --activation_checkpoint.mode none --training.local_batch_size 2 --training.loss_chunk_tokens 2048" \
  -- --compile.enable 2>&1 | tail -1
for f in $W/[fghi]/*.log; do echo "-- $f"; grep -E "^error|Error|out of" $f | head -3; done
