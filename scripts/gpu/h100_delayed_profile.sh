#!/usr/bin/env bash
# One H100, 1b: one profiled step of tensorwise with dynamic and with delayed scaling, the delayed
# one compared kernel by kernel against the dynamic one (scripts/summarize_trace.py --against): which
# amax passes does delayed scaling still pay for? Written 2026-11-22 (sixth session).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
python3 -c "from titanlike.data import build_default_corpus; build_default_corpus('/tmp/corpus')"
declare -A scaling=([dynamic]="" [delayed]="--fp8.scaling delayed")
for name in dynamic delayed; do
  mkdir -p /tmp/$name && ln -sfn /tmp/corpus /tmp/$name/corpus
  python3 -m titanlike.train --job.config_file train_configs/llama3_1b.toml --job.dump_folder /tmp/$name \
    --data.seq_len 4096 --training.local_batch_size 6 --compile.enable --fp8.recipe tensorwise ${scaling[$name]} \
    --training.steps 12 --metrics.log_freq 4 --validation.enable false \
    --profiling.enable --profiling.freq 10 --profiling.warmup 2 --profiling.active 1 > "$OUT/$name.log" 2>&1
  echo "$name rc=$?"; grep -E "train step +12|error" "$OUT/$name.log"
done
python3 scripts/summarize_trace.py /tmp/dynamic/profile/step-10/rank0_trace.json --top 40 > "$OUT/summary_dynamic.txt"
python3 scripts/summarize_trace.py /tmp/delayed/profile/step-10/rank0_trace.json --top 40 \
  --against /tmp/dynamic/profile/step-10/rank0_trace.json > "$OUT/summary_delayed.txt"
head -n 14 "$OUT/summary_dynamic.txt"; echo; cat "$OUT/summary_delayed.txt" | cut -c1-150
