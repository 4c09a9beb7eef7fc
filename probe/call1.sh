#!/usr/bin/env bash
# Device call 1 of session 11 (#19): inductor switches that target the 124m step's elementwise
# kernels (a third of a float8 step) and the gaps between kernels, at batch 64:
#   mix-order reduction (RMSNorm backward's row and column reductions in one kernel),
#   coordinate-descent tuning of Triton block sizes, programmatic dependent launch (Hopper).
set -u
cd "$(dirname "$0")/.."
W=/tmp/w; mkdir -p $W
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader
python3 - <<'PY'
import torch, torchao, torch._inductor.config as c
print(torch.__version__, torchao.__version__)
for k in ("coordinate_descent_tuning",):
    print(k, getattr(c, k, "absent"))
for k in ("mix_order_reduction", "enable_pdl"):
    print("triton." + k, getattr(c.triton, k, "absent"))
PY
B="python3 scripts/bench_train.py --log-freq 4 --corpus $W/cache --steps 20 --config train_configs/rtx5090_124m.toml"
run() { local t=$1; shift; timeout $t $B --workdir $W/$1 --variant "$2" -- --training.local_batch_size 64 2>&1 | tail -1; }
run 150 a "bf16=--fp8.recipe none"
run 120 b "bf16_mix=TORCHINDUCTOR_MIX_ORDER_REDUCTION=1 --fp8.recipe none"
run 120 c "bf16_pdl=TORCHINDUCTOR_ENABLE_PDL=1 --fp8.recipe none"
run 200 d "bf16_cdt=TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1 --fp8.recipe none"
run 120 e "twd4_measure="
run 200 f "twd4_measure_all3=TORCHINDUCTOR_MIX_ORDER_REDUCTION=1 TORCHINDUCTOR_ENABLE_PDL=1 TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1"
for f in $W/?/*.log; do echo "-- $f"; grep -E "<- chosen|^error|Error|out of" $f | head -3; done
