"""torch.compile's private settings that titanlike uses (the package docstring says how overrides are
chosen and probed)."""

from __future__ import annotations

import contextlib
from typing import Any

from titanlike import overrides
from titanlike.errors import UserError

# Inductor settings for rowwise float8 layers: without emulated precision casts inductor may fuse away
# the rounding of the rowwise recipes' intermediate casts, a known source of NaNs (pytorch#150859);
# rowwise casts each weight-gradient operand with one scale per column and writes it transposed, in
# kernels of their own, which run faster tiled in two dimensions (tensorwise gains nothing).
ROWWISE_INDUCTOR_OPTIONS = {"emulate_precision_casts": True, "triton.prefer_nd_tiling": True}


def _inductor_config():
    import torch._inductor.config as inductor_config

    return inductor_config


def _functorch_config():
    import torch._functorch.config as functorch_config

    return functorch_config


def probe_rowwise_inductor_options() -> str | None:
    known = _inductor_config().get_config_copy()
    missing = [k for k in ROWWISE_INDUCTOR_OPTIONS if k not in known]
    return f"inductor has no {', '.join(missing)}" if missing else None


def rowwise_inductor_options() -> dict[str, Any]:
    """torch.compile's `options` for blocks with rowwise float8 layers (none when the override is off)."""
    return dict(ROWWISE_INDUCTOR_OPTIONS) if overrides.active("rowwise_inductor_options") else {}


def probe_autograd_cache_off_for_8bit_adamw() -> str | None:
    return None if hasattr(_functorch_config(), "enable_autograd_cache") else "functorch has no enable_autograd_cache"


def no_autograd_cache():
    """The context torchao's compiled 8-bit AdamW update runs in: without compile's on-disk autograd
    cache (a compiled update taken from it crashed, SIGSEGV, torch 2.13 CPU: two FSDP ranks with float8
    all-gather, after other runs had filled the cache); inductor's own cache still spares most of the time."""
    if not overrides.active("autograd_cache_off_for_8bit_adamw"):
        return contextlib.nullcontext()
    return _functorch_config().patch(enable_autograd_cache=False)


def probe_activation_memory_budget() -> str | None:
    return None if hasattr(_functorch_config(), "activation_memory_budget") else \
        "functorch has no activation_memory_budget"


def set_activation_memory_budget(budget: float) -> None:
    """Compiled graphs keep `budget` of the bytes of activations they would keep unbudgeted; compile's
    min-cut partitioner recomputes the rest. A process-wide setting, read when each graph compiles."""
    if not overrides.active("activation_memory_budget"):
        why = overrides.probe("activation_memory_budget") or "parallel.overrides leaves it off"
        raise UserError(f"activation_checkpoint.mode = budget needs torch's private activation_memory_budget, "
                        f"which is off here ({why}): use mode full or selective")
    _functorch_config().activation_memory_budget = budget
