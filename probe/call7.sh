#!/usr/bin/env bash
# Device call 7 of session 9 (#19): the shipped rtx5090_124m.toml as shipped (batch 24) under a
# 31 GiB cap, and at batch 32 with fused loss chunks of 16384 against whole logits.
set -u
cd "$(dirname "$0")/.."
W=/tmp/w; mkdir -p $W
B="python3 scripts/bench_train.py --log-freq 4 --corpus $W/cache --steps 20"
timeout 200 $B --config train_configs/rtx5090_124m.toml --workdir $W/a \
  --variant "124m_shipped_cap31=--training.gpu_memory_limit_gib 31" 2>&1 | tail -1
timeout 110 $B --config train_configs/rtx5090_124m.toml --workdir $W/b \
  --variant "124m_shipped_b32_whole=" -- --training.local_batch_size 32 2>&1 | tail -1
timeout 110 $B --config train_configs/rtx5090_124m.toml --workdir $W/c \
  --variant "124m_shipped_b32_fused16k=--training.loss_chunk_tokens 16384" -- --training.local_batch_size 32 2>&1 | tail -1
for f in $W/*/*.log; do echo "-- $f"; grep -E "<- chosen|^error|Error|out of" $f | head -3; done
