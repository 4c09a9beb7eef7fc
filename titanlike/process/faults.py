"""Faults a run meets, turned into clear answers: running out of GPU memory, and a collective that
failed because another rank did.

What a non-finite loss does (training.nonfinite: abort, skip, rollback) is nonfinite.py's decision;
skipping an update is optim.clip_and_step.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist

from titanlike.config.dims import ParallelDims, parallel_dims
from titanlike.config.fp8 import RECIPES
from titanlike.config.optimizer import OPTIMIZERS
from titanlike.config.schema import JobConfig
from titanlike.config.stages import Stage
from titanlike.parallel.device import allocator_settings

# ---- a collective failed ---------------------------------------------------------------------------


def collective_failure(e: BaseException) -> str | None:
    """One line for an error raised by a collective (a peer died or hung, the network failed), else None.

    NCCL raises DistBackendError (a DistError); gloo raises a plain RuntimeError whose message
    names gloo. A collective that times out waited parallel.backend_timeout_s for another rank: that
    rank's own log usually holds the real cause, so say so.
    """
    text = str(e).strip()
    if not (isinstance(e, dist.DistError) or "gloo" in text.lower() or "nccl" in text.lower()):
        return None
    first = text.splitlines()[0] if text else type(e).__name__
    first = re.sub(r"^\[[^\]]*\]\s*", "", first)  # gloo's "[.../unbound_buffer.cc:78] " source location
    first = first.split(". This is typically")[0][:300]  # gloo's generic advice, said better below
    what = "a collective timed out" if "timed out" in text.lower() else "a collective failed"
    return f"{what} ({first}); another rank probably failed or stopped first: see its log"


# ---- out of memory -----------------------------------------------------------------------------------


def gpu_memory(device: torch.device) -> dict | None:
    """Peak and total memory of this process's GPU in GiB, or None off CUDA."""
    if device.type != "cuda":
        return None
    gib = 1024**3
    return {
        "name": torch.cuda.get_device_name(device),
        "total": torch.cuda.get_device_properties(device).total_memory / gib,
        "allocated": torch.cuda.max_memory_allocated(device) / gib,
        "reserved": torch.cuda.max_memory_reserved(device) / gib,
    }


def oom_message(cfg: JobConfig, dims: ParallelDims, rank: int, step: int | None, memory: dict | None,
                snapshot: str | None = None, stage: Stage | None = None) -> str:
    """One line for torch.OutOfMemoryError: where, how much, and the options that use less memory.

    `dims`: the run's degrees and batch plan; `step` is the number of completed steps (None: the model
    was still being built); `memory` is gpu_memory()'s reading, taken after the failure (its peaks
    include the failed step). `stage`: the stage the step ran in, when it is a later one (a long-context
    stage has its own batch and seq_len, set in data.phase).
    """
    t, d = cfg.training, cfg.data
    when = "while building the model" if step is None else f"after {step} completed steps"
    where = f"rank {rank}" + (f" ({memory['name']}, {memory['total']:.1f} GiB)" if memory else "")
    cap = t.gpu_memory_limit_gib
    if memory and cap:
        where = where[:-1] + f", capped at {cap:g} GiB by training.gpu_memory_limit_gib)"
    peak = (f"peak {memory['allocated']:.1f} GiB allocated, {memory['reserved']:.1f} GiB reserved"
            if memory else "peak memory unknown (not a CUDA device)")
    knobs = []
    mode = cfg.activation_checkpoint.mode
    if mode != "full":
        knobs.append(f"--activation_checkpoint.mode {'selective or full' if mode == 'none' else 'full'} (now {mode})")
    later = stage is not None and stage.start_step > 1
    b, seq_len = (stage.local_batch, stage.seq_len) if later and stage else (t.local_batch_size, d.seq_len)
    global_batch = stage.global_batch if later and stage else dims.global_batch
    if b > 1:
        smaller = max(k for k in range(1, b) if b % k == 0)
        accum = global_batch // (smaller * dims.dp)
        knobs.append(f"local_batch_size = {smaller}, global_batch_size = {global_batch} in the data.phase stage from "
                     f"step {stage.start_step}" if later and stage else
                     f"--training.local_batch_size {smaller} --training.global_batch_size {global_batch}")
        knobs[-1] += f" (the same global batch in {accum} gradient-accumulation micro-batches)"
    else:
        knobs.append(f"seq_len = {seq_len // 2} in the data.phase stage from step {stage.start_step}" if later and stage
                     else f"--data.seq_len {seq_len // 2}")
        knobs[-1] += " (local batch is already 1)"
    if not t.loss_chunk_tokens:
        knobs.append("--training.loss_chunk_tokens 4096 (the logits then never exist whole)")
    if cfg.optimizer.state_dtype == "fp32":  # the smallest state dtype the run's optimizer takes
        if "8bit" in OPTIMIZERS[cfg.optimizer.name].state_dtypes:
            knobs.append("--optimizer.state_dtype 8bit (AdamW's moments in about 2 bytes a parameter instead of 8)")
        else:
            knobs.append("--optimizer.state_dtype bf16 (AdamW's moments in 4 bytes a parameter instead of 8)")
    leaner = RECIPES[cfg.fp8.recipe].leaner  # a recipe that keeps less, and why (config/fp8.py)
    if leaner and (dims.sharded or cfg.compile.enable):
        why = RECIPES[leaner].saves[0 if dims.sharded else 1]
        knobs.append(f"--fp8.recipe {leaner} (now {cfg.fp8.recipe}): {why}")
    if dims.sharded and cfg.parallel.reshard_after_forward != "always":
        knobs.append("--parallel.reshard_after_forward always (frees every gathered weight after forward)")
    allocator = allocator_settings() or ""
    fragmented = memory and memory["reserved"] > 1.2 * memory["allocated"] + 1
    if fragmented and "expandable_segments:true" not in allocator.lower():
        knobs.append("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (reserved far above allocated: fragmentation)")
    seen = f"; memory snapshot in {snapshot}" if snapshot else "; --profiling.memory_snapshot shows what held it"
    batch = (f"the stage from step {stage.start_step}: local batch {b} × seq_len {seq_len}" if later and stage else
             f"training.local_batch_size {b} × data.seq_len {seq_len}")
    return f"out of GPU memory on {where} {when}: {peak}; {batch}; to use less: {', '.join(knobs)}{seen}"


def explain(e: RuntimeError, cfg: JobConfig | None, world_size: int, rank: int, *, step: int | None = None,
            device: torch.device | None = None, dims: ParallelDims | None = None,
            oom_snapshot: Callable[[int], str | None] | None = None,
            stage: Stage | None = None) -> tuple[int, str] | None:
    """(exit code, the one line to print) for a failure a user can act on: out of GPU or host memory,
    a peer rank or the network gone; None for anything else (the traceback is the report). `step`:
    the steps completed (None: the run was still being built); `device` and `dims`: the run's;
    `oom_snapshot(step)` writes the allocator's history and returns where."""
    if isinstance(e, torch.OutOfMemoryError):
        if cfg is None:
            return None
        snapshot = oom_snapshot(step) if oom_snapshot is not None and step is not None else None
        if device is None:
            gpu = torch.cuda.is_available() and cfg.training.device != "cpu"
            device = torch.device("cuda" if gpu else "cpu")
        # The degrees the run was built with (a run that failed while being built: the same arithmetic,
        # which the config passed before any GPU work).
        dims = dims or parallel_dims(cfg, world_size)
        return 2, oom_message(cfg, dims, rank, step, gpu_memory(device), snapshot, stage)
    if "can't allocate memory" in str(e):  # the CPU allocator: a model or batch too large for this machine
        want = next((w for w in str(e).split("allocate ")[1:] if w[:1].isdigit()), "").split(" bytes")[0]
        size = f"{int(want) / 2**30:.1f} GiB" if want.isdigit() else "more memory than there is"
        return 2, (f"out of host memory: an allocation of {size} failed; check --model.* sizes, "
                   f"--training.local_batch_size and --data.seq_len")
    failure = collective_failure(e)  # a peer died or hung, or the network failed
    if failure is None:
        return None
    return 1, f"rank {rank} on {socket.gethostname()}: {failure}"
