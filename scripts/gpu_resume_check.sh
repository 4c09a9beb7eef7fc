#!/usr/bin/env bash
# Resume checks on one GPU: a resume after a changed LR, and after a damaged newest step.
#
#   scripts/gpu_resume_check.sh                       # debug model, 40 steps (about a minute)
#   CONFIG=train_configs/llama3_1b.toml STEPS=40 SEQ=2048 scripts/gpu_resume_check.sh
#   (DEVICE=cpu and DATA=<shards> try it without a GPU; OUT=<folder> keeps the runs there)
#
# Runs, each with `python -m titanlike.train` on GPU 0, checkpoints every STEPS/4 steps:
#   ref      STEPS uninterrupted steps
#   lr       from ref's checkpoint at STEPS/2, with --optimizer.lr halved: the log must name the change
#            and step STEPS/2+1 must use the halved LR
#   damaged  from copies of ref's checkpoints at STEPS/2 and 3·STEPS/4, the newer one with 4 KiB zeroed
#            in a tensor file: it must be set aside and the run resume from STEPS/2, its losses close to ref's
# and prints one table. The loss tolerance is GPU non-determinism (docs/checkpointing.md): another
# batch or lost weights would differ by far more.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CONFIG="${CONFIG:-$here/train_configs/debug_model.toml}"
STEPS="${STEPS:-40}"
SEQ="${SEQ:-256}"
OUT="${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/resume_check.XXXXXX")}"
PY="${PYTHON:-python3}"
half=$((STEPS / 2)); three=$((3 * STEPS / 4)); every=$((STEPS / 4))
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
common=(--job.config_file "$CONFIG" --training.steps "$STEPS" --data.seq_len "$SEQ" --metrics.log_freq 1
        --checkpoint.enable --checkpoint.interval "$every" --validation.enable false --training.device "${DEVICE:-cuda}"
        ${DATA:+--data.path "$DATA"})
run() { local dump=$1; shift; "$PY" -m titanlike.train --job.dump_folder "$dump" "${common[@]}" "$@" >"$dump.log" 2>&1 \
          || { echo "run $dump failed:"; tail -20 "$dump.log"; exit 1; }; }

mkdir -p "$OUT"
echo "writing to $OUT"
run "$OUT/ref"
lr=$("$PY" -c "import sys; from titanlike.config import load_config; print(load_config(['--job.config_file', sys.argv[1]]).optimizer.lr)" "$CONFIG")
new_lr=$("$PY" -c "print(float('$lr') / 2)")

mkdir -p "$OUT/lr/checkpoint"
cp -r "$OUT/ref/checkpoint/step-$half" "$OUT/lr/checkpoint/"
run "$OUT/lr" --optimizer.lr "$new_lr"

mkdir -p "$OUT/damaged/checkpoint"
cp -r "$OUT/ref/checkpoint/step-$half" "$OUT/ref/checkpoint/step-$three" "$OUT/damaged/checkpoint/"
"$PY" - "$OUT/damaged/checkpoint/step-$three" <<'EOF'
import os, sys
path = os.path.join(sys.argv[1], sorted(f for f in os.listdir(sys.argv[1]) if f.endswith(".distcp"))[0])
with open(path, "r+b") as f:
    f.seek(os.path.getsize(path) // 2)
    f.write(bytes(4096))
EOF
run "$OUT/damaged"

"$PY" - "$OUT" "$half" "$STEPS" "$lr" "$new_lr" "$CONFIG" <<'EOF'
import json, os, sys
from titanlike.config import load_config
from titanlike.optim import lr_factor

out, half, steps, lr, new_lr, config = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5]), sys.argv[6]
s = load_config(["--job.config_file", config]).lr_scheduler

def records(name):
    with open(os.path.join(out, name, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f) if r.get("kind") == "train"}

def log(name):
    with open(os.path.join(out, f"{name}.log")) as f:
        return f.read()

ref = records("ref")
rows = []
lr_run, lr_log = records("lr"), log("lr")
want = new_lr * lr_factor(half + 1, steps, s.warmup_steps, s.decay_ratio, s.decay_type, s.min_lr_factor)
got = lr_run[half + 1]["lr"]
rows.append(("lr halved", f"step-{half}", f"optimizer.lr: checkpoint {lr} → config {new_lr}" in lr_log,
             f"{got:.3e} (want {want:.3e})", abs(got - want) <= 1e-6 * want,
             max(abs(lr_run[k]["loss"] - ref[k]["loss"]) for k in lr_run), None))
dmg, dmg_log = records("damaged"), log("damaged")
resumed = f"resumed from {out}/damaged/checkpoint/step-{half} at step {half}" in dmg_log
delta = max(abs(dmg[k]["loss"] - ref[k]["loss"]) for k in dmg)
rows.append(("newest step damaged", f"step-{half}" if resumed else "?", "checkpoint damaged:" in dmg_log
             and "falling back" in dmg_log, "-", True, delta, sorted(dmg) == list(range(half + 1, steps + 1))))
print()
print("| run | resumed from | expected log line | first LR | LR ok | max |Δloss| vs ref | steps ok |")
print("|---|---|---|---|---|---:|---|")
for name, src, line, lr_text, lr_ok, d, steps_ok in rows:
    print(f"| {name} | {src} | {'yes' if line else 'NO'} | {lr_text} | {'yes' if lr_ok else 'NO'} | {d:.2e} | "
          f"{'-' if steps_ok is None else ('yes' if steps_ok else 'NO')} |")
print("\n(lr halved: |Δloss| is expected to grow, the LR differs; damaged: it must stay at the level of GPU "
      "non-determinism, ~1e-3 to 4e-2 for 1b)")
EOF
