"""Worker for tests/test_gpu.py: context-parallel attention on two ranks against unsplit attention.

Run as `torchrun --nproc_per_node=2 tests/probes/context_parallel_probe.py OUT.json DEVICE`. For each
mask (causal: cuDNN attention on each chunk's parts; block_causal: flex attention over a BlockMask of
window positions on a GPU, a dense mask on a CPU), eager and compiled, each rank attends its part of
the queries (grouped-query heads) to the gathered keys and values, and compares its outputs and the
gradients of q, k and v (gathered back to window order) with unsplit attention on the same tensors.
Rank 0 writes, per case, the largest differences relative to the reference's largest magnitude and
the attention kernels (aten ops) that ran in the split forward.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from titanlike.model.masks import document_mask, masked_attention
from titanlike.parallel.context import ContextParallel, shard_sequence, window_order
from titanlike.parallel.mesh import destroy_process_group

BATCH, HEADS, KV_HEADS, SEQ, HEAD_DIM = 2, 8, 2, 1024, 64
END = 0  # the end-of-document id of the random tokens


def gathered(t: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return window_order(torch.cat(parts), len(parts))  # (batch, heads, seq, head_dim), in window order


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def case(context: ContextParallel, device: torch.device, mask_kind: str, compiled: bool) -> dict:
    rank, cp = dist.get_rank(), dist.get_world_size()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, device=device, dtype=dtype, generator=gen)
    k, v = (torch.randn(BATCH, KV_HEADS, SEQ, HEAD_DIM, device=device, dtype=dtype, generator=gen) for _ in range(2))
    weight = torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, device=device, dtype=dtype, generator=gen)
    tokens = torch.randint(0, 200, (BATCH, SEQ), device=device, generator=gen)  # documents of ~200 tokens
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    if mask_kind == "causal":
        ref = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True)
    else:
        ref = masked_attention(*full, document_mask(tokens, END), True)
    (ref.float() * weight.float()).sum().backward()

    attend = torch.compile(context.attend, fullgraph=True) if compiled else context.attend
    local = [shard_sequence(t, rank, cp, dim=2).detach().clone().requires_grad_() for t in (q, k, v)]
    _, _, shard = context.shard(tokens, tokens, None if mask_kind == "causal" else END)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = attend(*local, shard.mask, True)
    kernels = sorted({e.name for e in prof.events() if "attention" in e.name or "flex" in e.name})
    (out.float() * shard_sequence(weight, rank, cp, dim=2).float()).sum().backward()
    result = {"out": relative(out, shard_sequence(ref, rank, cp, dim=2)), "kernels": kernels}
    for name, mine, want in zip("qkv", local, full, strict=True):
        assert mine.grad is not None and want.grad is not None
        result[f"grad_{name}"] = relative(gathered(mine.grad), want.grad)
    return result


def main() -> None:
    out_path, device_type = sys.argv[1], sys.argv[2]
    cuda = device_type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    context = ContextParallel(dist.group.WORLD, device_type=device.type)
    results = {f"{mask}-{'compiled' if compiled else 'eager'}": case(context, device, mask, compiled)
               for mask in ("causal", "block_causal") for compiled in (False, True)}
    # Each rank's differences: the worst of the two.
    worst = [None] * dist.get_world_size()
    dist.all_gather_object(worst, results)
    if rank == 0:
        merged = {name: {key: max(r[name][key] for r in worst) if key != "kernels" else r0[name]["kernels"]
                         for key in r0[name]} for r0 in worst[:1] for name in r0}
        with open(out_path, "w") as f:
            json.dump(merged, f, indent=1)
    destroy_process_group()


if __name__ == "__main__":
    main()
