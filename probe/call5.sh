#!/usr/bin/env bash
# Device call 5 of session 9 (#19), a fresh machine: 1b uncapped references; under the 31 GiB cap
# the 8-bit runs with the fused loss summing the weight gradient in bf16, and the shipped
# rtx5090_1b.toml (fp32 moments, full recompute) now that its chunked loss is fused; 124m bf16 over
# whole logits (compiled head) against fused chunks; measure on the shipped 32 GB config.
set -u
cd "$(dirname "$0")/.."
W=/tmp/w; mkdir -p $W
B="python3 scripts/bench_train.py --log-freq 4 --corpus $W/cache --steps 16"
E="--optimizer.state_dtype 8bit --training.gpu_memory_limit_gib 31 --activation_checkpoint.mode none"
timeout 110 $B --config train_configs/llama3_1b.toml --workdir $W/a --variant "1b_bf16=--fp8.recipe none" \
  -- --compile.enable 2>&1 | tail -1
timeout 70 $B --config train_configs/llama3_1b.toml --workdir $W/b --variant "1b_tw=--fp8.recipe tensorwise" \
  -- --compile.enable 2>&1 | tail -1
timeout 70 $B --config train_configs/rtx5090_1b.toml --workdir $W/c \
  --variant "cap_bf16_8bit_mb2_g8_c4096=--fp8.recipe none $E --training.local_batch_size 2" 2>&1 | tail -1
timeout 80 $B --config train_configs/rtx5090_1b.toml --workdir $W/d \
  --variant "cap_tw_8bit_mb3_g6_c4096=--fp8.recipe tensorwise $E --training.local_batch_size 3 --training.global_batch_size 6" 2>&1 | tail -1
timeout 70 $B --config train_configs/rtx5090_1b.toml --workdir $W/e \
  --variant "shipped_tw=--training.gpu_memory_limit_gib 31" 2>&1 | tail -1
timeout 70 $B --config train_configs/rtx5090_1b.toml --workdir $W/f \
  --variant "shipped_bf16=--fp8.recipe none --training.gpu_memory_limit_gib 31" 2>&1 | tail -1
timeout 100 $B --config train_configs/rtx5090_124m.toml --workdir $W/g \
  --variant "124m_bf16_whole=--fp8.recipe none" -- --training.local_batch_size 32 2>&1 | tail -1
timeout 60 $B --config train_configs/rtx5090_124m.toml --workdir $W/h \
  --variant "124m_bf16_fused16k=--fp8.recipe none --training.loss_chunk_tokens 16384" -- --training.local_batch_size 32 2>&1 | tail -1
for f in $W/*/*.log; do echo "-- $f"; grep -E "^error|Error|out of" $f | head -3; done
