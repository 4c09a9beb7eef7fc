#!/usr/bin/env bash
# One H100: save/resume of the 1b preset with float8 tensorwise + compile: the stall of an
# async save with pinned memory, and losses after resume vs the uninterrupted run. Prints a table last.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
python3 -c "from titanlike.data import build_default_corpus; build_default_corpus('/tmp/ck/A/corpus')"
common=(--job.config_file train_configs/llama3_1b.toml --data.seq_len 4096 --training.local_batch_size 6
        --compile.enable --fp8.recipe tensorwise --training.steps 20 --metrics.log_freq 1 --validation.enable false
        --checkpoint.enable --checkpoint.interval 10)
run() { local name=$1; shift; mkdir -p /tmp/ck/$name; [ -e /tmp/ck/$name/corpus ] || ln -s /tmp/ck/A/corpus /tmp/ck/$name/corpus
  python3 -m torch.distributed.run --standalone --nproc_per_node=1 run_train.sh "${common[@]}" --job.dump_folder /tmp/ck/$name "$@" > $OUT/$name.log 2>&1
  echo "$name rc=$?"; grep -E "checkpoint|resumed|error" $OUT/$name.log | sed 's/^/  /'; }
# D: pinned async save at 10 (and a final sync save at 20); C: resume D's step 10 and run to 20;
# N: the same run with no checkpointing, for the run-to-run bf16 noise floor.
run D --checkpoint.async_mode async_with_pinned_mem
du -sh /tmp/ck/D/checkpoint/step-10
rm -rf /tmp/ck/D/checkpoint/step-20
mkdir -p /tmp/ck/C && mv /tmp/ck/D/checkpoint /tmp/ck/C/
run C --checkpoint.load_step 10
rm -rf /tmp/ck/C/checkpoint
run N --checkpoint.enable false
python3 - <<'PY'
import json
def losses(n):
    return {r["step"]: r["loss"] for r in map(json.loads, open(f"/tmp/ck/{n}/metrics.jsonl")) if r["kind"] == "train"}
d, c, n = losses("D"), losses("C"), losses("N")
print("\nstep  saving run D  resumed@10 C  no-ckpt run N  |D-C|     |D-N|")
for s in range(1, 21):
    if s in d and s in n:
        cs = f"{c[s]:.6f}" if s in c else "    -   "
        dc = f"{abs(d[s]-c[s]):.2e}" if s in c else "   -    "
        print(f"{s:>4}  {d[s]:.6f}      {cs}      {n[s]:.6f}      {dc}  {abs(d[s]-n[s]):.2e}")
PY
