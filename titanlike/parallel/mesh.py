"""The process group and the DeviceMeshes of a run with more than one rank, and the one collective the
trainer itself needs (a mean over ranks).

The rank layout, (dp_replicate, dp_shard, cp) with cp innermost, and the meshes' shapes are the resolved
degrees' (config/dims.py ParallelDims: dp_rank, fsdp_mesh, context_mesh); this module builds them. The
context group is a mesh of its own (`context_mesh`)."""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from titanlike.config.dims import ParallelDims


def init_distributed(dims: ParallelDims, device: torch.device, timeout_s: int,
                     cpu_offload: bool = False) -> DeviceMesh | None:
    """Start the process group and build the mesh; None with one rank (no process group at all),
    unless `cpu_offload`: FSDP is what offloads, so one rank gets a process group and mesh of its own.
    `dims`: the resolved degrees (dp_replicate, dp_shard, cp, sharded). The mesh is FSDP's: (dp_replicate,
    dp_shard × cp), or (dp_shard × cp,) without replicas."""
    if not dims.sharded and not cpu_offload:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    backend = "nccl" if device.type == "cuda" else "gloo"
    if cpu_offload and device.type == "cuda":
        # Offloaded gradients are host tensors: the gradient norm's all-reduce runs on them, on gloo.
        backend = "cuda:nccl,cpu:gloo"
    # One process without torchrun has no rendezvous address: an in-process store is all it needs.
    timeout, device_id = datetime.timedelta(seconds=timeout_s), device if device.type == "cuda" else None
    if dims.sharded:
        dist.init_process_group(backend, timeout=timeout, device_id=device_id)
    else:
        dist.init_process_group(backend, timeout=timeout, device_id=device_id, store=dist.HashStore(), rank=0,
                                world_size=1)
    shape, names = dims.fsdp_mesh
    return init_device_mesh(device.type, shape, mesh_dim_names=names)


def context_mesh(dims: ParallelDims, device: torch.device) -> DeviceMesh | None:
    """This rank's context group as a 1-D mesh (its cp ranks), or None without context parallelism.
    After init_distributed."""
    if dims.cp == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    shape, names = dims.context_mesh
    return init_device_mesh(device.type, shape, mesh_dim_names=names)["cp"]


def mean_over_ranks(values: torch.Tensor) -> torch.Tensor:
    """The mean of `values` over every rank (itself with one rank): one all-reduce."""
    if not dist.is_initialized():
        return values
    values = values.clone()
    dist.all_reduce(values)  # gloo has no AVG: sum, then divide
    return values / dist.get_world_size()


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
