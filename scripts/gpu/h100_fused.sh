#!/usr/bin/env bash
# One H100: the 1b preset in the current layout against a previous one, bf16 and float8 back to
# back; the stacked Linear shapes in isolation; attention with repeated kv heads vs enable_gqa.
# Tables last. The previous layout is a copy of an older commit in _baseline/ (not tracked):
#   mkdir _baseline && git archive dc090f9 | tar -x -C _baseline
# which is how docs/benchmarks/2026-11-22-stacked-qkv-gqa.md compared layouts.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
python3 -c "import torch, torchao; print('torch', torch.__version__, 'torchao', torchao.__version__, torch.cuda.get_device_name())"
python3 -c "from titanlike.data import build_default_corpus; build_default_corpus('/tmp/corpus')"
if [ "${MICRO:-1}" = 1 ]; then
python3 scripts/bench_attention.py --flavor 1b --batch 6 --seq 4096 2>&1 | tee "$OUT/attention.txt"
python3 scripts/bench_linear.py --shape 24576,2048,4096 --shape 24576,2048,16384 --recipes ${RECIPES:-tensorwise,rowwise,rowwise_with_gw_hp} \
  --out "$OUT/linear_1b.json" 2>&1 | grep -v Warn | tee "$OUT/linear.txt"
fi
COMMON="--data.seq_len 4096 --training.local_batch_size 6 --compile.enable"
run() {  # run <root> <name> <json> <variants...>
  local root=$1 name=$2; shift 2
  python3 "$root/scripts/bench_train.py" --config train_configs/llama3_1b.toml --steps ${STEPS:-20} --log-freq 5 \
    --corpus /tmp/corpus --workdir "/tmp/bench_$name" --out "$OUT/$name.json" "$@" -- $COMMON 2>&1 | tee "$OUT/$name.txt"
  for f in /tmp/bench_$name/*.log; do grep -E "error|Error" "$f" | tail -3 > "$OUT/${name}_$(basename $f)"; done
}
run _baseline before --variant "bf16=--fp8.recipe none" --variant "tw_all=--fp8.recipe tensorwise --fp8.auto_filter false" \
  --variant "rw_all=--fp8.recipe rowwise --fp8.auto_filter false"
run . current --variant "bf16=--fp8.recipe none" --variant "tw_all=--fp8.recipe tensorwise --fp8.auto_filter false" \
  --variant "rw_all=--fp8.recipe rowwise --fp8.auto_filter false" \
  --variant "rw_w1w3=--fp8.recipe rowwise --fp8.auto_filter false --fp8.filter_fqns output,wqkv,wo,w2"
echo; cat "$OUT"/attention.txt "$OUT"/linear.txt 2>/dev/null; echo "== previous layout"; tail -6 "$OUT/before.txt"
echo "== current layout"; tail -6 "$OUT/current.txt"
