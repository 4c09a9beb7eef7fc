"""FSDP2 over the mesh, with its mixed precision; on one rank, bf16 autocast instead.

`shard_model` is the one decision the trainer asks for: whether the weights are sharded, in which
dtype they compute, and whether the gathered weights are kept from forward to backward.
"""

from __future__ import annotations

import contextlib
import logging
from functools import partial

import torch

from titanlike.model.decoder import Transformer
from titanlike.model.shape import count_params
from titanlike.parallel.device import device_memory_bytes

logger = logging.getLogger("titanlike")

# `reshard_after_forward = default` keeps the gathered weights from forward to backward (so backward
# all-gathers nothing) when all of them, in bf16, take at most this share of a GPU's memory: 1b on
# two H200s trains faster that way, for a little more memory
# (docs/benchmarks/2026-11-22-bf16-residual-fused-clip.md). An 8b (16 GB) stays resharded.
KEEP_GATHERED_MAX_SHARE = 1 / 16


def resolve_reshard(reshard: str, gathered_bytes: int, memory_bytes: int | None) -> str:
    """parallel.reshard_after_forward as apply_fsdp takes it: `default` becomes `never` for a model
    whose gathered weights are small next to the GPU's memory; anything else is left as it is."""
    if reshard == "default" and memory_bytes and gathered_bytes <= KEEP_GATHERED_MAX_SHARE * memory_bytes:
        return "never"
    return reshard


def apply_fsdp(model: Transformer, mesh, param_dtype: torch.dtype | None, reshard: str) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    blocks_reshard = reshard != "never"
    shard = partial(fully_shard, mesh=mesh, mp_policy=mp)
    for block in model.layers:
        shard(block, reshard_after_forward=blocks_reshard)
    if not model.args.tie_embeddings:
        # A tied weight lives in both modules, so then the root group owns it instead.
        shard(model.tok_embeddings, reshard_after_forward=blocks_reshard)
        # Backward starts right at the output layer: resharding it after forward only to
        # gather it again at once would waste an all-gather.
        shard([model.norm, model.output], reshard_after_forward=reshard == "always")
    shard(model, reshard_after_forward=reshard == "always")


def shard_model(model: Transformer, mesh, device: torch.device, *, mixed_precision: str, reshard: str,
                memory_limit_gib: float, log: bool) -> contextlib.AbstractContextManager:
    """FSDP over `mesh` (None: one rank, nothing to shard). bf16 compute on a GPU: FSDP casts the
    gathered weights; one rank uses autocast instead. Returns the context each forward runs in."""
    gpu_bf16 = device.type == "cuda" and mixed_precision == "bf16"
    if mesh is None:
        return torch.autocast("cuda", dtype=torch.bfloat16) if gpu_bf16 else contextlib.nullcontext()
    gathered = 2 * count_params(model.args)[0]  # bytes of every weight gathered in bf16
    chosen = resolve_reshard(reshard, gathered, device_memory_bytes(device, memory_limit_gib))
    apply_fsdp(model, mesh, torch.bfloat16 if gpu_bf16 else None, chosen)
    if log and chosen != reshard:
        logger.info(f"FSDP keeps the gathered weights from forward to backward ({gathered / 1e9:.1f} GB in bf16, "
                    f"small next to the GPU's memory); --parallel.reshard_after_forward always frees them")
    return contextlib.nullcontext()
