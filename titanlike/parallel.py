"""Process group, device mesh, and the model transforms, applied in this order:

    float8 conversion (titanlike/float8/) → activation checkpointing → per-block torch.compile → FSDP2

Float8 comes first so compile sees the float8 casts and fuses them; AC before compile so the
recomputation is part of each compiled block; FSDP last so it shards the final modules. With
one rank no FSDP is applied: the plain model trains under bf16 autocast (single-GPU mode).
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from functools import partial

import torch
import torch.distributed as dist

from titanlike.config import ConfigError
from titanlike.config.dims import ParallelDims
from titanlike.model.decoder import Transformer

logger = logging.getLogger("titanlike")


# The CUDA caching allocator's settings, unless the user chose their own. Expandable segments let
# a block grow in place instead of reserving a new one, so activations of changing sizes (compile's
# buffers, float8 casts, the 128K-vocabulary logits) fragment memory far less; every benchmark in
# docs/benchmarks/ ran with it.
ALLOCATOR_DEFAULT = "expandable_segments:True"


def allocator_settings(environ=os.environ) -> str | None:
    """The allocator settings the user chose: PYTORCH_ALLOC_CONF, or its older name
    PYTORCH_CUDA_ALLOC_CONF; None if neither is set."""
    return environ.get("PYTORCH_ALLOC_CONF", environ.get("PYTORCH_CUDA_ALLOC_CONF"))


def default_allocator_settings(environ=os.environ) -> None:
    """Set PYTORCH_CUDA_ALLOC_CONF when the user chose no allocator settings. Read when CUDA
    allocates first, so call this before anything touches the GPU."""
    if allocator_settings(environ) is None:
        environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOCATOR_DEFAULT


def pick_device(choice: str, local_rank: int) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("training.device = cuda but no CUDA GPU is visible; use --training.device cpu or auto")
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(
                f"local rank {local_rank} has no GPU: {torch.cuda.device_count()} visible; "
                f"lower --nproc_per_node / NGPU"
            )
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(dims: ParallelDims, device: torch.device, timeout_s: int):
    """Start the process group and build the mesh; None with one rank (no process group at all)."""
    if not dims.sharded:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                            device_id=device if device.type == "cuda" else None)
    if dims.dp_replicate > 1:
        return init_device_mesh(device.type, (dims.dp_replicate, dims.dp_shard),
                                mesh_dim_names=("dp_replicate", "dp_shard"))
    return init_device_mesh(device.type, (dims.dp_shard,), mesh_dim_names=("dp_shard",))


def destroy_process_group() -> None:
    """Leave the process group at the end of a run, so the interpreter can exit cleanly.

    A gloo worker thread frees each finished collective's tensors itself, and freeing a tensor
    that Python made needs the GIL. If the interpreter starts shutting down before that thread
    gets it, the process aborts with "terminate called without an active exception" after a
    successful run (the crash pytorch/pytorch#179291 describes; seen here in about 1 of 10 two-node
    CPU runs, none in 26 since). Sleeping releases the GIL so those threads finish first.
    """
    time.sleep(0.2)
    dist.destroy_process_group()


# ---- activation checkpointing ------------------------------------------------------------------


def _save_matmuls_policy():
    """Op-level selective AC: keep matmul, attention and float8 amax outputs; recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    save = {aten.mm.default, aten._scaled_mm.default, aten.max.default, aten.amax.default,
            aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_efficient_attention.default}
    if hasattr(aten, "_scaled_dot_product_cudnn_attention"):
        save.add(aten._scaled_dot_product_cudnn_attention.default)
    if hasattr(torch.ops.higher_order, "flex_attention"):  # model.attn_mask = block_causal
        save.add(torch.ops.higher_order.flex_attention)

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _checkpointed(body, *args, context_fn=None):
    from torch.utils.checkpoint import checkpoint

    if context_fn is None:
        return checkpoint(body, *args, use_reentrant=False)
    return checkpoint(body, *args, use_reentrant=False, context_fn=context_fn)


def apply_activation_checkpointing(model: Transformer, mode: str, option: str, budget: float = 1.0) -> None:
    if mode == "none":
        return
    if mode == "budget":
        # No checkpoint wrapper: compile's min-cut partitioner decides what each graph saves, held
        # to `budget` of the bytes it would save unbudgeted. A process-wide setting, so it applies
        # to every graph compiled here (the blocks and the loss), read when each is compiled.
        import torch._functorch.config as functorch_config

        functorch_config.activation_memory_budget = budget
        return
    if mode == "selective" and option == "op":
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        policy = _save_matmuls_policy()
        runner = partial(_checkpointed, context_fn=partial(create_selective_checkpoint_contexts, policy))
        for block in model.blocks():
            block.checkpoint_fn = runner
        return
    every = 1 if mode == "full" else int(option)
    for i, block in enumerate(model.blocks()):
        if i % every == 0:
            block.checkpoint_fn = _checkpointed


# ---- compile and FSDP ----------------------------------------------------------------------------


def apply_compile(model: Transformer, options: dict[str, object] | None = None) -> None:
    # Per block rather than whole-model: blocks are identical, so inductor compiles one graph
    # and reuses it, and FSDP's per-block hooks stay outside the graphs. `options` are inductor
    # settings for these graphs only (float8.inductor_options), not for the whole process.
    for block in model.layers:
        block.compile(fullgraph=True, options=options or None)


# `reshard_after_forward = default` keeps the gathered weights from forward to backward (so backward
# all-gathers nothing) when all of them, in bf16, take at most this share of a GPU's memory: 1b on
# two H200s trains faster that way, for a little more memory
# (docs/benchmarks/2026-11-22-bf16-residual-fused-clip.md). An 8b (16 GB) stays resharded.
KEEP_GATHERED_MAX_SHARE = 1 / 16


def device_memory_bytes(device: torch.device, cap_gib: float) -> int | None:
    """What one GPU may use: its memory, or training.gpu_memory_limit_gib if lower; None off CUDA."""
    if device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    return min(total, int(cap_gib * 2**30)) if cap_gib else total


def resolve_reshard(reshard: str, gathered_bytes: int, memory_bytes: int | None) -> str:
    """parallel.reshard_after_forward as apply_fsdp takes it: `default` becomes `never` for a model
    whose gathered weights are small next to the GPU's memory; anything else is left as it is."""
    if reshard == "default" and memory_bytes and gathered_bytes <= KEEP_GATHERED_MAX_SHARE * memory_bytes:
        return "never"
    return reshard


def apply_fsdp(model: Transformer, mesh, param_dtype: torch.dtype | None, reshard: str) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    blocks_reshard = reshard != "never"
    shard = partial(fully_shard, mesh=mesh, mp_policy=mp)
    for block in model.layers:
        shard(block, reshard_after_forward=blocks_reshard)
    if not model.args.tie_embeddings:
        # A tied weight lives in both modules, so then the root group owns it instead.
        shard(model.tok_embeddings, reshard_after_forward=blocks_reshard)
        # Backward starts right at the output layer: resharding it after forward only to
        # gather it again at once would waste an all-gather.
        shard([model.norm, model.output], reshard_after_forward=reshard == "always")
    shard(model, reshard_after_forward=reshard == "always")
