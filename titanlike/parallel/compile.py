"""torch.compile, one block at a time."""

from __future__ import annotations

import torch

from titanlike.model.decoder import Transformer
from titanlike.overrides.compile import use_aligned_reduction_splits
from titanlike.parallel.activation_checkpoint import checkpointed_around_compiled


def apply_compile(model: Transformer, options: dict[str, object] | None = None,
                  recompute_outside: bool = False) -> None:
    """Compile each block of `model`; `options` are inductor settings for these graphs only
    (float8.inductor_options), not for the whole process.

    `recompute_outside` (context parallelism): a block that activation checkpointing recomputes whole is
    checkpointed around its compiled body, not inside the compiled graph. Inside, on torch 2.11 on two
    H200s, a recomputed block still kept what context-parallel attention (an autograd Function) saves for
    backward (its queries, outputs and log-sum-exps, every layer: 7.8 of the 29.8 GiB of `1b` at 131,072
    tokens with cp 2, docs/benchmarks/2026-11-28-cp-long-window-memory.md); outside, the checkpoint drops
    everything the compiled graph saves and runs it again in backward."""
    # Process-wide, unlike `options`: inductor's rule for splitting reductions (an override, overrides/compile.py).
    use_aligned_reduction_splits()
    # Per block rather than whole-model: blocks are identical, so inductor compiles one graph
    # and reuses it, and FSDP's per-block hooks stay outside the graphs.
    for block in model.blocks():
        whole = block.hooks.recompute is not None and not block.hooks.policy
        if recompute_outside and whole:
            # The body alone (one graph shared by every block, as the module's); forward stays eager and
            # hands it to the checkpoint.
            block.hooks.body = torch.compile(block.body, fullgraph=True, options=options or None)  # type: ignore[arg-type]
            block.hooks.recompute = checkpointed_around_compiled
        else:
            block.compile(fullgraph=True, options=options or None)
