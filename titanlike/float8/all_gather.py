"""FSDP float8 all-gather: each weight's scale precomputed after the optimizer step, and each
shard's cast to float8 for the all-gather run as one compiled kernel.

torchao's own float8 all-gather does the gathering (Float8LinearConfig.enable_fsdp_float8_all_gather);
this module adds the two things titanlike does around it.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

# Devices on which the all-gather's weight cast runs as one compiled kernel (see below); elsewhere
# torchao's own eager cast runs. Tests add "cpu" to check the two give the same bytes.
FUSED_CAST_DEVICES = {"cuda"}
_fused_cast_installed = False


def precompute_scales(model: nn.Module) -> None:
    """All weights' float8 scales in one all-reduce, for the next all-gather."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


def _cast_shard(shard: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, fmax: float) -> torch.Tensor:
    # The same operations, in the same order, as torchao's cast (fp32, scale, saturate, convert).
    return (shard.to(torch.float32) * scale).clamp(-fmax, fmax).to(dtype)


def fuse_all_gather_cast() -> None:
    """Before each float8 all-gather FSDP asks every weight shard for its float8 bytes. With the
    scale precomputed (precompute_scales), torchao casts the fp32 shard in three eager kernels
    (multiply, clamp, convert), moving about 21 bytes per weight where one fused kernel moves 5,
    twice per step where weights are resharded after forward. Route that case through one compiled
    kernel computing the same bytes (tested equal); the gain is measured in
    docs/benchmarks/2026-11-22-fused-all-gather-cast.md. Without a precomputed scale torchao's own
    path runs unchanged. Idempotent."""
    global _fused_cast_installed
    if _fused_cast_installed:
        return
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    original = WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather
    cast = torch.compile(_cast_shard, dynamic=True)

    # functools.wraps keeps the original signature visible (FSDP inspects it to decide what to
    # pass) and the original itself as __wrapped__.
    @functools.wraps(original)
    def fsdp_pre_all_gather(self, *args, **kwargs):
        # Read once: the next precompute may replace it. getattr: a torchao that renamed these
        # private fields still works, through its own cast.
        scale = getattr(self, "_precomputed_scale", None)
        shard = getattr(self, "_tensor", None)
        if scale is None or shard is None or shard.device.type not in FUSED_CAST_DEVICES:
            return original(self, *args, **kwargs)
        return (cast(shard, scale, self._dtype, torch.finfo(self._dtype).max),), (scale,)

    WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather = fsdp_pre_all_gather
    _fused_cast_installed = True
