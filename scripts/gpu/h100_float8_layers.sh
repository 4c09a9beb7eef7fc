#!/usr/bin/env bash
# One H100: which Linear shapes of the 1b preset gain from float8 (bench_linear.py), then the
# trainer with float8 on all layers vs the size rule vs measured layer choice. Tables last.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
python3 -c "from titanlike.data import build_default_corpus; build_default_corpus('/tmp/corpus')"
python3 scripts/bench_linear.py --flavor 1b --tokens 24576 --recipes ${RECIPES:-tensorwise,rowwise} --out "$OUT/linear_1b.json" 2>&1 | grep -v Warn | tee "$OUT/linear.txt"
python3 scripts/bench_train.py --config train_configs/llama3_1b.toml --steps ${STEPS:-30} --log-freq 5 \
  --corpus /tmp/corpus --workdir /tmp/bench_1b --out "$OUT/1b_layers.json" "$@" \
  -- --data.seq_len 4096 --training.local_batch_size 6 --compile.enable
for f in /tmp/bench_1b/*.log; do grep -E "float8|error|->" "$f" | head -12 > "$OUT/$(basename $f)"; done
cat "$OUT/linear.txt"
