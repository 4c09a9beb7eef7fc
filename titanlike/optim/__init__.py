"""The optimizers (one module each, built through one registry), the warmup-stable-decay learning-rate
schedule, and gradient clipping over DTensors.

    optimizer = build_optimizer(model, cfg.optimizer, device_type, host_params)   # optimizer.name's builder
    update_rms(optimizer)        at log steps: each parameter kind's update RMS, where the optimizer measures it

A new optimizer is one module with a `build(model, section, device_type, host_params)` and one entry in
OPTIMIZER_BUILDERS, beside its facts in config/optimizer.py (OPTIMIZERS): docs/architecture.md."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from titanlike.config.optimizer import Optimizer as OptimizerConfig
from titanlike.config.schema import LRScheduler
from titanlike.optim import adamw, muon

Builder = Callable[[nn.Module, OptimizerConfig, str, bool], torch.optim.Optimizer]

OPTIMIZER_BUILDERS: dict[str, Builder] = {"adamw": adamw.build, "muon": muon.build}
"""optimizer.name → its builder: (model, the [optimizer] section, device type, whether the parameters live
on the host while the model computes on a GPU: parallel.cpu_offload) → a torch.optim.Optimizer."""


def build_optimizer(model: nn.Module, section: OptimizerConfig | None = None, device_type: str | None = None,
                    host_params: bool = False, **fields: Any) -> torch.optim.Optimizer:
    """The optimizer `section` (the run's [optimizer]) names, over `model`'s trainable parameters, with its
    state made (before the first step: adamw.allocate_state says why). `fields`: the section's fields by
    name instead of a section (lr=, weight_decay=, ...; the defaults for the rest), for callers without a
    config. `host_params`: the parameters live in host memory while the model computes on a GPU
    (parallel.cpu_offload); the update then runs on the CPU."""
    if device_type is None:
        raise TypeError("build_optimizer needs the device type the model computes on (cpu or cuda)")
    if section is None:
        section = OptimizerConfig(**fields)
    elif fields:
        raise TypeError(f"build_optimizer takes a section or its fields, not both ({', '.join(fields)})")
    return OPTIMIZER_BUILDERS[section.name](model, section, device_type, host_params)


def update_rms(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """The last update's RMS per unit of learning rate, by kind of parameter ("update_rms_<kind>"), for an
    optimizer that measures it (an `update_rms()` of device tensors by kind, such as Muon's); {} for the
    others. A collective when sharded: every rank calls it, at the same (log) steps; it reads the values
    on the host."""
    measure = getattr(optimizer, "update_rms", None)
    if measure is None:
        return {}
    return {f"update_rms_{kind}": float(value) for kind, value in measure().items()}


def lr_factor(step: int, total_steps: int, warmup_steps: int, decay_ratio: float, decay_type: str,
              min_lr_factor: float) -> float:
    """Multiplier of the peak LR for the update of `step` (1-based): warmup, stable, then decay."""
    if warmup_steps and step <= warmup_steps:
        return step / (warmup_steps + 1)
    # Decay never eats into warmup: with decay_ratio = 1.0 it starts right after warmup, at the peak.
    decay_steps = min(int(decay_ratio * total_steps), max(0, total_steps - warmup_steps))
    decay_start = total_steps - decay_steps
    if step <= decay_start or decay_steps == 0:
        return 1.0
    progress = min(1.0, (step - decay_start) / decay_steps)  # in (0, 1]; past the end, stay at the floor
    if decay_type == "cosine":
        shape = 0.5 * (1 + math.cos(math.pi * progress))
    else:
        shape = 1 - progress
    return min_lr_factor + (1 - min_lr_factor) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, section: LRScheduler,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The [lr_scheduler] section's schedule over `total_steps` (training.steps) updates."""
    s = section
    # LambdaLR calls the function with the number of scheduler.step() calls so far (0 at
    # construction), i.e. the update about to happen is step count + 1.
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda done: lr_factor(done + 1, total_steps, s.warmup_steps, s.decay_ratio, s.decay_type, s.min_lr_factor),
    )


def grad_norm(params: list[torch.Tensor]) -> torch.Tensor:
    """Global L2 norm of all gradients, over every shard and rank.

    With FSDP the gradients are sharded DTensors: their norm is a partial value that
    `full_tensor()` completes with one all-reduce, so every rank sees (and clips by) the same number.
    """
    from torch.distributed.tensor import DTensor

    total = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], norm_type=2.0, foreach=True)
    return total.full_tensor() if isinstance(total, DTensor) else total


def clip_and_step(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], max_norm: float,
                  skip_nonfinite: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip the gradients to max_norm (if > 0) and update; returns (pre-clip gradient norm, skipped).

    `skipped` is 1.0 where skip_nonfinite is set and the norm is not finite, else 0.0. A skipped
    update leaves the weights and the optimizer state (moments, step count) exactly as they were.
    Skipping reads the flag on the host: one synchronisation a step on a GPU, with
    training.nonfinite = skip only. (Fused AdamW's undeclared grad_scale and found_inf inputs, the AMP
    grad scaler's, once folded the clipping and the skip into its kernel: 1.0045x on `1b`, under what
    an override of torch's internals must buy, docs/overrides.md.)

    The norm is the same number on every rank (grad_norm all-reduces it), so all ranks clip by the
    same factor and skip together; a non-finite loss on any rank makes the norm non-finite.
    """
    total = grad_norm(params)
    skipped = (~torch.isfinite(total)).float() if skip_nonfinite else torch.zeros((), device=total.device)
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    if not (skip_nonfinite and skipped.item()):
        optimizer.step()
    return total, skipped


def resume_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR, done_steps: int) -> None:
    """Put this run's LR schedule (its configured peak LR, warmup, decay and steps) at `done_steps`
    updates done, and set the optimizer's LR to the one the next update uses. A resume applies the
    schedule as configured now, not as it was when the checkpoint was saved."""
    # LambdaLR's own arithmetic (a tensor base LR times the factor where the optimizer keeps a tensor
    # LR), so that a resumed run's LR is bit for bit the uninterrupted run's.
    lrs = [base * fn(done_steps) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    # Through the scheduler's own state_dict: its position, and the LRs get_last_lr() reports.
    state = scheduler.state_dict()
    state.update(last_epoch=done_steps, _step_count=done_steps + 1,
                 _last_lr=[lr.clone() if isinstance(lr, torch.Tensor) else lr for lr in lrs])
    scheduler.load_state_dict(state)
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)  # torchao's low-bit AdamW refuses a float LR
        else:
            group["lr"] = lr
