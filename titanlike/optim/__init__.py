"""AdamW (fp32, bf16 or 8-bit moments), the warmup-stable-decay learning-rate schedule, and gradient clipping over
DTensors."""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    import torchao.optim


def build_optimizer(model: nn.Module, lr: float, weight_decay: float, betas: list[float], eps: float,
                    device_type: str, state_dtype: str = "fp32", host_params: bool = False) -> torch.optim.Optimizer:
    """`host_params`: the parameters live in host memory while the model computes on a GPU
    (parallel.cpu_offload); the update then runs on the CPU."""
    # Norm gains (1-D) take no weight decay: shrinking them toward zero only fights the norm.
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if state_dtype == "8bit":
        # Moments quantized in blocks of 256 values (codes + one fp32 scale per block), a quarter of
        # fp32's bytes; tensors under 4096 values (norm gains) keep fp32 moments. Its LR is a tensor in
        # each param group, which the schedule fills in place (resume_schedule, LambdaLR).
        return _adamw_8bit()(groups, lr=lr, betas=(betas[0], betas[1]), eps=eps)
    if state_dtype == "bf16":
        # Half fp32's moment bytes, the arithmetic in fp32: one fused update a parameter (optim/adamw_bf16.py).
        from titanlike.optim.adamw_bf16 import AdamWBf16Moments

        return AdamWBf16Moments(groups, lr=lr, betas=(betas[0], betas[1]), eps=eps)
    # Fused AdamW is one kernel for all parameters on CUDA; foreach is the fast path on CPU for a
    # CPU run's small models. Offloaded, the CPU update is the slow part of a step and torch's fused
    # CPU kernel is several times faster than foreach (a quick check, 67M parameters on 2 cores: 0.12 s against 0.57 s).
    fused = device_type == "cuda" or host_params
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=(betas[0], betas[1]), eps=eps, fused=fused, foreach=not fused)
    allocate_state(optimizer)
    return optimizer


def allocate_state(optimizer: torch.optim.AdamW) -> None:
    """Make AdamW's state (zero moments, step 0: what its first update would make) now, while the GPU
    holds little more than the weights, instead of at the first update.

    Made at the first update, the moments (8 bytes a parameter) land in the memory the first step's
    activations have just freed, scattered among the gradients, and every later step lays its
    activations out around them: `8b` over two GPUs reserved 0.4 GiB more at the peak so
    (docs/benchmarks/2026-11-26-8b-under-the-peer.md). Made here they sit beside the weights. The
    optimizer makes them itself, by one update of zero gradients at a zero learning rate (which
    leaves every weight as it was: AdamW's decay and step both scale by the learning rate), and the
    step counts go back to 0, so the first real update is the same one, bit for bit."""
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    for state in optimizer.state.values():
        state["step"].zero_()


def _adamw_8bit() -> type[torchao.optim.AdamW8bit]:
    from torchao.optim import AdamW8bit

    from titanlike.overrides.compile import no_autograd_cache

    # torch warns that its compile cache cannot hash torchao's state class stably; the step below
    # does not use that cache.
    warnings.filterwarnings("ignore", message="OptimState8bit does not implement _stable_hash_for_caching")

    class AdamW8bitUncached(AdamW8bit):
        """torchao compiles its update per parameter; taken from compile's on-disk autograd cache it
        crashed, so the step compiles without that cache (overrides/compile.py: no_autograd_cache)."""

        def step(self, closure=None):
            with no_autograd_cache():
                return super().step(closure)

    return AdamW8bitUncached


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


def build_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int, decay_ratio: float,
                    decay_type: str, min_lr_factor: float) -> torch.optim.lr_scheduler.LambdaLR:
    # LambdaLR calls the function with the number of scheduler.step() calls so far (0 at
    # construction), i.e. the update about to happen is step count + 1.
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda done: lr_factor(done + 1, total_steps, warmup_steps, decay_ratio, decay_type, min_lr_factor),
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
