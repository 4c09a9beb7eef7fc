"""CPU offload (parallel.cpu_offload): FSDP2 keeps each rank's shards of the weights, their gradients and
the optimizer state in pinned host memory, copies a module's shards to the GPU just before its all-gather
and the reduce-scattered gradients back, and the optimizer steps on the CPU. The GPU keeps the gathered
weights and the activations only: the lever for a model whose fp32 state does not fit beside them.

What this module owns: the policy FSDP takes, where the model is materialised (FSDP refuses offloaded
parameters that are not on the CPU) and where its buffers go (the GPU: they are inputs of the compute),
the host memory the state needs and the check that the host has it, and the CPU threads the update gets.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
from torch import nn

from titanlike.config import ConfigError
from titanlike.config.host import host_available_bytes

logger = logging.getLogger("titanlike")

GiB = 2**30
# Host bytes a parameter's shard takes: the fp32 weight and its fp32 gradient, and AdamW's two moments
# (fp32: 8 bytes; 8-bit: one byte each plus a fp32 scale per block of 256 values, rounded up).
WEIGHT_AND_GRAD_BYTES = 8
MOMENT_BYTES = {"fp32": 8, "bf16": 4, "8bit": 2.04}


def policy(enabled: bool):
    """The offload policy fully_shard takes (pinned host memory: the copies overlap compute), or None."""
    if not enabled:
        return None
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy(pin_memory=True)


def param_device(device: torch.device, enabled: bool) -> torch.device:
    """Where `to_empty` materialises the sharded model: the host when offloaded, else the device."""
    return torch.device("cpu") if enabled else device


def buffers_to(model: nn.Module, device: torch.device) -> None:
    """Move the model's buffers (the rotary tables) to the GPU, where the forward reads them; the
    offloaded parameters stay where FSDP put them."""
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf.device != device:
                setattr(module, name, buf.to(device))


def host_bytes_per_rank(n_params: int, dp_shard: int, state_dtype: str, background_saves: bool) -> int:
    """Host memory one rank's offloaded state takes: weights, gradients and moments of its 1/dp_shard,
    plus, with background saves (checkpoint.async_mode), the host copy of weights and moments a save
    stages while training goes on (checkpoint/staging.py)."""
    per_param = WEIGHT_AND_GRAD_BYTES + MOMENT_BYTES[state_dtype]
    if background_saves:
        per_param += 4 + MOMENT_BYTES[state_dtype]
    return int(n_params * per_param / dp_shard)


def check_host_memory(n_params: int, dp_shard: int, state_dtype: str, background_saves: bool, *,
                      local_ranks: int, log: bool) -> None:
    """Say what the offloaded state needs (one log line) and stop with one line if a host lacks it.

    Every rank on a host offloads its own shard, so a host needs `local_ranks` times one rank's bytes.
    The verdict is agreed over every rank (hosts differ), so that all stop together or none does."""
    per_rank = host_bytes_per_rank(n_params, dp_shard, state_dtype, background_saves)
    need, have = per_rank * local_ranks, host_available_bytes()
    if log:
        logger.info(f"cpu offload: {per_rank / GiB:.1f} GiB of host memory a rank ({n_params / 1e9:.2f}B parameters: "
                    f"fp32 weights and gradients, {state_dtype} AdamW moments, over dp_shard {dp_shard}"
                    f"{', and the copy a background save stages' if background_saves else ''}), "
                    f"{need / GiB:.1f} GiB for the {local_ranks} rank(s) of this host; {have / GiB:.1f} GiB available")
    short = torch.tensor([float(need - have), float(need), float(-have)], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(short, op=dist.ReduceOp.MAX)  # the worst host: largest shortfall, smallest memory
    if short[0] > 0:
        raise ConfigError(
            f"parallel.cpu_offload needs {short[1] / GiB:.1f} GiB of host memory on each host "
            f"({local_ranks} rank(s) × {per_rank / GiB:.1f} GiB) but a host has {-short[2] / GiB:.1f} GiB available: "
            f"use more GPUs (a larger dp_shard), --optimizer.state_dtype 8bit, or a smaller model")


def cpu_threads(local_ranks: int, environ=os.environ) -> int | None:
    """Threads for each rank's CPU update: the host's cores shared among its ranks. torchrun and
    run_train.sh start every rank of a multi-GPU run with one thread (OMP_NUM_THREADS=1: right when
    the CPU only feeds the GPU); offloaded, the CPU runs the optimizer step, the slow part, so 1 is
    taken for that default. None: any other OMP_NUM_THREADS, which is the user's choice to keep."""
    if environ.get("OMP_NUM_THREADS", "") not in ("", "1"):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_ranks))


def local_ranks(environ=os.environ) -> int:
    """Ranks on this host, as torchrun says (LOCAL_WORLD_SIZE); 1 for a plain process."""
    return int(environ.get("LOCAL_WORLD_SIZE", 1))


def prepare_host(enabled: bool, device: torch.device, n_params: int, dp_shard: int, state_dtype: str,
                 background_saves: bool, *, log: bool) -> None:
    """Before any model is built, on a run that offloads: a GPU to offload from, host memory for the state
    the GPUs give up (check_host_memory), and the host's cores for the CPU update (cpu_threads)."""
    if not enabled:
        return
    if device.type != "cuda":
        raise ConfigError("parallel.cpu_offload moves the training state from a GPU to host memory, and no CUDA "
                          "GPU is visible: drop --parallel.cpu_offload")
    check_host_memory(n_params, dp_shard, state_dtype, background_saves, local_ranks=local_ranks(), log=log)
    threads = cpu_threads(local_ranks())
    if threads:
        torch.set_num_threads(threads)
