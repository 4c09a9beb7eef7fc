#!/usr/bin/env bash
# The GPU tier (`pytest -m gpu`) in one go: four pytest processes at once (every model here is small: the
# four share the GPUs). With two GPUs or more, two of them see one GPU each and two see both, which take the
# two-GPU tests; with one GPU, all four see it, and the shard that takes the two-GPU tests finds them
# skipped (they say why). Shards are balanced on measured test times (tests/conftest.py GPU_TEST_COST); tests that share
# a fixture stay in one shard. Caches start cold unless TORCHINDUCTOR_CACHE_DIR names a warm one.
#
#   scripts/gpu_tier.sh [OUT]      junit XML and log of each shard into OUT (default
#                                  /tmp/gpu-tier); exit 0 only if every shard passed
set -uo pipefail
out=${1:-/tmp/gpu-tier}
mkdir -p "$out"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/gpu-tier-inductor.XXXXXX")}"
start=$(date +%s)

shard() {  # name, then the environment of its pytest
  local name=$1
  shift
  env "$@" "${PYTHON:-python3}" -m pytest -m gpu -p no:cacheprovider -q -rA --durations=0 \
    --junitxml="$out/$name.xml" > "$out/$name.log" 2>&1
}

gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [ "$gpus" -ge 2 ]; then
  # Shards 0 and 1 see one GPU each; 2 and 3 see both, and take the two-GPU tests (conftest.gpu_shard).
  names=(gpu0 gpu1 both2 both3)
  shard gpu0 CUDA_VISIBLE_DEVICES=0 TITANLIKE_GPU_SHARD=0/4/2 & pids=($!)
  shard gpu1 CUDA_VISIBLE_DEVICES=1 TITANLIKE_GPU_SHARD=1/4/2 & pids+=($!)
  shard both2 TITANLIKE_GPU_SHARD=2/4/2 & pids+=($!)
  shard both3 TITANLIKE_GPU_SHARD=3/4/2 & pids+=($!)
else
  # One GPU: shard 3 takes the two-GPU tests (they skip) and so fewer of the others.
  names=(one0 one1 one2 one3)
  for k in 0 1 2 3; do
    shard one$k CUDA_VISIBLE_DEVICES=0 TITANLIKE_GPU_SHARD=$k/4/3 & pids[$k]=$!
  done
fi

status=0
for i in "${!names[@]}"; do
  rc=0
  wait "${pids[$i]}" || rc=$?
  echo "${names[$i]} (exit $rc): $(tail -n 1 "$out/${names[$i]}.log")"
  # pytest exits 5 when a shard has no tests: not a failure.
  [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ] || status=1
done
echo "GPU tier: $(( $(date +%s) - start )) s wall, inductor cache $TORCHINDUCTOR_CACHE_DIR"
exit $status
