"""AdamW with its two moments kept in bf16 (`optimizer.state_dtype = bf16`): 4 bytes a parameter instead
of fp32's 8, the weights and gradients staying fp32.

torch's AdamW keeps its moments in the parameter's dtype: neither its fused kernel nor its foreach path
takes bf16 moments beside fp32 weights. Here each parameter is updated by one kernel that reads the fp32
weight and gradient and the bf16 moments, does AdamW's arithmetic in fp32 and writes the weight and the
moments back (rounded to bf16): on a GPU the update compiled once for every size (the tensors flattened,
the length dynamic, CHUNK parameters a call), so it stays one fused pass over memory, with 8 bytes less to
read and write a parameter than fp32's. On the CPU the same arithmetic runs eagerly.

The moments are DTensors sharded like their parameters under FSDP (zeros_like of the parameter), so DCP
saves and reshards them as it does fp32 AdamW's. float8 all-gather wraps a weight in torchao's subclass:
the update writes the high-precision tensor inside it (overrides/float8.unwrap_weight).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from titanlike.overrides import foreach
from titanlike.overrides.float8 import unwrap_weight


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's plain tensor of a parameter, gradient or moment: a DTensor's local shard, and inside
    torchao's float8 weight wrapper, the weight itself."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    return unwrap_weight(t)[0]


def adamw_update(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: torch.Tensor,
                 lr: torch.Tensor, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """One AdamW update of `p` in place, in fp32, with the moments `m` and `v` stored back in their own dtype.
    `step` (the update's number, 1 for the first) and `lr` are 0-d tensors, so that a compiled update is
    not specialised on them."""
    g32 = g.float()
    m32 = m.float().lerp(g32, 1 - beta1)
    v32 = v.float() * beta2 + (1 - beta2) * g32 * g32
    m.copy_(m32)
    v.copy_(v32)
    bias1 = 1 - beta1 ** step
    bias2 = 1 - beta2 ** step
    denom = (v32 / bias2).sqrt() + eps
    p.copy_(p * (1 - lr * weight_decay) - (lr / bias1) * m32 / denom)


def adamw_update_all(ps: list[torch.Tensor], gs: list[torch.Tensor], ms: list[torch.Tensor],
                     vs: list[torch.Tensor], steps: list[torch.Tensor], lr: torch.Tensor, beta1: float,
                     beta2: float, eps: float, weight_decay: float) -> None:
    """`adamw_update` for every parameter of a group, each with its own moments and step."""
    for p, g, m, v, step in zip(ps, gs, ms, vs, steps):
        adamw_update(p, g, m, v, step, lr, beta1, beta2, eps, weight_decay)


_COMPILED: dict[str, Any] = {}


# Parameters a compiled call updates: one graph serves every full chunk of a group (their sizes are dynamic),
# a second the last. A call a parameter cost `1b` 5 % of its step on one H200 (the Python and the guards of
# each call); one graph for a whole group compiles for minutes on a large model.
CHUNK = 16


def _update_fn(device: torch.device):
    """The update of a list of parameters on `device`: compiled on a GPU (on first use), eager on the CPU."""
    if device.type != "cuda":
        return adamw_update_all
    if "cuda" not in _COMPILED:
        _COMPILED["cuda"] = torch.compile(adamw_update_all, dynamic=True, fullgraph=True)
    return _COMPILED["cuda"]


def load_state_keeping_dtypes(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """torch.optim.Optimizer.load_state_dict, but each state tensor kept in its own dtype. torch's casts every
    floating state tensor to its parameter's: bf16 moments would come back fp32 (twice the memory, all of it
    at once, and a run that no longer rounds as the uninterrupted one did). The same mapping of saved ids to
    parameters, in group order."""
    saved_groups = state_dict["param_groups"]
    if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in optimizer.param_groups]:
        raise ValueError("the saved optimizer state has other parameter groups than this optimizer")
    by_id = {saved: p for sg, g in zip(saved_groups, optimizer.param_groups)
             for saved, p in zip(sg["params"], g["params"])}
    for saved, value in state_dict["state"].items():
        p = by_id[saved]
        optimizer.state[p] = {k: v.to(device=p.device) if isinstance(v, torch.Tensor) else v for k, v in value.items()}
    for sg, g in zip(saved_groups, optimizer.param_groups):
        g.update({k: v for k, v in sg.items() if k != "params"})


class AdamWBf16Moments(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias-corrected moments) with bf16 moments and fp32 arithmetic."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.allocate_state()

    def allocate_state(self) -> None:
        """The moments (zero) and step counts (0), made now, beside the weights: not in the memory the
        first step's activations free (optim.allocate_state says why)."""
        for group in self.param_groups:
            for p in group["params"]:
                if not self.state[p]:
                    self.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=_local(p).device),
                                     "exp_avg": torch.zeros_like(p, dtype=torch.bfloat16),
                                     "exp_avg_sq": torch.zeros_like(p, dtype=torch.bfloat16)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        load_state_keeping_dtypes(self, state_dict)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if any(p.grad is not None and not self.state[p] for p in group["params"]):
                self.allocate_state()  # a parameter added to the group after construction
            step_group(group, self.state)
        return loss


def step_group(group: dict[str, Any], state: Mapping[torch.Tensor, dict[str, Any]]) -> None:
    """One update of the parameters of `group` that have a gradient (its lr, betas, eps and weight_decay),
    each with its `state[p]` (bf16 moments, the step count): AdamWBf16Moments' step, and Muon's for its AdamW
    groups with optimizer.state_dtype = bf16."""
    # Per device, the lists the update takes (weights, gradients, moments, step counts), flattened.
    by_device: dict[torch.device, tuple[list[torch.Tensor], ...]] = {}
    for p in group["params"]:
        if p.grad is None:
            continue
        st = state[p]
        weight = _local(p)
        if weight.numel() == 0:  # an FSDP shard with no rows on this rank: only its count moves
            st["step"] += 1
            continue
        ps, gs, ms, vs, steps = by_device.setdefault(weight.device, ([], [], [], [], []))
        ps.append(weight.view(-1))  # views: the update writes through them
        gs.append(_local(p.grad).reshape(-1))
        ms.append(_local(st["exp_avg"]).view(-1))
        vs.append(_local(st["exp_avg_sq"]).view(-1))
        steps.append(st["step"])
    beta1, beta2 = group["betas"]
    for device, (ps, gs, ms, vs, steps) in by_device.items():
        foreach.add_(steps, 1.0)
        lr = torch.as_tensor(group["lr"], dtype=torch.float32, device=device)
        update = _update_fn(device)
        for i in range(0, len(ps), CHUNK):
            part = slice(i, i + CHUNK)
            update(ps[part], gs[part], ms[part], vs[part], steps[part], lr, beta1, beta2, group["eps"],
                   group["weight_decay"])
