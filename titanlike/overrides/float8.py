"""torchao's float8 internals titanlike uses (the package docstring says how overrides are chosen and
probed): the functions delayed scaling (float8/delayed.py) builds on, the cast before FSDP's float8
all-gather fused into one kernel (fused_float8_weight_cast), and the parts of torchao's float8 weight
wrapper that checkpoints and the health log read."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from titanlike.overrides import probe_for, version_outside

# What delayed scaling calls, by keyword: (module, name, the parameters it must take first).
_DELAYED_NEEDS = (
    ("torchao.float8.float8_training_tensor", "hp_tensor_and_scale_to_float8",
     ["hp_tensor", "s", "float8_dtype", "linear_mm_config", "gemm_input_role"]),
    ("torchao.float8.float8_utils", "amax_to_scale", ["amax", "float8_dtype", "round_scales_to_power_of_2"]),
    ("torchao.float8.float8_linear", "matmul_with_hp_or_float8_args",
     ["ctx", "input_hp", "weight_hp_t", "linear_mm_config", "config"]),  # its forward's
)


@probe_for("delayed_scaling")
def probe_delayed_scaling() -> str | None:
    import importlib

    import torchao

    for module, name, params in _DELAYED_NEEDS:
        found = getattr(importlib.import_module(module), name, None)
        if found is None:
            return f"torchao has no {module.removeprefix('torchao.')}.{name}"
        have = list(inspect.signature(getattr(found, "forward", found)).parameters)
        if have[:len(params)] != params:
            return f"torchao's {name} takes ({', '.join(have)})"
    from torchao.float8.float8_training_tensor import GemmInputRole

    if not {"INPUT", "WEIGHT", "GRAD_OUTPUT"} <= {r.name for r in GemmInputRole}:
        return "torchao's GemmInputRole lacks INPUT, WEIGHT or GRAD_OUTPUT"
    return version_outside(torchao.__version__, (0, 17), (0, 18), "torchao")


def cast_to_float8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, mm_config, role: str) -> torch.Tensor:
    """`x` scaled by `scale` and cast to float8 as torchao's tensorwise cast does, wrapped for its
    matmul in the role ("INPUT", "WEIGHT" or "GRAD_OUTPUT") it plays there."""
    from torchao.float8.float8_training_tensor import GemmInputRole, hp_tensor_and_scale_to_float8

    return hp_tensor_and_scale_to_float8(hp_tensor=x, s=scale, float8_dtype=dtype, linear_mm_config=mm_config,
                                         gemm_input_role=GemmInputRole[role])


def float8_matmul(x: torch.Tensor, weight_t: torch.Tensor, mm_config, config) -> torch.Tensor:
    """torchao's float8 matmul of already-cast operands, with its backward (casting the output gradient
    as `config` says)."""
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    return matmul_with_hp_or_float8_args.apply(x, weight_t, mm_config, config)


def amax_to_scale(amax: torch.Tensor, dtype: torch.dtype, power_of_2: bool) -> torch.Tensor:
    from torchao.float8.float8_utils import amax_to_scale as theirs

    return theirs(amax=amax, float8_dtype=dtype, round_scales_to_power_of_2=power_of_2)


# ---- fused_float8_weight_cast: the cast of each weight shard before FSDP's float8 all-gather --------------

def _weight_wrapper():
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    return WeightWithDynamicFloat8CastTensor


_STOCK_PRE_ALL_GATHER: dict[str, Any] = {}  # the method torchao defines, while ours is installed


def _scaled_cast(shard: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torchao's tensorwise cast of a weight: scaled in fp32, saturated to the float8 range, rounded."""
    largest = torch.finfo(dtype).max
    return (shard.to(torch.float32) * scale).clamp(min=-largest, max=largest).to(dtype)


_COMPILED: dict[str, Any] = {}


def _fused_cast(shard: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`_scaled_cast` compiled, on first use: one kernel for every shard (its length is dynamic, as the shards
    differ in size)."""
    if "cast" not in _COMPILED:
        _COMPILED["cast"] = torch.compile(_scaled_cast, dynamic=True)
    return _COMPILED["cast"](shard, scale, dtype)


def _fused_pre_all_gather(self, mesh):
    """FSDP's hook before a float8 all-gather, for a weight with a precomputed scale on a GPU: the same
    bytes as torchao's, cast in one fused kernel. Otherwise torchao's own."""
    scale, shard = self._precomputed_scale, self._tensor
    if scale is None or not shard.is_cuda:
        return _STOCK_PRE_ALL_GATHER["method"](self, mesh)
    return (_fused_cast(shard.reshape(-1), scale, self._dtype).view(shard.shape),), (scale,)


@probe_for("fused_float8_weight_cast")
def probe_fused_float8_weight_cast() -> str | None:
    import torchao
    from torchao.float8.float8_training_tensor import LinearMMConfig

    cls = _weight_wrapper()
    stock = _STOCK_PRE_ALL_GATHER.get("method", cls.fsdp_pre_all_gather)
    have = list(inspect.signature(stock).parameters)
    if have != ["self", "mesh"]:
        return f"torchao's fsdp_pre_all_gather takes ({', '.join(have)}), not (self, mesh)"
    # What ours reads of a weight, and what it must give: torchao's own bytes and scale (eager, on the CPU).
    shard = torch.tensor([[1.0, -3.0e-3], [700.0, -1.0e6]])
    weight = cls(shard, LinearMMConfig(), torch.float8_e4m3fn, torch.tensor(0.5))
    if not all(hasattr(weight, name) for name in ("_tensor", "_precomputed_scale", "_dtype")):
        return "torchao's float8 weight wrapper lacks _tensor, _precomputed_scale or _dtype"
    (theirs,), (their_scale,) = stock(weight, None)
    ours = _scaled_cast(weight._tensor, weight._precomputed_scale, weight._dtype)
    same_bytes = torch.equal(theirs.view(torch.uint8), ours.view(torch.uint8))
    if not (same_bytes and torch.equal(their_scale, weight._precomputed_scale)):
        return "torchao's weight cast before the all-gather is not the scaled, saturated cast it fuses"
    return version_outside(torchao.__version__, (0, 17), (0, 18), "torchao")


def use_fused_weight_cast(on: bool) -> None:
    """Install the fused cast on torchao's float8 weight wrapper (process-wide: every float8 all-gather of
    this process), or put torchao's own back."""
    cls = _weight_wrapper()
    if on and "method" not in _STOCK_PRE_ALL_GATHER:
        _STOCK_PRE_ALL_GATHER["method"] = cls.fsdp_pre_all_gather
        cls.fsdp_pre_all_gather = _fused_pre_all_gather
    elif not on and "method" in _STOCK_PRE_ALL_GATHER:
        cls.fsdp_pre_all_gather = _STOCK_PRE_ALL_GATHER.pop("method")


# ---- torchao's float8 weight wrapper (float8 all-gather): not switched, nothing public reads it --------

WRAPPED, PRECOMPUTED = "_tensor", "_precomputed_scale"  # its inner tensors, as __tensor_flatten__ names them


def unwrap_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the plain high-precision tensor, the precomputed float8 scale or None) of a weight that float8
    all-gather wraps in torchao's tensor subclass; a plain tensor is returned as it is. Through the
    wrapper-subclass protocol (__tensor_flatten__), by the names torchao gives its inner tensors."""
    if type(w) is torch.Tensor or not hasattr(w, "__tensor_flatten__"):
        return w, None
    names, _ = w.__tensor_flatten__()
    if WRAPPED not in names:
        return w, None
    return getattr(w, WRAPPED), getattr(w, PRECOMPUTED, None) if PRECOMPUTED in names else None
