#!/usr/bin/env bash
# Ran as probe/call1.sh in the repository root (it cd's to the parent of its own folder).
# Device call 1 of session 8 (#19): where a 124m bf16 step's time goes; attention backends at
# 124m's shape; 1b under a 31 GiB cap without recompute (chunked loss) against uncapped.
set -u
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader
python3 -c "import torch, torchao; print('torch', torch.__version__, 'torchao', torchao.__version__)"
W=/tmp/w; mkdir -p $W
C="--corpus $W/cache"
echo "== 124m bf16 profile (batch 32, seq 2048)"
timeout 150 python3 scripts/bench_train.py --config train_configs/rtx5090_124m.toml --steps 12 --log-freq 4 $C \
  --workdir $W/p --variant "bf16=--fp8.recipe none" -- --training.local_batch_size 32 --compile.enable \
  --profiling.enable --profiling.freq 10 --profiling.warmup 2 --profiling.active 2 2>&1 | tail -3
python3 scripts/summarize_trace.py $W/p/bf16/profile/step-10/rank0_trace.json --top 40 2>&1 | head -80
echo "== attention 124m batch 32 seq 2048"
timeout 60 python3 scripts/bench_attention.py --flavor 124m --batch 32 --seq 2048 2>&1 | tail -8
echo "== 1b uncapped references (batch 6, seq 4096)"
timeout 170 python3 scripts/bench_train.py --config train_configs/llama3_1b.toml --steps 20 --log-freq 5 $C \
  --workdir $W/u --variant "bf16=--fp8.recipe none" --variant "tw=--fp8.recipe tensorwise" -- --compile.enable 2>&1 | tail -4
echo "== 1b under a 31 GiB cap (rtx5090_1b.toml: micro-batch 1 x 8)"
N="--activation_checkpoint.mode none --training.loss_chunk_tokens 4096"
timeout 200 python3 scripts/bench_train.py --config train_configs/rtx5090_1b.toml --steps 20 --log-freq 5 $C \
  --workdir $W/c --variant "bf16_noac_chunk=--fp8.recipe none $N" \
  --variant "tw_noac_chunk=--fp8.recipe tensorwise --fp8.auto_filter true $N" \
  -- --compile.enable --training.gpu_memory_limit_gib 31 2>&1 | tail -4
for f in $W/c/*.log; do grep -m2 -E "^error|OutOfMemory" $f; done
