#!/usr/bin/env bash
# Device call 10 of session 10: 8-bit moments under FSDP on two GPUs, saved in the background (the
# staged DTensors hold host copies of CUDA 8-bit shards): a resume from a background-saved step
# against the uninterrupted run, deterministic, debug model.
set -u
cd "$(dirname "$0")/.."
D=/tmp/w/d; mkdir -p $D
common=(--training.steps 12 --data.seq_len 256 --metrics.log_freq 1
        --checkpoint.enable --checkpoint.interval 4 --checkpoint.async_mode async_with_pinned_mem --validation.enable false
        --optimizer.state_dtype 8bit --training.deterministic --training.global_batch_size 32)
NGPU=2 timeout 200 ./run_train.sh --job.dump_folder $D/ref "${common[@]}" > $D/ref.log 2>&1 || tail -20 $D/ref.log
grep -h "dp_shard\|stalled" $D/ref.log | head -5
mkdir -p $D/res/checkpoint && cp -r $D/ref/checkpoint/step-8 $D/res/checkpoint/
NGPU=2 timeout 150 ./run_train.sh --job.dump_folder $D/res "${common[@]}" > $D/res.log 2>&1 || tail -20 $D/res.log
grep -h "resumed from" $D/res.log | head -2
python3 - <<'PY'
import json
def losses(d):
    return {r["step"]: r["loss"] for r in map(json.loads, open(f"/tmp/w/d/{d}/metrics.jsonl")) if r.get("kind") == "train"}
a, b = losses("ref"), losses("res")
print("step  uninterrupted  resumed-from-8 (background-saved, 2 GPUs)  equal")
for s in sorted(b):
    print(f"{s:4d}  {a[s]:.6f}  {b[s]:.6f}  {a[s] == b[s]}")
PY
