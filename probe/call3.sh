#!/usr/bin/env bash
# Device call 3 of session 11 (#19): is there a block choice between measure's 'feed-forward' and
# 'all'? Float8 on the feed-forward and the qkv projection (whose input cast can fuse into the
# attention norm, as the feed-forward's does into its norm), the output projection wo in bf16.
# 124m, seq 2048, batch 64, delayed tensorwise every 4 steps, back to back with bf16.
set -u
cd "$(dirname "$0")/.."
W=/tmp/w; mkdir -p $W
B="python3 scripts/bench_train.py --log-freq 4 --corpus $W/cache --steps 24 --config train_configs/rtx5090_124m.toml"
run() { local t=$1; shift; timeout $t $B --workdir $W/$1 --variant "$2" -- --training.local_batch_size 64 2>&1 | tail -1; }
run 150 a "bf16=--fp8.recipe none"
run 150 b "twd4_measure="
run 120 c "twd4_ffn_qkv=--fp8.auto_filter false --fp8.filter_fqns wo,output"
run 120 d "twd4_all_blocks=--fp8.auto_filter false --fp8.filter_fqns output"
run 120 e "twd4_ffn_qkv_again=--fp8.auto_filter false --fp8.filter_fqns wo,output"
run 120 f "twd4_measure_again="
for f in $W/?/*.log; do echo "-- $f"; grep -E "<- chosen|^error|Error|out of|stays in high" $f | head -4; done
