"""FSDP float8 all-gather: each weight's scale precomputed after the optimizer step, and the cast of each
shard before the gather.

torchao's own float8 all-gather does the gathering (Float8LinearConfig.enable_fsdp_float8_all_gather);
this module adds what titanlike does around it.
"""

from __future__ import annotations

from torch import nn


def precompute_scales(model: nn.Module) -> None:
    """All weights' float8 scales in one all-reduce, for the next all-gather."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


def use_fused_cast(on: bool) -> None:
    """Each weight shard cast to float8 before its all-gather in one compiled kernel (the override
    fused_float8_weight_cast, titanlike/overrides/float8.py), or in torchao's three (scale, saturate, cast).
    Only in a run that compiles: a run without compile.enable may be one where inductor cannot run."""
    from titanlike.overrides.float8 import use_fused_weight_cast

    use_fused_weight_cast(on)
