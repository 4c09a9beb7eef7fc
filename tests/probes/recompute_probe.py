"""Worker for tests/test_gpu.py: what a context-parallel rank's compiled, fully recomputed blocks hold
from forward to backward.

Run as `torchrun --nproc_per_node=2 tests/probes/recompute_probe.py OUT.json DEVICE`. A small model in
bf16 over a cp 2 group, activation checkpointing `full`, compiled two ways: checkpointed around the compiled
body (`recompute_outside`, what the trainer does under cp) and inside the compiled graph. For each, rank 0
writes the memory the autograd graph holds after forward (allocated after forward less before), and the
bytes a fully recomputed model must keep (`must_keep`: every block's input, the rotary tables, the loss's).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from titanlike.config.speed import ActivationCheckpoint
from titanlike.model.decoder import Transformer
from titanlike.model.loss import build_loss
from titanlike.model.shape import ModelArgs
from titanlike.parallel import apply_activation_checkpointing, apply_compile
from titanlike.parallel.context import apply_context_parallel
from titanlike.parallel.mesh import destroy_process_group

ARGS = ModelArgs(dim=512, n_layers=4, n_heads=8, n_kv_heads=2, ffn_dim=1024, vocab_size=256)
SEQ = 8192


def held_after_forward(device: torch.device, outside: bool) -> int:
    torch._dynamo.reset()
    model = Transformer(ARGS).to(device)
    model.init_weights(0, SEQ)
    model.to(torch.bfloat16)
    context = apply_context_parallel(model, dist.group.WORLD, device_type=device.type)
    apply_activation_checkpointing(model, ActivationCheckpoint("full", ""))
    apply_compile(model, recompute_outside=outside)
    tokens = torch.randint(0, ARGS.vocab_size, (1, SEQ + 1), generator=torch.Generator().manual_seed(1)).to(device)
    loss_fn = build_loss(0, compile=False)
    held = 0
    for _ in range(2):  # the first compiles
        before = torch.cuda.memory_allocated(device)
        loss = loss_fn(model, *context.shard(tokens[:, :-1], tokens[:, 1:], None))
        held = torch.cuda.memory_allocated(device) - before
        loss.backward()
        model.zero_grad(set_to_none=True)
    return held


def main() -> None:
    out_path, device_type = sys.argv[1], sys.argv[2]
    if device_type != "cuda":  # it reads the CUDA allocator: there is nothing to measure on a CPU
        sys.exit(f"error: recompute_probe.py measures GPU memory: DEVICE must be cuda (got {device_type})")
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    try:
        found = {"outside": held_after_forward(device, True), "inside": held_after_forward(device, False)}
        local = SEQ // dist.get_world_size()
        # What full recompute must keep, in bf16: the embedding's output, every block's output (the next one's
        # input) and the final norm's; the rotary tables at the local positions (fp32 cos and sin); the loss's
        # fp32 logits and their softmax. Measured outside: 33.1 MiB of these 34.0; inside: 65.6 MiB.
        found["must_keep"] = ((ARGS.n_layers + 2) * local * ARGS.dim * 2 + 2 * local * ARGS.head_dim * 4
                              + 2 * local * ARGS.vocab_size * 4)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(found, f)
    finally:
        destroy_process_group()


if __name__ == "__main__":
    main()
