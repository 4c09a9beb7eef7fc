"""FSDP2 over the mesh, with its mixed precision; on one rank, bf16 autocast instead.

`shard_model` is the one decision the trainer asks for: whether the weights are sharded, in which
dtype they compute, and whether the gathered weights are kept from forward to backward.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from titanlike.config.speed import resolve_reshard
from titanlike.model.decoder import Transformer
from titanlike.model.shape import count_params
from titanlike.parallel.device import device_memory_bytes

__all__ = ["apply_fsdp", "resolve_reshard", "shard_model"]

logger = logging.getLogger("titanlike")


class GradientsInComputePool:
    """FSDP2's reduce-scatter, with its output (which becomes the sharded gradients) allocated from the
    compute stream's memory instead of the reduce-scatter stream's.

    The caching allocator keeps the memory of each stream apart. FSDP reduce-scatters on a stream of
    its own, so the gradients (an fp32 shard of every weight: 15 GiB a GPU for 8b on two GPUs) come
    from a pool that the activations backward frees can never refill: the peak held both. From the
    compute stream's pool they reuse that memory. Two rules keep it safe: the reduce-scatter stream
    waits for the compute stream's work queued so far (the block may have been freed by a kernel
    still queued there), and the block records the reduce-scatter stream (not reused before the
    reduce-scatter's own work on it is done).

    The reduce-scatter's input (one module's unsharded fp32 gradients) goes back as soon as the
    collective is queued, where FSDP would keep it until the next module's reduce-scatter: through
    that module's whole backward. The output layer's is 2 GiB on 8b, kept through the last block's
    backward, at the peak."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        current, compute = torch.cuda.current_stream(device), torch.cuda.default_stream(device)
        if current == compute:  # FSDP's input buffer, filled on the compute stream
            return torch.empty(*size, dtype=dtype, device=device)
        with torch.cuda.stream(compute):
            out = torch.empty(*size, dtype=dtype, device=device)
        current.wait_stream(compute)
        out.record_stream(current)
        return out

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op, async_op: bool = False):
        work = dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        if not async_op:
            # FSDP holds the input only so that nothing reuses its memory while the collective may still
            # read it. A synchronous call has made this (the reduce-scatter) stream wait for the
            # collective, and the block records this stream: freed now, it is reused only once the
            # collective is done. Nothing reads the input after this call.
            input_tensor.record_stream(torch.cuda.current_stream(input_tensor.device))
            input_tensor.untyped_storage().resize_(0)
        return work


def apply_fsdp(model: Transformer, mesh, param_dtype: torch.dtype | None, reshard: str,
               offload_policy=None, fused_loss: bool = False) -> None:
    """`offload_policy`: FSDP's CPUOffloadPolicy (parallel/offload.py), or None to keep everything on the GPU.
    `fused_loss`: the training loss is the fused chunked one (training.loss_chunk_tokens), whose
    backward needs no output weight (model/loss.py)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    offload = {} if offload_policy is None else {"offload_policy": offload_policy}
    blocks_reshard = reshard != "never"
    # Plain FSDP on GPUs: gradients from the compute stream's pool. HSDP keeps torch's own buffers (its
    # all-reduce runs on yet another stream), and so does a torch without custom reduce-scatters.
    # Offloaded, the gradients leave the GPU as soon as they are reduced: no pool to share.
    gradients_in_compute_pool = mesh.device_type == "cuda" and mesh.ndim == 1 and offload_policy is None
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
    if mesh.device_type == "cuda" and offload_policy is None and not model.args.tie_embeddings:
        for module in (model.tok_embeddings, model.output):
            gather_on_compute_stream(module)
    replace_reduce_scatter_copy_in()
    if gradients_in_compute_pool:
        comm = GradientsInComputePool()
        for module in modules:
            if hasattr(module, "set_custom_reduce_scatter"):
                module.set_custom_reduce_scatter(comm)


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


def gather_on_compute_stream(module) -> None:
    """FSDP gathers `module`'s weights into memory from the compute stream's pool, and frees that as soon
    as they are copied out of it.

    By default FSDP gathers every module into memory from a side stream's pool and, in forward, keeps
    each gathered buffer until the next module's gather is done. The embedding and the output layer
    are a vocabulary × dim matrix each, 1 GiB in bf16 on `8b`, where a block gathers 0.2 GiB in
    float8: between steps the side pool is cut into blocks' buffers, and it grew to fit one more of
    those matrices beside them. On 8b over two GPUs it reserved 2.0 GiB, half of it free at the peak
    (docs/benchmarks/2026-11-26-8b-under-the-peer.md). On the compute stream these two take memory only
    while their gather is copied out, from the pool that activations use anyway; the cast of their
    shard to bf16 before the gather then runs on the compute stream too, twice a step. The switch is
    private to FSDP (torch 2.11 to 2.13 have it); a torch without it keeps FSDP's default."""
    setter = getattr(module, "_set_unshard_async_op", None)
    if setter is not None:
        setter(True)


# FSDP's own copy-in, kept by replace_reduce_scatter_copy_in for the world sizes ours does not serve.
_FSDP_COPY_IN: Callable[[list[torch.Tensor], torch.Tensor, int], None] | None = None


def copy_gradients_in(unsharded_grads: list[torch.Tensor], reduce_scatter_input: torch.Tensor,
                      world_size: int) -> None:
    """FSDP's reduce-scatter copy-in: over two ranks, copy_gradients_in_pieces; otherwise FSDP's own.

    Torch's `chunk_cat` kernel, which FSDP's own runs on the compute stream once a module a step, is
    slow only when it splits each gradient in two. For an `8b` block's gradients on an H100 it took
    2.60 ms over two ranks against the pieces' 0.53, and 26 ms of an `8b` step over two H200s: the
    trainer is 0.6 % faster without it. Over 8 ranks it took 0.70 ms against 0.87, over 64 ranks 0.64
    against 6.06 (the pieces, one per rank and gradient, are then many and small)
    (docs/benchmarks/2026-11-26-8b-step-fence-and-copy-in.md)."""
    if world_size != 2 and _FSDP_COPY_IN is not None:
        _FSDP_COPY_IN(unsharded_grads, reduce_scatter_input, world_size)
    else:
        copy_gradients_in_pieces(unsharded_grads, reduce_scatter_input, world_size)


def copy_gradients_in_pieces(unsharded_grads: list[torch.Tensor], reduce_scatter_input: torch.Tensor,
                             world_size: int) -> None:
    """The layout FSDP's copy-in gives its flat buffer: rank r's part holds the r-th dim-0 chunk of every
    gradient in turn, each dim 0 padded to a multiple of the world size and the padding zero; each
    element cast to the buffer's dtype (fp32). One foreach copy of the contiguous pieces."""
    rows = reduce_scatter_input.view(world_size, -1)
    dst: list[torch.Tensor] = []
    src: list[torch.Tensor] = []
    offset = 0
    for grad in unsharded_grads:
        flat = grad.reshape(grad.size(0), -1)  # a view of a contiguous gradient (FSDP's are)
        per_rank = -(-flat.size(0) // world_size)
        width = per_rank * flat.size(1)
        for rank in range(world_size):
            part = rows[rank, offset:offset + width]
            piece = flat[rank * per_rank:(rank + 1) * per_rank].reshape(-1)
            if piece.numel():
                dst.append(part[:piece.numel()])
                src.append(piece)
            if piece.numel() < width:
                part[piece.numel():].zero_()
        offset += width
    torch._foreach_copy_(dst, src)


def replace_reduce_scatter_copy_in() -> None:
    """Make FSDP copy gradients in with copy_gradients_in. The function it replaces is private to FSDP
    (torch 2.11 to 2.13 have it, with this signature); a torch without it keeps FSDP's own."""
    import inspect

    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

    global _FSDP_COPY_IN
    theirs = getattr(collectives, "foreach_reduce_scatter_copy_in", None)
    if theirs is None or theirs is copy_gradients_in:
        return
    if list(inspect.signature(theirs).parameters) == ["unsharded_grads", "reduce_scatter_input", "world_size"]:
        _FSDP_COPY_IN = theirs
        collectives.foreach_reduce_scatter_copy_in = copy_gradients_in


def unshard_in_backward(module, needed: bool) -> None:
    """Whether FSDP gathers `module`'s weights for its backward (a torch without the setting always does)."""
    if hasattr(module, "set_unshard_in_backward"):
        module.set_unshard_in_backward(needed)


def shard_model(model: Transformer, mesh, device: torch.device, *, mixed_precision: str, reshard: str,
                memory_limit_gib: float, log: bool, offload_policy=None,
                fused_loss: bool = False) -> contextlib.AbstractContextManager:
    """FSDP over `mesh` (None: one rank, nothing to shard; a one-rank mesh when offloading). bf16 compute
    on a GPU: FSDP casts the gathered weights; one rank uses autocast instead. Returns the context each
    forward runs in."""
    gpu_bf16 = device.type == "cuda" and mixed_precision == "bf16"
    if mesh is None:
        return torch.autocast("cuda", dtype=torch.bfloat16) if gpu_bf16 else contextlib.nullcontext()
    gathered = 2 * count_params(model.args)[0]  # bytes of every weight gathered in bf16
    chosen = resolve_reshard(reshard, gathered, device_memory_bytes(device, memory_limit_gib))
    apply_fsdp(model, mesh, torch.bfloat16 if gpu_bf16 else None, chosen, offload_policy, fused_loss)
    if log and chosen != reshard:
        logger.info(f"FSDP keeps the gathered weights from forward to backward ({gathered / 1e9:.1f} GB in bf16, "
                    f"small next to the GPU's memory); --parallel.reshard_after_forward always frees them")
    return contextlib.nullcontext()
