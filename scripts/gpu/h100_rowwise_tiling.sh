#!/usr/bin/env bash
# One H100, 1b: rowwise with the blocks compiled under float8.inductor_options (2-D tiling), against
# bf16, by layer choice (size rule, every layer but the output, measured), and rowwise_with_gw_hp
# with and without it (the previous code from _old/: `git archive 6c4379a | tar -x -C _old`,
# untracked). Written 2026-11-22 (fifth session).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
python3 -c "import torch, torchao; print('torch', torch.__version__, 'torchao', torchao.__version__, torch.cuda.get_device_name())"
python3 -c "from titanlike.data import build_default_corpus; build_default_corpus('/tmp/corpus')"
common=(--config train_configs/llama3_1b.toml --steps ${STEPS:-20} --log-freq 5 --corpus /tmp/corpus)
args=(-- --data.seq_len 4096 --training.local_batch_size 6 --compile.enable)
python3 scripts/bench_train.py "${common[@]}" --workdir /tmp/new --out "$OUT/new.json" \
  --variant "bf16=--fp8.recipe none" \
  --variant "rowwise_all_but_output=--fp8.recipe rowwise --fp8.auto_filter false" \
  --variant "rowwise_size_rule=--fp8.recipe rowwise" \
  --variant "rw_gw_hp_all_but_output=--fp8.recipe rowwise_with_gw_hp --fp8.auto_filter false" "${args[@]}"
python3 _old/scripts/bench_train.py "${common[@]}" --workdir /tmp/old --out "$OUT/old.json" \
  --variant "rw_gw_hp_all_but_output_old=--fp8.recipe rowwise_with_gw_hp --fp8.auto_filter false" "${args[@]}"
python3 scripts/bench_train.py "${common[@]}" --workdir /tmp/measure --out "$OUT/measure.json" \
  --variant "rowwise_measure=--fp8.recipe rowwise --fp8.auto_filter measure" "${args[@]}"
grep -h "float8 rowwise" /tmp/measure/*.log | head -n 8
for f in /tmp/new/*.log /tmp/old/*.log /tmp/measure/*.log; do grep -E "converted|float8 rowwise|error" "$f" | head -n 12 > "$OUT/$(basename $f)"; done
