"""The parallelisms and the transforms that make a run fast, applied to a converted model in one call and
in the one order that works:

    context parallelism → activation checkpointing → per-block torch.compile → FSDP (or autocast on one rank)

The model arrives converted (float8's Linears swapped in: the trainer's converters), so compile sees the
converted layers and fuses their casts. Context parallelism first: it changes what each attention layer
computes, which the checkpoint recomputes and compile traces. Activation checkpointing before compile, so
the recomputation is part of each compiled block (under cp, a block recomputed whole is checkpointed
around its compiled body: compile.py says why). FSDP last, so it shards the final modules and its hooks
stay outside the compiled blocks. Tensor parallelism would come before all of them: it splits the Linears
that everything after it wraps (docs/architecture.md, "How to add a parallelism").
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from titanlike.config.dims import ParallelDims
from titanlike.config.schema import JobConfig
from titanlike.model.decoder import Transformer
from titanlike.parallel.activation_checkpoint import apply_activation_checkpointing
from titanlike.parallel.compile import apply_compile
from titanlike.parallel.context import ContextParallel, apply_context_parallel
from titanlike.parallel.fsdp import shard_model
from titanlike.parallel.mesh import context_mesh


@dataclass(frozen=True)
class Parallelized:
    """What the trainer needs of the parallelisms for each micro-batch."""

    autocast: contextlib.AbstractContextManager[Any]
    """The context each forward runs in: bf16 autocast on one GPU, nothing under FSDP (its mixed precision)."""
    context: ContextParallel | None
    """Context parallelism (parallel.cp > 1): this rank's part of each micro-batch (`shard`); None without."""


def parallelize(model: Transformer, dims: ParallelDims, cfg: JobConfig, *, device: torch.device,
                mesh: DeviceMesh | None, compile_options: dict[str, object], log: bool) -> Parallelized:
    """Apply the run's parallelisms and transforms to `model` (on the meta device, converted) in place.
    `mesh`: FSDP's (parallel.init_distributed; None: one rank, nothing to shard); the context group's mesh
    is made here from `dims`. `compile_options`: inductor settings for the blocks' graphs (the converters').
    `log`: this rank says what it chose."""
    cp_mesh = context_mesh(dims, device)  # the ranks that split each sequence, or None
    # Context parallelism: each attention layer gathers the keys and values of the group's ranks.
    context = apply_context_parallel(model, cp_mesh.get_group(), device.type) if cp_mesh is not None else None
    apply_activation_checkpointing(model, cfg.activation_checkpoint)
    if cfg.compile.enable:
        apply_compile(model, compile_options, recompute_outside=context is not None)
    # FSDP over the mesh (bf16 compute through its mixed precision), or one rank under autocast.
    return Parallelized(shard_model(model, mesh, device, cfg, log=log), context)
