"""torch.compile's private settings that titanlike uses (the package docstring says how overrides are
chosen and probed)."""

from __future__ import annotations

import contextlib
import functools
from typing import Any

from titanlike import overrides
from titanlike.errors import UserError
from titanlike.overrides import probe_for, version_outside

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


@probe_for("rowwise_inductor_options")
def probe_rowwise_inductor_options() -> str | None:
    known = _inductor_config().get_config_copy()
    missing = [k for k in ROWWISE_INDUCTOR_OPTIONS if k not in known]
    return f"inductor has no {', '.join(missing)}" if missing else None


def rowwise_inductor_options() -> dict[str, Any]:
    """torch.compile's `options` for blocks with rowwise float8 layers (none when the override is off)."""
    return dict(ROWWISE_INDUCTOR_OPTIONS) if overrides.active("rowwise_inductor_options") else {}


@probe_for("autograd_cache_off_for_8bit_adamw")
def probe_autograd_cache_off_for_8bit_adamw() -> str | None:
    return None if hasattr(_functorch_config(), "enable_autograd_cache") else "functorch has no enable_autograd_cache"


def no_autograd_cache():
    """The context torchao's compiled 8-bit AdamW update runs in: without compile's on-disk autograd
    cache (a compiled update taken from it crashed, SIGSEGV, torch 2.13 CPU: two FSDP ranks with float8
    all-gather, after other runs had filled the cache); inductor's own cache still spares most of the time."""
    if not overrides.active("autograd_cache_off_for_8bit_adamw"):
        return contextlib.nullcontext()
    return _functorch_config().patch(enable_autograd_cache=False)


@probe_for("activation_memory_budget")
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


# ---- aligned_reduction_splits ------------------------------------------------------------------------------


def aligned_split(numel: int, split: int, multiple: int = 16) -> int:
    """The number of parts nearest `split` (within a factor of two) that cuts a reduction over `numel`
    elements into equal parts of a multiple of `multiple` elements; `split` itself where it already does, or
    where none does.

    Inductor splits a reduction to one value (a float8 amax over a whole activation) into `split` parts,
    each reduced by a program of its own. Its rule for the count takes ceil(numel / parts) elements a part
    whatever they come to: for 16,384 tokens × `1b`'s 8,192 feed-forward features (2^27 elements) on a GPU
    of 132 SMs, 528 parts of 254,201, odd, so no load of a part is aligned and none is vectorised."""
    if split <= 1 or (numel % split == 0 and (numel // split) % multiple == 0):
        return split
    best = split
    for parts in range(max(2, split // 2), 2 * split + 1):
        if numel % parts == 0 and (numel // parts) % multiple == 0:
            if best == split or abs(parts / split - 1) < abs(best / split - 1):
                best = parts
    return best


@functools.cache
def _aligned_splits_class():
    from torch._inductor.choices import InductorChoices

    class AlignedReductionSplits(InductorChoices):
        """Inductor's heuristics, with split reductions cut into aligned parts on GPUs (`aligned_split`)."""

        # A method here whether inductor's is a static one (torch 2.11, 2.13) or not (2.14): inductor calls it
        # on its choices object, so bound either way (a type checker reading 2.13's stubs sees a static one).
        def reduction_split_factor(self, device, reduction_numel_hint, numel_hint,  # type: ignore[override]
                                   inner_reduction):
            split = super().reduction_split_factor(device, reduction_numel_hint, numel_hint, inner_reduction)
            return aligned_split(int(reduction_numel_hint), int(split)) if device.type == "cuda" else split

        def uuid(self) -> str:  # what compile's cache keys the graphs compiled under it by (torch 2.13, 2.14)
            return "titanlike.AlignedReductionSplits/1"

    # torch 2.11 keys compile's cache by the class itself, pickled by reference: it must be found by its
    # name in this module (else every graph compiled under it bypasses the cache). Made on first use,
    # not at import, as inductor's heuristics module is slow to import.
    AlignedReductionSplits.__qualname__ = "AlignedReductionSplits"
    globals()["AlignedReductionSplits"] = AlignedReductionSplits
    return AlignedReductionSplits


def choices_hook_moved() -> str | None:
    """What moved of inductor's hook for its heuristics that the override relies on, or None. Imports those
    heuristics (about 2 s on a CPU)."""
    import inspect

    from torch._inductor.choices import InductorChoices
    from torch._inductor.virtualized import V

    rule = getattr(InductorChoices, "reduction_split_factor", None)
    if rule is None:
        return "inductor's InductorChoices has no reduction_split_factor"
    wanted = ["device", "reduction_numel_hint", "numel_hint", "inner_reduction"]
    if [p for p in inspect.signature(rule).parameters if p != "self"] != wanted:
        return f"InductorChoices.reduction_split_factor takes {inspect.signature(rule)}, not ({', '.join(wanted)})"
    if not hasattr(V, "set_choices_handler"):
        return "inductor has no V.set_choices_handler"
    return None


@probe_for("aligned_reduction_splits")
def probe_aligned_reduction_splits() -> str | None:
    import torch

    if not hasattr(_inductor_config(), "inductor_choices_class"):
        return "inductor has no config.inductor_choices_class"
    # The hook itself is read only where the override can act, with a GPU: every run's start would pay the
    # import (the CPU tests check it, tests/test_overrides.py).
    if torch.cuda.is_available() and (why := choices_hook_moved()) is not None:
        return why
    return version_outside(torch.__version__, (2, 11), (2, 14))


def use_aligned_reduction_splits() -> None:
    """Inductor splits reductions into aligned parts from here on, in this process. Its compiled graphs are
    cached apart from stock ones: the cache key holds the heuristics' uuid (torch 2.11: the class itself)."""
    import torch

    # The rule changes GPU kernels only: without a GPU, inductor's choices stay its own (and so do the keys
    # of its cache).
    if not torch.cuda.is_available() or not overrides.active("aligned_reduction_splits"):
        return
    from torch._inductor.virtualized import V

    choices = _aligned_splits_class()
    _inductor_config().inductor_choices_class = choices
    V.set_choices_handler(choices())  # where this thread made inductor's default heuristics already
