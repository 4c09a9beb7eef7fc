#!/usr/bin/env bash
# Device call 2 of session 11 (#19): call 1's coordinate-descent run timed out at 200 s; give it
# room, to learn what the tuning wins and what it costs the first step (124m bf16, batch 64).
set -u
cd "$(dirname "$0")/.."
W=/tmp/w; mkdir -p $W
B="python3 scripts/bench_train.py --log-freq 4 --corpus $W/cache --steps 20 --config train_configs/rtx5090_124m.toml"
run() { local t=$1; shift; timeout $t $B --workdir $W/$1 --variant "$2" -- --training.local_batch_size 64 2>&1 | tail -1; }
run 80 g "bf16_again=--fp8.recipe none"
run 480 h "bf16_cdt=TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1 --fp8.recipe none"
