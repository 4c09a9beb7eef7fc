#!/usr/bin/env bash
# One H100: (1) a torch.profiler trace of one 1b tensorwise-float8 step, summarised by kernel;
# (2) the RTX 5090 config (train_configs/rtx5090_1b.toml) under a 31 GiB cap, proving the fit.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
python3 -c "from titanlike.data import build_default_corpus; build_default_corpus('/tmp/p/corpus')"
python3 -m titanlike.train --job.config_file train_configs/llama3_1b.toml --job.dump_folder /tmp/p \
  --data.seq_len 4096 --training.local_batch_size 6 --compile.enable --fp8.recipe tensorwise \
  --training.steps 12 --metrics.log_freq 4 --validation.enable false \
  --profiling.enable --profiling.freq 10 --profiling.warmup 2 --profiling.active 1 > "$OUT/profile_run.log" 2>&1
echo "profile run rc=$?"; grep -E "train step|profiling|error" "$OUT/profile_run.log"
trace=$(ls /tmp/p/profile/step-10/rank0_trace.json) && gzip -c "$trace" > "$OUT/1b_tensorwise_step10_trace.json.gz"
python3 scripts/summarize_trace.py "$trace" --top 20 | tee "$OUT/trace_summary.txt"
mkdir -p /tmp/r && ln -sfn /tmp/p/corpus /tmp/r/corpus
python3 -m titanlike.train --job.config_file train_configs/rtx5090_1b.toml --job.dump_folder /tmp/r \
  --training.gpu_memory_limit_gib 31 --training.steps 15 --metrics.log_freq 5 --validation.enable false \
  --checkpoint.enable false > "$OUT/rtx5090_fit.log" 2>&1
echo "rtx5090 fit (31 GiB cap) rc=$?"; grep -E "model 1b|float8|train step|error" "$OUT/rtx5090_fit.log"
