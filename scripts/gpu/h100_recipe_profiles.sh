#!/usr/bin/env bash
# One H100: one profiled 1b step per recipe (bf16, tensorwise, rowwise with every layer but the
# output converted, rowwise_with_gw_hp), each summarised, and each float8 recipe compared kernel by
# kernel against bf16 (scripts/summarize_trace.py --against). Where does rowwise lose its matmul
# gain: its GEMM kernels or its casts? Summaries last. (Written 2026-11-22; run in the fifth session:
# its casts, docs/benchmarks/2026-11-22-h100-1b-recipe-profiles.txt.)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
python3 -c "from titanlike.data import build_default_corpus; build_default_corpus('/tmp/corpus')"
declare -A recipe=([bf16]="--fp8.recipe none" [tensorwise]="--fp8.recipe tensorwise"
                   [rowwise]="--fp8.recipe rowwise --fp8.auto_filter false"
                   [rowwise_gw_hp]="--fp8.recipe rowwise_with_gw_hp --fp8.auto_filter false")
for name in bf16 tensorwise rowwise rowwise_gw_hp; do
  mkdir -p /tmp/$name && ln -sfn /tmp/corpus /tmp/$name/corpus
  python3 -m titanlike.train --job.config_file train_configs/llama3_1b.toml --job.dump_folder /tmp/$name \
    --data.seq_len 4096 --training.local_batch_size 6 --compile.enable ${recipe[$name]} \
    --training.steps 12 --metrics.log_freq 4 --validation.enable false \
    --profiling.enable --profiling.freq 10 --profiling.warmup 2 --profiling.active 1 > "$OUT/$name.log" 2>&1
  echo "$name rc=$?"; grep -E "train step +12|error" "$OUT/$name.log"
done
for name in bf16 tensorwise rowwise rowwise_gw_hp; do
  against=(); [ $name != bf16 ] && against=(--against /tmp/bf16/profile/step-10/rank0_trace.json)
  python3 scripts/summarize_trace.py /tmp/$name/profile/step-10/rank0_trace.json --top 30 "${against[@]}" > "$OUT/summary_$name.txt"
done
for name in bf16 tensorwise rowwise rowwise_gw_hp; do echo "== $name"; head -n 16 "$OUT/summary_$name.txt"; done
