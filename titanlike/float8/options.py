"""The float8 options of one run, resolved once from the [fp8] config and the data-parallel degree.

Frozen: what a run does is decided before the model exists. What conversion then found (which
layers converted, which stayed and why) is a separate record, layers.Float8Report.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from titanlike.config.fp8 import RECIPES, Fp8, float8_all_gather

AutoFilter = Literal[True, False, "measure"]


@dataclass(frozen=True)
class Float8Options:
    recipe: str = "none"
    """torchao recipe: none, tensorwise, rowwise or rowwise_with_gw_hp."""
    emulate: bool = False
    """Emulate the float8 matmuls in high precision (CPU tests, GPUs without float8)."""
    fsdp_float8_all_gather: bool = False
    """FSDP all-gathers the converted weights in float8 (tensorwise, more than one shard)."""
    precompute_scales: bool = False
    """After each optimizer step, one all-reduce computes every weight's scale for the next all-gather."""
    filter_fqns: tuple[str, ...] = ()
    """Linears whose name contains one of these stay in high precision."""
    auto_filter: AutoFilter = False
    """True: skip Linears too small to pay (size rule); "measure": time each shape on this GPU; False: off."""
    scaling: str = "dynamic"
    """Tensorwise scales: "dynamic" (from this tensor) or "delayed" (from a history, delayed.py)."""
    amax_history: int = 16
    """Delayed scaling: how many measured amaxes a scale is taken from."""
    amax_every: int = 1
    """Delayed scaling: measure amaxes on every this-many-th step."""
    health_log_freq: int = 0
    """Weight health at every this-many-th log step (0 = off)."""

    @property
    def enabled(self) -> bool:
        return RECIPES[self.recipe].float8

    @property
    def delayed(self) -> bool:
        return self.enabled and self.scaling == "delayed"

    @classmethod
    def from_config(cls, fp8_cfg: Fp8, dp_shard: int) -> Float8Options:
        """Effective options: all-gather in float8 by default where the recipe can and weights are sharded
        (config/fp8.py float8_all_gather)."""
        all_gather = float8_all_gather(fp8_cfg, dp_shard)
        precompute = fp8_cfg.precompute_float8_dynamic_scale_for_fsdp
        if precompute is None:
            precompute = all_gather
        given: object = fp8_cfg.auto_filter  # "true", "false", "measure" (tests also hand a bool)
        auto_filter: AutoFilter = "measure" if given == "measure" else given in (True, "true")
        return cls(
            recipe=fp8_cfg.recipe,
            emulate=fp8_cfg.emulate,
            fsdp_float8_all_gather=all_gather,
            precompute_scales=bool(precompute and all_gather),
            filter_fqns=tuple(fp8_cfg.filter_fqns),
            auto_filter=auto_filter,
            scaling=fp8_cfg.scaling,
            amax_history=fp8_cfg.amax_history,
            amax_every=fp8_cfg.amax_every,
            health_log_freq=fp8_cfg.health_log_freq,
        )

    def torchao_config(self):
        """torchao's Float8LinearConfig for these options."""
        from torchao.float8 import Float8LinearConfig

        config = Float8LinearConfig.from_recipe_name(self.recipe)
        # The recipe configs are frozen dataclasses: a copy with the all-gather and emulation switched as set.
        return dataclasses.replace(config, enable_fsdp_float8_all_gather=self.fsdp_float8_all_gather,
                                   emulate=self.emulate)


def inductor_options(recipe: str) -> dict[str, Any]:
    """Inductor settings for compiling layers converted to `recipe` (torch.compile's `options`): the
    rowwise recipes' (titanlike/overrides/compile.py says which and why); none for the others."""
    if not RECIPES[recipe].inductor_options:
        return {}
    from titanlike.overrides.compile import rowwise_inductor_options

    return rowwise_inductor_options()
