"""AdamW, optimizer.name = adamw: torch's (fp32 moments, fused on a GPU), bf16 moments (adamw_bf16.py) or
torchao's 8-bit moments, over every parameter; norm gains without weight decay."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    import torchao.optim

    from titanlike.config.optimizer import Optimizer as OptimizerConfig


def build(model: nn.Module, section: OptimizerConfig, device_type: str, host_params: bool) -> torch.optim.Optimizer:
    """AdamW over every trainable parameter, its moments in optimizer.state_dtype (optim.build_optimizer's
    arguments)."""
    lr, weight_decay, eps, state_dtype = section.lr, section.weight_decay, section.eps, section.state_dtype
    betas = section.betas
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
