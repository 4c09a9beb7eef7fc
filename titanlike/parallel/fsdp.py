"""FSDP2 over the mesh, with its mixed precision; on one rank, bf16 autocast instead.

`shard_model` is the one decision the trainer asks for: whether the weights are sharded, in which
dtype they compute, and whether the gathered weights are kept from forward to backward.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from titanlike import overrides
from titanlike.config.schema import JobConfig
from titanlike.config.speed import resolve_reshard
from titanlike.model.decoder import Transformer
from titanlike.model.shape import count_params
from titanlike.overrides.fsdp import gradients_in_compute_pool
from titanlike.parallel.device import device_memory_bytes
from titanlike.parallel.offload import policy as cpu_offload_policy

__all__ = ["apply_fsdp", "reduce_dtype", "resolve_reshard", "shard_model", "sync_after"]

logger = logging.getLogger("titanlike")


def apply_fsdp(model: Transformer, mesh: DeviceMesh, param_dtype: torch.dtype | None, reshard: str,
               offload_policy=None, fused_loss: bool = False, reduce_dtype: torch.dtype = torch.float32) -> None:
    """`reduce_dtype`: the dtype the gradients are summed over the ranks in (FSDP's reduce-scatter input).
    `offload_policy`: FSDP's CPUOffloadPolicy (parallel/offload.py), or None to keep everything on the GPU.
    `fused_loss`: the training loss is the fused chunked one (training.loss_chunk_tokens), whose
    backward needs no output weight (model/loss.py)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload = {} if offload_policy is None else {"offload_policy": offload_policy}
    blocks_reshard = reshard != "never"
    # Plain FSDP on GPUs: gradients from the compute stream's pool (an override, titanlike/overrides/fsdp.py).
    # HSDP keeps torch's own buffers (its all-reduce runs on yet another stream). Offloaded, the gradients
    # leave the GPU as soon as they are reduced: no pool to share.
    compute_pool = (mesh.device_type == "cuda" and mesh.ndim == 1 and offload_policy is None
                    and overrides.active("gradients_in_compute_pool"))
    modules = []

    def shard(module, reshard_after_forward: bool) -> None:
        sharded = fully_shard(module, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward, **offload)
        # Modules sharded together (a list) share one FSDP state: set it through the first.
        modules.append(sharded[0] if isinstance(sharded, (list, tuple)) else sharded)

    for block in model.layers:
        shard(block, reshard_after_forward=blocks_reshard)
    if not model.args.tie_embeddings:
        # A tied weight lives in both modules, so then the root group owns it instead.
        shard(model.tok_embeddings, reshard_after_forward=blocks_reshard)
        # An embedding's backward reads the token ids, never its weight: no all-gather for it.
        unshard_in_backward(model.tok_embeddings, False)
        # The output layer sits alone in its group (the final norm's gain goes with the root's), so
        # that its second forward, the chunked loss's `loss_sum`, gathers and reduce-scatters it as
        # `forward` does: FSDP hooks a method of one module.
        fused = fused_loss and hasattr(model.output, "loss_sum")  # not a float8 output layer
        # Whole logits: backward starts right at the output layer, and resharding it after forward
        # only to gather it again at once would waste an all-gather. Fused, backward never reads
        # the weight (its gradient was computed in forward): free it after forward, gather it
        # not at all in backward (1 GiB less at the peak on 8b, one all-gather less a step).
        shard(model.output, reshard_after_forward=reshard == "always" or (fused and blocks_reshard))
        if hasattr(model.output, "loss_sum"):
            register_fsdp_forward_method(model.output, "loss_sum")
        if fused:
            unshard_in_backward(model.output, False)
    shard(model, reshard_after_forward=reshard == "always")
    prefetch_forward(model)
    if compute_pool:
        gradients_in_compute_pool(modules)


def prefetch_forward(model: Transformer) -> None:
    """Each sharded module of the forward chain (embedding, blocks, output layer) issues the next one's
    all-gather as soon as its own is done, before its forward is queued.

    By default FSDP issues a module's all-gather from that module's pre-forward hook, on the CPU. That
    overlaps with the previous module's compute only while the CPU runs ahead of the GPU; where a
    block's GPU time is close to its CPU time (FSDP's hooks, the float8 casts, the compiled block's
    launch: about 4 ms a block of `1b`), the gather is queued just when the GPU needs it and the GPU
    waits it out. A cp 2 rank of `1b` at 16,384 tokens waited 11 ms a step for these gathers, and 1 ms
    with this (H200, docs/benchmarks/2026-11-26-cp-prefetch-offload-long-windows.md; that run stayed
    bound by its CPU, at the same speed). One module ahead holds the same memory as FSDP's default
    overlap (torch's `set_modules_to_forward_prefetch`)."""
    forward_order = (model.tok_embeddings, *model.layers, model.output)
    chain = [m for m in forward_order if hasattr(m, "set_modules_to_forward_prefetch")]
    for module, following in zip(chain, chain[1:]):
        module.set_modules_to_forward_prefetch([following])


def sync_after(model, last: bool) -> None:
    """parallel.gradient_sync = step, before each micro-batch of a step: whether the micro-batch's backward sums
    the gradients over the ranks and frees the gathered weights (`last`, the step's last micro-batch), or adds
    the gradients up unsharded and keeps the weights gathered for the next micro-batch's forward. FSDP2's own
    switches (FSDP1's `no_sync`); a model FSDP does not shard has nothing to sum."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(last)
        model.set_reshard_after_backward(last)


def unshard_in_backward(module, needed: bool) -> None:
    """Whether FSDP gathers `module`'s weights for its backward (a torch without the setting always does)."""
    if hasattr(module, "set_unshard_in_backward"):
        module.set_unshard_in_backward(needed)


def reduce_dtype(mixed_precision_reduce: str, mesh: DeviceMesh | None) -> torch.dtype:
    """The dtype the ranks of `mesh` (None: one rank) sum gradients in. One rank sums nothing: a bf16 reduce
    would only round its gradients."""
    summing = mesh is not None and mesh.size() > 1
    return torch.bfloat16 if mixed_precision_reduce == "bf16" and summing else torch.float32


def shard_model(model: Transformer, mesh: DeviceMesh | None, device: torch.device, cfg: JobConfig, *,
                log: bool) -> contextlib.AbstractContextManager[Any]:
    """FSDP over `mesh` (None: one rank, nothing to shard; a one-rank mesh when offloading). bf16 compute
    on a GPU (training.mixed_precision): FSDP casts the gathered weights; one rank uses autocast instead.
    Gradients are summed in training.mixed_precision_reduce's dtype where there is more than one rank to
    sum; parallel.cpu_offload keeps the shards in host memory. Returns the context each forward runs in."""
    t = cfg.training
    gpu_bf16 = device.type == "cuda" and t.mixed_precision == "bf16"
    if mesh is None:
        return torch.autocast("cuda", dtype=torch.bfloat16) if gpu_bf16 else contextlib.nullcontext()
    gathered = 2 * count_params(model.args)[0]  # bytes of every weight gathered in bf16
    # Resharding is decided for the memory the run has: a cap, or a fit's number of GiB (`auto`: the card's own).
    fit_gib = t.fit_gib if isinstance(t.fit_gib, float) else 0.0
    memory_limit_gib = min(filter(None, (t.gpu_memory_limit_gib, fit_gib)), default=0.0)
    reshard = cfg.parallel.reshard_after_forward
    chosen = resolve_reshard(reshard, gathered, device_memory_bytes(device, memory_limit_gib))
    apply_fsdp(model, mesh, torch.bfloat16 if gpu_bf16 else None, chosen, cpu_offload_policy(cfg.parallel.cpu_offload),
               t.loss_chunk_tokens > 0, reduce_dtype(t.mixed_precision_reduce, mesh))
    if log and chosen != reshard:
        logger.info(f"FSDP keeps the gathered weights from forward to backward ({gathered / 1e9:.1f} GB in bf16, "
                    f"small next to the GPU's memory); --parallel.reshard_after_forward always frees them")
    return contextlib.nullcontext()
