#!/usr/bin/env bash
# Device call 6 of session 9 (#19), the same machine as call 5 right after it: the two 8-bit runs
# under the 31 GiB cap again (is 0.90 more than noise?), measure on the shipped 32 GB config, and
# the shipped 124m float8 config at batch 32 over whole logits and with fused chunks.
set -u
cd "$(dirname "$0")/.."
W=/tmp/w; mkdir -p $W
B="python3 scripts/bench_train.py --log-freq 4 --corpus $W/cache --steps 16"
E="--optimizer.state_dtype 8bit --training.gpu_memory_limit_gib 31 --activation_checkpoint.mode none"
timeout 60 $B --config train_configs/rtx5090_1b.toml --workdir $W/i \
  --variant "cap_tw_8bit_mb3_g6_c4096_again=--fp8.recipe tensorwise $E --training.local_batch_size 3 --training.global_batch_size 6" 2>&1 | tail -1
timeout 60 $B --config train_configs/rtx5090_1b.toml --workdir $W/j \
  --variant "cap_bf16_8bit_mb2_g8_c4096_again=--fp8.recipe none $E --training.local_batch_size 2" 2>&1 | tail -1
timeout 90 $B --config train_configs/rtx5090_1b.toml --workdir $W/k \
  --variant "shipped_tw_measure=--training.gpu_memory_limit_gib 31 --fp8.auto_filter measure" 2>&1 | tail -1
timeout 60 $B --config train_configs/rtx5090_124m.toml --workdir $W/l \
  --variant "124m_twd4_measure_whole=" -- --training.local_batch_size 32 2>&1 | tail -1
timeout 60 $B --config train_configs/rtx5090_124m.toml --workdir $W/m \
  --variant "124m_twd4_measure_fused16k=--training.loss_chunk_tokens 16384" -- --training.local_batch_size 32 2>&1 | tail -1
for f in $W/[ijklm]/*.log; do echo "-- $f"; grep -E "<- chosen|^error|Error|out of" $f | head -3; done
