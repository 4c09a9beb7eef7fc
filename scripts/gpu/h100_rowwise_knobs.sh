#!/usr/bin/env bash
# One H100, 1b rowwise (every layer but the output): the step profile shows the rowwise matmuls as
# fast as tensorwise's (cuBLAS with outer-vector scales) and the loss in the casts, above all one
# standalone kernel per weight-gradient operand that casts with per-column scales and transposes.
# Does an inductor option, or dropping emulate_precision_casts, make those cheaper? Inductor
# options through TL_INDUCTOR (scripts/gpu/inductor_env); the generated sources of the cast
# kernels go to $OUT/kernels.tar. Written 2026-11-22 (fifth session); run as call 3 on code 6c4379a,
# before float8.inductor_options (since then rowwise compiles with 2-D tiling by default).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/scripts/gpu/inductor_env:${PYTHONPATH:-}
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
python3 -c "from titanlike.data import build_default_corpus; build_default_corpus('/tmp/corpus')"
# A copy of the code without emulate_precision_casts (one line: in float8.configure_compile up to
# 6c4379a, in float8.inductor_options since).
rm -rf /tmp/noemu && mkdir /tmp/noemu && cp -r titanlike scripts train_configs run_train.sh /tmp/noemu/
sed -i -e 's/inductor_config.emulate_precision_casts = True/pass/' -e '/"emulate_precision_casts": True,/d' \
  /tmp/noemu/titanlike/float8.py
grep -cE 'emulate_precision_casts = True|"emulate_precision_casts": True' /tmp/noemu/titanlike/float8.py
common=(--data.seq_len 4096 --training.local_batch_size 6 --compile.enable)
rw=(--fp8.recipe rowwise --fp8.auto_filter false)
python3 scripts/bench_train.py --config train_configs/llama3_1b.toml --steps ${STEPS:-20} --log-freq 5 \
  --corpus /tmp/corpus --workdir /tmp/bench_knobs --out "$OUT/knobs.json" \
  --variant "rw=${rw[*]}" \
  --variant "rw_nd=TL_INDUCTOR=triton.prefer_nd_tiling=True ${rw[*]}" \
  --variant "bf16=--fp8.recipe none" \
  --variant "rw_pointwise_tune=TORCHINDUCTOR_MAX_AUTOTUNE_POINTWISE=1 ${rw[*]}" \
  -- "${common[@]}"
PYTHONPATH=/tmp/noemu:$PYTHONPATH python3 /tmp/noemu/scripts/bench_train.py --config train_configs/llama3_1b.toml \
  --steps ${STEPS:-20} --log-freq 5 --corpus /tmp/corpus --workdir /tmp/bench_noemu --out "$OUT/noemu.json" \
  --variant "rw_no_emulate=${rw[*]}" -- "${common[@]}"
grep -rlE "def triton_(poi|red|per)_fused[a-z_0-9]*exp2_floor_log2" /tmp/inductor --include=*.py | head -n 60 \
  | tar -cf "$OUT/kernels.tar" -T - 2>/dev/null
for f in /tmp/bench_knobs/*.log /tmp/bench_noemu/*.log; do tail -n 3 "$f" > "$OUT/$(basename $f)"; done
