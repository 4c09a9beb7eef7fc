"""Health of the float8 weight casts: per converted Linear, the weight's amax and the shares of its
values that saturate or flush to zero when cast (fp8.health_log_freq)."""

from __future__ import annotations

import math

import torch
from torch import nn


@torch.no_grad()
def weight_health(model: nn.Module) -> dict[str, dict[str, float]]:
    """Per float8 Linear: its weight's amax, and the shares of its values that would saturate
    (|w·scale| beyond the float8 maximum, 448 for e4m3, by more than rounding would take back) or
    flush to zero (non-zero, but zero once cast).

    The scale is torchao's, for the forward cast of the weight: one per tensor (tensorwise; the
    precomputed one when float8 all-gather precomputes it) or one per output row (rowwise), rounded
    down to a power of two where the recipe says so. Dynamic scaling derives the scale from the amax,
    so saturation stays 0 unless a scale is stale; underflow is the number to watch: a few outliers
    set the scale, and weights below about amax / 460,000 (e4m3) are lost in the cast.
    Measured on the fp32 master weights (the forward casts their bf16 copy under FSDP mixed precision).
    With FSDP each rank measures its shard and two all-reduces finish the job: every rank calls this.
    """
    from torch.distributed.tensor import DTensor
    from torchao.float8 import ScalingGranularity
    from torchao.float8.float8_linear import Float8Linear

    from titanlike.overrides.float8 import amax_to_scale, unwrap_weight

    layers = []
    sharded = False
    for name, m in model.named_modules():
        if isinstance(m, Float8Linear):
            w = m.weight
            if isinstance(w, DTensor):
                sharded, w = True, w.to_local()
            w, precomputed = unwrap_weight(w)  # float8 all-gather wraps the shard in a tensor subclass
            layers.append((name, m.config, w.detach().float(), precomputed))
    if not layers:
        return {}
    zero = torch.zeros((), device=layers[0][2].device)
    amax = torch.stack([w.abs().max() if w.numel() else zero for _, _, w, _ in layers])
    if sharded:
        torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX)
    counts = []
    for (_, config, w, precomputed), tensor_amax in zip(layers, amax):
        cast = config.cast_config_weight
        fmax = torch.finfo(cast.target_dtype).max
        # Up to half a float8 step above the maximum a value rounds to the maximum anyway (464 for e4m3).
        limit = fmax + 2.0 ** math.floor(math.log2(fmax)) * torch.finfo(cast.target_dtype).eps / 2
        if cast.scaling_granularity is ScalingGranularity.AXISWISE:  # rows are whole on each FSDP shard
            row_amax = w.abs().amax(dim=-1, keepdim=True)
            scale = amax_to_scale(row_amax, cast.target_dtype, config.round_scales_to_power_of_2)
        elif precomputed is not None:
            scale = precomputed.float()
        else:
            scale = amax_to_scale(tensor_amax, cast.target_dtype, config.round_scales_to_power_of_2)
        scaled = w * scale
        saturated = (scaled.abs() > limit).sum()
        flushed = ((scaled.clamp(-fmax, fmax).to(cast.target_dtype).float() == 0) & (w != 0)).sum()
        counts.append(torch.stack([saturated, flushed, torch.tensor(w.numel(), device=w.device)]))
    totals = torch.stack(counts).double()
    if sharded:  # (HSDP replicas count their copy too: numerators and denominators alike)
        torch.distributed.all_reduce(totals)
    out = {}
    for (name, *_), a, (sat, flush, n) in zip(layers, amax.tolist(), totals.tolist()):
        out[name] = {"amax": a, "saturated": sat / max(n, 1), "underflow": flush / max(n, 1)}
    return out


def health_summary(health: dict[str, dict[str, float]]) -> dict:
    """The worst layer of each measure, for one metrics.jsonl record."""
    if not health:
        return {}
    worst = max(health, key=lambda name: health[name]["underflow"])
    return {
        "fp8_weight_amax_max": max(h["amax"] for h in health.values()),
        "fp8_saturated_max": max(h["saturated"] for h in health.values()),
        "fp8_underflow_max": health[worst]["underflow"],
        "fp8_underflow_worst_layer": worst,
    }
