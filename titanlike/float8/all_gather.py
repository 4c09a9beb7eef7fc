"""FSDP float8 all-gather: each weight's scale precomputed after the optimizer step.

torchao's own float8 all-gather does the gathering (Float8LinearConfig.enable_fsdp_float8_all_gather)
and the cast of each shard before it; this module adds the one thing titanlike does around it.
"""

from __future__ import annotations

from torch import nn


def precompute_scales(model: nn.Module) -> None:
    """All weights' float8 scales in one all-reduce, for the next all-gather."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
