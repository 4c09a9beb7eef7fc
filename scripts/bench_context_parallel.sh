#!/usr/bin/env bash
# Context parallelism on two GPUs against one: speed, memory, the longest window, the first-step loss.
#
#   scripts/bench_context_parallel.sh                    # 1b, about 8 minutes on two H200s
#   SEQS="65536 131072 262144" scripts/bench_context_parallel.sh     # more window lengths to try
#   CONFIG=train_configs/llama3_1b.toml EXTRA="--fp8.recipe none" OUT=/tmp/cp scripts/bench_context_parallel.sh
#
# Runs (each `torchrun run_train.sh` through scripts/bench_train.py, one after the other):
#   speed   data.seq_len SPEED_SEQ (16384), one window per step: cp 1 on one GPU, then --parallel.cp 2 on
#           two (each GPU half of every window, the same windows: the first-step losses must agree to bf16
#           rounding). tok/s is per GPU, so "vs cp1" is the share of one GPU's speed each GPU keeps.
#   long    each of SEQS (131072) with full activation checkpointing and the loss in 8192-token chunks
#           (the logits of a 131072-token window would take 33 GB): cp 2 on two GPUs, then cp 1 on one.
#           A window that does not fit shows as FAILED with its out-of-memory line.
# Prints one table: tok/s per GPU, peak reserved memory beside it, first and last loss.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CONFIG="${CONFIG:-$here/train_configs/llama3_1b.toml}"
SPEED_SEQ="${SPEED_SEQ:-16384}"
SPEED_STEPS="${SPEED_STEPS:-12}"
SEQS="${SEQS:-131072}"
LONG_STEPS="${LONG_STEPS:-3}"
EXTRA="${EXTRA:-}"
OUT="${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/bench_cp.XXXXXX")}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
echo "writing to $OUT"

bench() {  # bench NAME NGPU STEPS VARIANT_OVERRIDES...: one run, its results in $OUT/NAME.json
    local name=$1 ngpu=$2 steps=$3; shift 3
    "$PY" "$here/scripts/bench_train.py" --config "$CONFIG" --ngpu "$ngpu" --steps "$steps" --log-freq 2 \
        --workdir "$OUT/runs" --out "$OUT/$name.json" --variant "$name=$*" -- --training.local_batch_size 1 \
        --training.global_batch_size 1 $EXTRA | tail -1
}

bench "speed-cp1-1gpu" 1 "$SPEED_STEPS" --data.seq_len "$SPEED_SEQ"
bench "speed-cp2-2gpu" 2 "$SPEED_STEPS" --data.seq_len "$SPEED_SEQ" --parallel.cp 2
long=(--activation_checkpoint.mode full --training.loss_chunk_tokens 8192)
for seq in $SEQS; do
    bench "long-$seq-cp2-2gpu" 2 "$LONG_STEPS" --data.seq_len "$seq" --parallel.cp 2 "${long[@]}"
    bench "long-$seq-cp1-1gpu" 1 "$LONG_STEPS" --data.seq_len "$seq" "${long[@]}"
done

"$PY" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
rows = []
for path in sorted(out.glob("*.json"), key=lambda p: p.stat().st_mtime):
    run = json.loads(path.read_text())
    r = run["results"][0]
    metrics = out / "runs" / r["variant"] / "metrics.jsonl"
    train = [m for m in map(json.loads, metrics.read_text().splitlines()) if m.get("kind") == "train"] \
        if metrics.exists() else []
    rows.append((r, run["ngpu"], train[0]["loss"] if train else None))
# Each run's cp 1 counterpart: the same name up to "-cp".
base = {r["variant"].rsplit("-cp", 1)[0]: r["tps"] for r, _, _ in rows if "-cp1-" in r["variant"] and r.get("tps")}
print(f"\n{'run':<24} {'GPUs':>4} {'tok/s/GPU':>10} {'vs cp1':>7} {'peak reserved GiB':>18} "
      f"{'first loss':>10} {'last loss':>9}")
for r, ngpu, first in rows:
    name = r["variant"]
    if r.get("tps") is None:
        print(f"{name:<24} {ngpu:>4} FAILED: {r.get('error', '')}")
        continue
    key = name.rsplit("-cp", 1)[0]
    ratio = f"{r['tps'] / base[key]:.0%}" if base.get(key) and "-cp1-" not in name else "-"
    print(f"{name:<24} {ngpu:>4} {r['tps']:>10,.0f} {ratio:>7} {r['mem_gib']:>18.1f} {first:>10.4f} "
          f"{r['loss']:>9.4f}")
print("\n(vs cp1: tok/s per GPU against cp 1 on one GPU at the same window; cp 2 GPUs each process half of every"
      "\nwindow. first loss: the first step's, on the same window for cp 1 and cp 2.)")
EOF
