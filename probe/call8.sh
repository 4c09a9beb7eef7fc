#!/usr/bin/env bash
# Device call 8 of session 10 (#19): 8-bit moments saved in the background (HostCopyStager).
# (1) 1b 8-bit config capped at 31 GiB, saves at steps 10 and 20 in the background (pinned buffers,
#     allocated at the first, reused at the second) and at the end; (2) on the debug model, a resume
#     from a background-saved 8-bit step against the uninterrupted run, deterministic.
set -u
cd "$(dirname "$0")/.."
W=/tmp/w; mkdir -p $W
B="python3 scripts/bench_train.py --log-freq 4 --corpus $W/cache"
C="--training.gpu_memory_limit_gib 31 --checkpoint.enable true --checkpoint.interval 10"
timeout 330 $B --steps 24 --config train_configs/rtx5090_1b_8bit.toml --workdir $W/a \
  --variant "1b_8bit_pinned_bg=$C --checkpoint.async_mode async_with_pinned_mem" 2>&1 | tail -1
grep -h "stalled\|^error\|Error" $W/a/*.log | head
rm -rf $W/a
D=$W/d; mkdir -p $D
common=(--job.config_file train_configs/debug_model.toml --training.steps 12 --data.seq_len 256 --metrics.log_freq 1
        --checkpoint.enable --checkpoint.interval 4 --checkpoint.async_mode async_with_pinned_mem --validation.enable false
        --optimizer.state_dtype 8bit --training.deterministic --training.device cuda)
timeout 120 python3 -m titanlike.train --job.dump_folder $D/ref "${common[@]}" > $D/ref.log 2>&1 || tail -5 $D/ref.log
grep -h "stalled" $D/ref.log | head -4
mkdir -p $D/res/checkpoint && cp -r $D/ref/checkpoint/step-8 $D/res/checkpoint/
timeout 120 python3 -m titanlike.train --job.dump_folder $D/res "${common[@]}" > $D/res.log 2>&1 || tail -5 $D/res.log
grep -h "resumed from" $D/res.log | head -2
python3 - <<'PY'
import json
def losses(d):
    return {r["step"]: r["loss"] for r in map(json.loads, open(f"/tmp/w/d/{d}/metrics.jsonl")) if r.get("kind", "train") == "train" and "loss" in r}
a, b = losses("ref"), losses("res")
print("step  uninterrupted  resumed-from-8 (background-saved)  equal")
for s in sorted(b):
    print(f"{s:4d}  {a[s]:.6f}  {b[s]:.6f}  {a[s] == b[s]}")
PY
