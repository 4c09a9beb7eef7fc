#!/usr/bin/env bash
# The loss fingerprint of a titanlike checkout on the CPU: every train and validation loss and gradient
# norm, in hex (bit for bit), of two deterministic runs: the default job for 20 steps, and a two-stage
# run (seq_len 64, then 128 with another RoPE base and batch from step 6) that saves at step 5 and 10.
# A change that claims no change in behaviour prints the same lines as the commit before it:
#
#   scripts/loss_fingerprint.sh /path/to/checkout-before > before.txt
#   scripts/loss_fingerprint.sh .                       > after.txt && cmp before.txt after.txt
#
# About 20 s on 2 cores. Uses the checkout's own package (PYTHONPATH), not the installed one.
set -euo pipefail
tree=$(cd "${1:-.}" && pwd)
out=$(mktemp -d "${TMPDIR:-/tmp}/fingerprint.XXXXXX")
trap 'rm -rf "$out"' EXIT
export PYTHONPATH="$tree" OMP_NUM_THREADS=1 TITANLIKE_CACHE="$out/cache"
cd "$out"
python3 -c "import titanlike, sys; sys.exit(0 if titanlike.__file__.startswith('$tree/') else 'imports ' + titanlike.__file__)"
python3 -m titanlike.train --job.dump_folder "$out/default" --training.steps 20 --metrics.log_freq 1 \
  --training.deterministic > "$out/default.log" 2>&1 || { tail -5 "$out/default.log" >&2; exit 1; }
python3 -m titanlike.train --job.dump_folder "$out/stages" --model.n_layers 2 --model.dim 64 --model.n_heads 4 \
  --model.n_kv_heads 2 --data.seq_len 64 --training.local_batch_size 4 --training.steps 10 --metrics.log_freq 1 \
  --validation.freq 3 --validation.steps 1 --training.deterministic --checkpoint.enable --checkpoint.interval 5 \
  --metrics.enable_tensorboard false --data.phase "6:seq_len=128,rope_theta=100000,local_batch_size=2" \
  > "$out/stages.log" 2>&1 || { tail -5 "$out/stages.log" >&2; exit 1; }
python3 - "$out" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
for run in ("default", "stages"):
    for line in (out / run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("kind") in ("train", "val"):
            values = [float(r[k]).hex() for k in ("loss", "grad_norm") if isinstance(r.get(k), float)]
            print(run, r["kind"], r["step"], *values)
    for step in (5, 10) if run == "stages" else ():
        print(run, f"step-{step}/model_args.json", (out / run / "checkpoint" / f"step-{step}" / "model_args.json").read_text().strip())
PY
