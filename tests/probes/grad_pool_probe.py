"""Worker for tests/test_gpu.py: where do FSDP's sharded gradients live on a GPU?

Run as `torchrun --nproc_per_node=2 tests/probes/grad_pool_probe.py OUT.json cuda`. Builds the same
small Llama twice over both GPUs, through titanlike's parallel.apply_fsdp and through a plain
fully_shard, and runs one step of two accumulated micro-batches on each. Rank 0 writes, for each, the
CUDA streams whose memory segments hold the gradients (the caching allocator keeps each stream's
memory apart) and the largest difference between the two models' gradients.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from titanlike import parallel
from titanlike.model.decoder import Transformer
from titanlike.model.shape import ModelArgs

ARGS = ModelArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=512, vocab_size=65536)


def build(mesh, ours: bool) -> Transformer:
    with torch.device("meta"):
        model = Transformer(ARGS)
    if ours:
        parallel.apply_fsdp(model, mesh, None, "default")
    else:
        mp = MixedPrecisionPolicy(reduce_dtype=torch.float32)
        for block in model.layers:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to_empty(device="cuda")
    model.init_weights(seed=0, seq_len=64)
    return model


def step(model: Transformer) -> list[torch.Tensor]:
    for micro in range(2):  # gradient accumulation: the second reduce-scatter adds into the first's gradients
        generator = torch.Generator().manual_seed(10 * micro + dist.get_rank())
        batch = torch.randint(0, ARGS.vocab_size, (2, 65), generator=generator).cuda()
        logits = model(batch[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten()).backward()
    torch.cuda.synchronize()
    return [p.grad.to_local() for p in model.parameters()]


def streams_holding(grads: list[torch.Tensor]) -> list[int]:
    segments = torch.cuda.memory._snapshot()["segments"]
    found = set()
    for g in grads:
        address = g.untyped_storage().data_ptr()
        for seg in segments:
            if seg["address"] <= address < seg["address"] + seg["total_size"]:
                found.add(int(seg["stream"]))
    return sorted(found)


def main(out: str) -> None:
    dist.init_process_group("nccl")
    torch.cuda.set_device(dist.get_rank())
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    ours, theirs = build(mesh, ours=True), build(mesh, ours=False)
    ours_grads, theirs_grads = step(ours), step(theirs)
    result = {
        "default_stream": int(torch.cuda.default_stream().cuda_stream),
        "ours": streams_holding(ours_grads),
        "torch": streams_holding(theirs_grads),
        "largest_difference": max(float((a - b).abs().max()) for a, b in zip(ours_grads, theirs_grads)),
    }
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
