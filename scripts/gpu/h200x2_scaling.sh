#!/usr/bin/env bash
# H200s of one host: per-GPU tokens/s of the 1b preset on 1 GPU vs FSDP over NGPU (default 2), in
# bf16 and tensorwise float8 (float8 all-gather on NGPU). Same host, runs back to back. Tables last.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
n=${NGPU:-2}
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
python3 -c "from titanlike.data import build_default_corpus; build_default_corpus('/tmp/corpus')"
common=(--config train_configs/llama3_1b.toml --steps ${STEPS:-25} --log-freq 5 --corpus /tmp/corpus)
args=(-- --data.seq_len 4096 --training.local_batch_size 6 --compile.enable)
CUDA_VISIBLE_DEVICES=0 python3 scripts/bench_train.py "${common[@]}" --ngpu 1 --workdir /tmp/b1 --out "$OUT/1gpu.json" \
  --variant "1gpu_bf16=--fp8.recipe none" --variant "1gpu_tensorwise=--fp8.recipe tensorwise" "${args[@]}" > "$OUT/1gpu.txt" 2>&1
python3 scripts/bench_train.py "${common[@]}" --ngpu $n --workdir /tmp/b$n --out "$OUT/${n}gpu.json" \
  --variant "${n}gpu_bf16=--fp8.recipe none" --variant "${n}gpu_tensorwise=--fp8.recipe tensorwise" "${args[@]}" > "$OUT/${n}gpu.txt" 2>&1
tail -n 4 "$OUT/1gpu.txt"; tail -n 4 "$OUT/${n}gpu.txt"
python3 - <<PY
import json
one = {r["variant"].split("_", 1)[1]: r for r in json.load(open("$OUT/1gpu.json"))["results"]}
many = {r["variant"].split("_", 1)[1]: r for r in json.load(open("$OUT/${n}gpu.json"))["results"]}
print("\nrecipe       1 GPU tok/s   $n GPUs tok/s/GPU   per-GPU scaling")
for k in one:
    if one[k].get("tps") and many.get(k, {}).get("tps"):
        print(f"{k:<12} {one[k]['tps']:>11,.0f}   {many[k]['tps']:>16,.0f}   {many[k]['tps'] / one[k]['tps']:>8.1%}")
PY
