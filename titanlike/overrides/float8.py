"""torchao's float8 internals titanlike uses (the package docstring says how overrides are chosen and
probed): the functions delayed scaling (float8/delayed.py) builds on, and the parts of torchao's float8
weight wrapper that checkpoints and the health log read."""

from __future__ import annotations

import inspect

import torch

from titanlike.overrides import version_outside

# What delayed scaling calls, by keyword: (module, name, the parameters it must take first).
_DELAYED_NEEDS = (
    ("torchao.float8.float8_training_tensor", "hp_tensor_and_scale_to_float8",
     ["hp_tensor", "s", "float8_dtype", "linear_mm_config", "gemm_input_role"]),
    ("torchao.float8.float8_utils", "amax_to_scale", ["amax", "float8_dtype", "round_scales_to_power_of_2"]),
    ("torchao.float8.float8_linear", "matmul_with_hp_or_float8_args",
     ["ctx", "input_hp", "weight_hp_t", "linear_mm_config", "config"]),  # its forward's
)


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
