"""Worker for tests/test_optim.py: does clipping folded into fused AdamW match in-place clipping
when the gradients are FSDP-sharded DTensors?

Run as `torchrun --nproc_per_node=2 tests/probes/fused_clip_probe.py OUT.json` (CPU, gloo). Trains a small
Llama sharded over both ranks for three steps twice, with fused AdamW (clipping through its
`grad_scale` input) and with foreach AdamW (clipping in place), from the same weights and batches.
Rank 0 writes the largest weight difference and the gradient norms as JSON.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from titanlike import parallel
from titanlike.model.decoder import Transformer
from titanlike.model.shape import ModelArgs
from titanlike.optim import clip_and_step

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=64)


def build(mesh) -> Transformer:
    with torch.device("meta"):
        model = Transformer(ARGS)
    parallel.apply_fsdp(model, mesh, None, "default")
    model.to_empty(device="cpu")
    model.init_weights(seed=0, seq_len=16)
    return model


def train(fused: bool, mesh, steps: int = 3) -> tuple[list[torch.Tensor], list[float]]:
    model = build(mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused, foreach=not fused)
    norms = []
    for step in range(steps):
        generator = torch.Generator().manual_seed(10 * step + dist.get_rank())
        batch = torch.randint(0, ARGS.vocab_size, (2, 17), generator=generator)
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm, _ = clip_and_step(opt, list(model.parameters()), 0.5, skip_nonfinite=True)
        norms.append(float(norm))
    return [p.detach().full_tensor() for p in model.parameters()], norms


def main(out: str) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fused, fused_norms = train(True, mesh)
    foreach, foreach_norms = train(False, mesh)
    initial, _ = train(True, mesh, steps=0)
    diff = max(float((a - b).abs().max()) for a, b in zip(fused, foreach))
    moved = max(float((a - b).abs().max()) for a, b in zip(fused, initial))
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"max_diff": diff, "moved": moved, "fused_norms": fused_norms, "foreach_norms": foreach_norms}, f)
    dist.barrier()  # neither rank tears gloo down while the other still uses it
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
