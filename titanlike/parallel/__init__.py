"""How a run spreads over devices, and the model transforms that make it fast, applied by one call,
`parallelize` (apply.py), in this order:

    context parallelism → activation checkpointing → per-block torch.compile → FSDP2

on a model that float8 (titanlike/float8/) converted first, so compile sees the float8 casts and fuses
them; apply.py says why the order is this one. With one rank no FSDP is applied: the plain model
trains under bf16 autocast (single-GPU mode), unless it offloads to the CPU, which FSDP does (over a
one-rank mesh).

    apply.py                  `parallelize`: the transforms in order; the autocast and cp contexts it returns
    device.py                 which device, the CUDA allocator's settings, a memory cap, deterministic kernels,
                              how far the CPU runs ahead of the GPU
    mesh.py                   the process group, the DeviceMesh, means over ranks
    activation_checkpoint.py  what each block keeps for backward (activation_checkpoint.mode)
    compile.py                per-block torch.compile
    fsdp.py                   FSDP2 and its mixed precision, or autocast on one rank
    context.py                context parallelism: each rank holds part of every sequence (parallel.cp)
    offload.py                FSDP2's CPU offload: where the state lives, the host memory it needs

The transforms steer the model through its hooks (model/hooks.py). The degrees themselves (dp_replicate ×
dp_shard × cp, micro-batches) and the rank layout are plain arithmetic on the config, resolved once before
any worker starts (titanlike/config/dims.py).
"""

from titanlike.parallel import offload
from titanlike.parallel.activation_checkpoint import apply_activation_checkpointing
from titanlike.parallel.apply import Parallelized, parallelize
from titanlike.parallel.compile import apply_compile
from titanlike.parallel.context import ContextParallel, apply_context_parallel
from titanlike.parallel.device import (
    StepFence,
    allocator_settings,
    configure_device,
    cpu_threads_note,
    default_allocator_settings,
    device_memory_bytes,
    pick_device,
    this_gpu,
)
from titanlike.parallel.fsdp import apply_fsdp, reduce_dtype, resolve_reshard, shard_model, sync_after
from titanlike.parallel.mesh import context_mesh, destroy_process_group, init_distributed, mean_over_ranks

__all__ = ["ContextParallel", "Parallelized", "StepFence", "allocator_settings", "apply_activation_checkpointing",
           "apply_compile", "apply_context_parallel", "apply_fsdp", "configure_device", "context_mesh",
           "cpu_threads_note", "default_allocator_settings", "destroy_process_group", "device_memory_bytes",
           "init_distributed", "mean_over_ranks", "offload", "parallelize", "pick_device", "reduce_dtype",
           "resolve_reshard", "shard_model", "sync_after", "this_gpu"]
