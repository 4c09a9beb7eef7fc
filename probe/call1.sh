#!/usr/bin/env bash
# Device call 1 of session 10 (#19): does inductor's max-autotune for matmuls (Triton templates
# with the norms / SwiGLU fused into their epilogues) speed up 124m bf16, and what does it cost
# the first step? 124m, seq 2048, batch 32, compile.
set -u
cd "$(dirname "$0")/.."
W=/tmp/w; mkdir -p $W
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader
python3 -c "import torch, torchao; print(torch.__version__, torchao.__version__)"
B="python3 scripts/bench_train.py --log-freq 4 --corpus $W/cache --steps 20"
timeout 170 $B --config train_configs/rtx5090_124m.toml --workdir $W/a \
  --variant "124m_bf16=--fp8.recipe none" -- --training.local_batch_size 32 2>&1 | tail -1
timeout 400 $B --config train_configs/rtx5090_124m.toml --workdir $W/b \
  --variant "124m_bf16_maxat_gemm=TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1 --fp8.recipe none" -- --training.local_batch_size 32 2>&1 | tail -1
for f in $W/[ab]/*.log; do echo "-- $f"; grep -E "<- chosen|^error|Error|out of" $f | head -3; done
