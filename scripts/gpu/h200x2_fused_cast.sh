#!/usr/bin/env bash
# Two H200s: the float8 all-gather's fused weight cast (float8.fuse_all_gather_cast).
# (1) its bytes equal torchao's eager cast on CUDA; (2) 1b tensorwise per-GPU tokens/s, 1 GPU vs
# FSDP over 2, with the previous code (_old/: `git archive f31f329 | tar -x -C _old`, untracked) and
# the fused cast, and with NCCL's protocol forced; (3) 8b tensorwise on 2 GPUs. Tables last.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
python3 - <<'PY' 2>&1 | grep -v Warning | tee "$OUT/cast_check.txt"
import torch
from torchao.float8.float8_linear import LinearMMConfig
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as W
from titanlike import float8
float8.fuse_all_gather_cast()
torch.manual_seed(0)
for shape in [(4096, 2048), (1024, 8192), (3, 5)]:
    shard = torch.randn(shape, device="cuda")
    scale = 448.0 / shard.abs().max() * 1.5
    w = W(shard, LinearMMConfig(), torch.float8_e4m3fn, scale)
    (a,), _ = w.fsdp_pre_all_gather(None)
    (b,), _ = W.fsdp_pre_all_gather.__wrapped__(w, None)
    print("fused cast", shape, "equal to torchao:", torch.equal(a.view(torch.uint8), b.view(torch.uint8)))
PY
python3 -c "from titanlike.data import build_default_corpus; build_default_corpus('/tmp/corpus')"
common=(--config train_configs/llama3_1b.toml --steps 20 --log-freq 5 --corpus /tmp/corpus)
tw=(-- --data.seq_len 4096 --training.local_batch_size 6 --compile.enable --fp8.recipe tensorwise)
bench() { local tag=$1; shift; "$@" > "$OUT/bench_$tag.txt" 2>&1; tail -n 1 "$OUT/bench_$tag.txt"; }
bench 1gpu env CUDA_VISIBLE_DEVICES=0 python3 scripts/bench_train.py "${common[@]}" --ngpu 1 --workdir /tmp/w1 --variant "1gpu_tw=" "${tw[@]}"
bench 2gpu_old python3 _old/scripts/bench_train.py "${common[@]}" --ngpu 2 --workdir /tmp/w2o --variant "2gpu_tw_old=" "${tw[@]}"
bench 2gpu_fused env NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,TUNING,GRAPH python3 scripts/bench_train.py "${common[@]}" --ngpu 2 --workdir /tmp/w2 --variant "2gpu_tw_fused=" "${tw[@]}"
grep -hE "NCCL INFO .*(Channel 00|via|Protocol|proto|Algo|NVLS|P2P|nvlink|NVLink|LL128|Ring|bw)" /tmp/w2/*.log | sort | uniq | head -n 60 > "$OUT/nccl_info.txt"
bench 2gpu_simple env NCCL_PROTO=Simple python3 scripts/bench_train.py "${common[@]}" --ngpu 2 --workdir /tmp/w2s --variant "2gpu_tw_fused_simple=" "${tw[@]}"
bench 2gpu_ll128 env NCCL_PROTO=LL128 python3 scripts/bench_train.py "${common[@]}" --ngpu 2 --workdir /tmp/w2l --variant "2gpu_tw_fused_ll128=" "${tw[@]}"
bench 8b python3 scripts/bench_train.py --config train_configs/llama3_8b.toml --ngpu 2 --steps 12 --log-freq 4 --corpus /tmp/corpus \
  --workdir /tmp/w8 --variant "8b_tw_fused=--fp8.recipe tensorwise" -- --data.seq_len 8192 --training.local_batch_size 2 \
  --compile.enable --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op
tar -czf "$OUT/logs.tgz" /tmp/w*/*.log 2>/dev/null
echo; cat "$OUT/cast_check.txt"; for f in "$OUT"/bench_*.txt; do tail -n 1 "$f"; done
