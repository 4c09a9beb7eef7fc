#!/usr/bin/env bash
# Two H200s: where FSDP's per-GPU time goes. 1b tensorwise, one profiled step on 1 GPU and on FSDP
# over 2 (summaries with the GPU timeline: idle, communication, exposed communication), then
# per-GPU tokens/s with NCCL's default CTA count and with NCCL_MAX_CTAS capped (fewer SMs taken
# from compute while communication overlaps it). Tables last.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
python3 -c "from titanlike.data import build_default_corpus; build_default_corpus('/tmp/corpus')"
args=(--job.config_file train_configs/llama3_1b.toml --data.seq_len 4096 --training.local_batch_size 6
      --compile.enable --fp8.recipe ${RECIPE:-tensorwise} --training.steps 12 --metrics.log_freq 4 --validation.enable false
      --profiling.enable --profiling.freq 10 --profiling.warmup 2 --profiling.active 1)
for n in 1 2; do
  mkdir -p /tmp/p$n && ln -sfn /tmp/corpus /tmp/p$n/corpus
  CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) python3 -m torch.distributed.run --standalone --nproc_per_node=$n \
    run_train.sh "${args[@]}" --job.dump_folder /tmp/p$n > "$OUT/profile_${n}gpu.log" 2>&1
  echo "profile ${n} GPU rc=$?"; grep -E "train step|error" "$OUT/profile_${n}gpu.log" | tail -n 3
  trace=/tmp/p$n/profile/step-10/rank0_trace.json
  gzip -c "$trace" > "$OUT/1b_${n}gpu_step10_trace.json.gz"
  python3 scripts/summarize_trace.py "$trace" --top 40 > "$OUT/summary_${n}gpu.txt"
done
common=(--config train_configs/llama3_1b.toml --steps ${STEPS:-20} --log-freq 5 --corpus /tmp/corpus)
tail_args=(-- --data.seq_len 4096 --training.local_batch_size 6 --compile.enable)
CUDA_VISIBLE_DEVICES=0 python3 scripts/bench_train.py "${common[@]}" --ngpu 1 --workdir /tmp/b1 --out "$OUT/1gpu.json" \
  --variant "1gpu_tw=--fp8.recipe tensorwise" "${tail_args[@]}" > "$OUT/bench_1gpu.txt" 2>&1
python3 scripts/bench_train.py "${common[@]}" --ngpu 2 --workdir /tmp/b2 --out "$OUT/2gpu.json" \
  --variant "2gpu_tw=--fp8.recipe tensorwise" "${tail_args[@]}" > "$OUT/bench_2gpu.txt" 2>&1
for ctas in ${CTAS:-8 2}; do
  NCCL_MAX_CTAS=$ctas python3 scripts/bench_train.py "${common[@]}" --ngpu 2 --workdir /tmp/b2c$ctas \
    --out "$OUT/2gpu_ctas$ctas.json" --variant "2gpu_tw_ctas$ctas=--fp8.recipe tensorwise" "${tail_args[@]}" \
    > "$OUT/bench_2gpu_ctas$ctas.txt" 2>&1
done
for n in 1 2; do echo "== ${n} GPU profile"; head -n 14 "$OUT/summary_${n}gpu.txt"; done
for f in "$OUT"/bench_*.txt; do tail -n 2 "$f"; done
