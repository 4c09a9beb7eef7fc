#!/usr/bin/env bash
# Device call 4 of session 9 (#19): what the 8-bit step costs (1b uncapped, float8, 8-bit moments),
# and fp8.auto_filter = measure on 1b uncapped and on the 31 GiB configuration.
set -u
cd "$(dirname "$0")/.."
W=/tmp/w; mkdir -p $W
B="python3 scripts/bench_train.py --log-freq 4 --corpus $W/cache --steps 16"
K="--training.loss_chunk_tokens 4096 --optimizer.state_dtype 8bit --training.gpu_memory_limit_gib 31 --training.global_batch_size 6 --activation_checkpoint.mode none --training.local_batch_size 3"
timeout 100 $B --config train_configs/llama3_1b.toml --workdir $W/m \
  --variant "1b_tw_8bit=--fp8.recipe tensorwise --optimizer.state_dtype 8bit" -- --compile.enable 2>&1 | tail -1
timeout 130 $B --config train_configs/llama3_1b.toml --workdir $W/n \
  --variant "1b_tw_measure=--fp8.recipe tensorwise --fp8.auto_filter measure" -- --compile.enable 2>&1 | tail -1
timeout 130 $B --config train_configs/rtx5090_1b.toml --workdir $W/o \
  --variant "cap_tw_8bit_mb3_g6_measure=--fp8.recipe tensorwise $K --fp8.auto_filter measure" \
  -- --compile.enable 2>&1 | tail -1
for f in $W/[mno]/*.log; do echo "-- $f"; grep -E "one block|block|^error|Error|out of" $f | head -6; done
