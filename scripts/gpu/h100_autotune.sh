#!/usr/bin/env bash
# One H100: does inductor's GEMM autotuning (TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1: Triton templates,
# rowwise-scaled ones included, benchmarked against cuBLAS/CUTLASS) make rowwise float8 pay on
# the 1b preset, and what does it cost in time to the first step? Back to back; table last.
# 2026-11-22 on one H100 the autotuned rowwise run had not reached its first step when the 600 s
# call ended (docs/benchmarks/2026-11-22-fused-all-gather-cast.md, call 3): not pursued.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
python3 -c "from titanlike.data import build_default_corpus; build_default_corpus('/tmp/corpus')"
common=(--config train_configs/llama3_1b.toml --steps 20 --log-freq 5 --corpus /tmp/corpus)
tail_args=(-- --data.seq_len 4096 --training.local_batch_size 6 --compile.enable)
python3 scripts/bench_train.py "${common[@]}" --workdir /tmp/a --out "$OUT/default.json" \
  --variant "bf16=--fp8.recipe none" --variant "rw_all=--fp8.recipe rowwise --fp8.auto_filter false" \
  "${tail_args[@]}" > "$OUT/default.txt" 2>&1
tail -n 4 "$OUT/default.txt"
TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1 python3 scripts/bench_train.py "${common[@]}" --workdir /tmp/b --out "$OUT/autotune.json" \
  --variant "rw_all_autotune=--fp8.recipe rowwise --fp8.auto_filter false" --variant "bf16_autotune=--fp8.recipe none" \
  --variant "tw_autotune=--fp8.recipe tensorwise" "${tail_args[@]}" > "$OUT/autotune.txt" 2>&1
tar -czf "$OUT/logs.tgz" /tmp/a/*.log /tmp/b/*.log 2>/dev/null
echo; tail -n 4 "$OUT/default.txt"; tail -n 5 "$OUT/autotune.txt"
