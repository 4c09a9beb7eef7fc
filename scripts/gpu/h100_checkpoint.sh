#!/usr/bin/env bash
# One H100: save/resume of the 1b preset with float8 tensorwise + compile. Sync vs async save
# stall, and losses after resume vs the uninterrupted run. Prints a table last.
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
run A --checkpoint.async_mode disabled
du -sh /tmp/ck/A/checkpoint/step-10
rm -rf /tmp/ck/A/checkpoint/step-20
mkdir -p /tmp/ck/C && cp -r /tmp/ck/A/checkpoint /tmp/ck/C/ && rm -rf /tmp/ck/A/checkpoint
run C --checkpoint.load_step 10
rm -rf /tmp/ck/C/checkpoint
run B --checkpoint.async_mode async
rm -rf /tmp/ck/B/checkpoint
run D --checkpoint.async_mode async_with_pinned_mem
rm -rf /tmp/ck/D/checkpoint
python3 - <<'PY'
import json
def losses(n):
    return {r["step"]: r["loss"] for r in map(json.loads, open(f"/tmp/ck/{n}/metrics.jsonl")) if r["kind"] == "train"}
a, c = losses("A"), losses("C")
print("\nstep  uninterrupted  resumed@10   |diff|")
for s in range(11, 21):
    if s in a and s in c:
        print(f"{s:>4}  {a[s]:.6f}      {c[s]:.6f}   {abs(a[s]-c[s]):.2e}")
PY
