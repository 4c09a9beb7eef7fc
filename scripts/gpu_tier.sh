#!/usr/bin/env bash
# The GPU tier (`pytest -m gpu`) on a machine with two GPUs, in one go: the one-GPU tests in two shards,
# one on each GPU, while the two-GPU tests run on both, in two shards of their own (every model here is
# small: the four share the GPUs). Shards are balanced on measured test times (tests/conftest.py GPU_TEST_COST); tests that share
# a fixture stay in one shard. Caches start cold unless TORCHINDUCTOR_CACHE_DIR names a warm one.
#
#   scripts/gpu_tier.sh [OUT]      junit XML and log of each shard into OUT (default
#                                  /tmp/gpu-tier); exit 0 only if every shard passed
# With one GPU, run `python -m pytest -m gpu` instead (the two-GPU tests skip, saying why).
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

names=(gpu0 gpu1 two0 two1)
shard gpu0 CUDA_VISIBLE_DEVICES=0 TITANLIKE_GPU_SHARD=0/2 & pids=($!)
shard gpu1 CUDA_VISIBLE_DEVICES=1 TITANLIKE_GPU_SHARD=1/2 & pids+=($!)
shard two0 TITANLIKE_GPU_SHARD=two:0/2 & pids+=($!)
shard two1 TITANLIKE_GPU_SHARD=two:1/2 & pids+=($!)

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
