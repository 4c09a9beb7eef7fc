#!/usr/bin/env bash
# One H100, 1b tensorwise: does an inductor option make the float8 casts cheaper? Each variant sets
# inductor options through TL_INDUCTOR ("a.b=value,c=value"), which scripts/gpu/inductor_env's
# sitecustomize applies at interpreter start (the options are part of inductor's cache key, so one
# warm cache serves all variants). The generated source of the SwiGLU backward's cast kernel is kept in
# $OUT/kernels.tar for reading. Written 2026-11-22 (fifth session).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/scripts/gpu/inductor_env:${PYTHONPATH:-}
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
python3 -c "import torch, torchao; print('torch', torch.__version__, 'torchao', torchao.__version__, torch.cuda.get_device_name())"
python3 -c "from titanlike.data import build_default_corpus; build_default_corpus('/tmp/corpus')"
python3 scripts/bench_train.py --config train_configs/llama3_1b.toml --steps ${STEPS:-20} --log-freq 5 \
  --corpus /tmp/corpus --workdir /tmp/bench_knobs --out "$OUT/knobs.json" \
  --variant "tw=--fp8.recipe tensorwise" \
  --variant "tw_nd=TL_INDUCTOR=triton.prefer_nd_tiling=True --fp8.recipe tensorwise" \
  --variant "bf16=--fp8.recipe none" \
  --variant "tw_pointwise_tune=TORCHINDUCTOR_MAX_AUTOTUNE_POINTWISE=1 --fp8.recipe tensorwise" \
  --variant "tw_nd_tile_red=TL_INDUCTOR=triton.prefer_nd_tiling=True,triton.tile_reductions=True --fp8.recipe tensorwise" \
  --variant "tw_combo=TL_INDUCTOR=combo_kernels=True --fp8.recipe tensorwise" \
  "$@" -- --data.seq_len 4096 --training.local_batch_size 6 --compile.enable
grep -rl "silu_backward_t_view" /tmp/inductor --include=*.py | head -n 40 | tar -cf "$OUT/kernels.tar" -T - 2>/dev/null
for f in /tmp/bench_knobs/*.log; do tail -n 3 "$f" > "$OUT/$(basename $f)"; done
