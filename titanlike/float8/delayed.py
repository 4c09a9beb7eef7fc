"""Delayed scaling for the tensorwise float8 recipe (fp8.scaling = "delayed").

Dynamic scaling casts each Linear's input, weight and output gradient with a scale from that very
tensor's largest magnitude (amax), so it reads every one of them twice: once for the amax, once for
the cast. Delayed scaling casts with a scale from the last `fp8.amax_history` measured amaxes
(measured on every step, or on every `fp8.amax_every`-th) and measures this step's amax in the same
pass as the cast. What the amax passes cost a tensorwise step, and what this wins back, is in
docs/benchmarks/2026-11-22-delayed-scaling.md. A value beyond a delayed scale's range
saturates at the float8 maximum (the cast clamps), as in Transformer Engine's delayed scaling.
Weights that FSDP all-gathers in float8 arrive cast, with the scales all_gather.precompute_scales
computed from the new weights (dynamic, exact); they are not recorded.

A step, per converted Linear (DelayedFloat8Linear), row r of its `amax_history` and scales:
  forward   cast the input (r=0) and the weight (r=2) with their scales; record their amaxes
  backward  cast the output gradient (r=1) with its scale; record its amax
  after the optimizer step, for all layers at once (update_scales): this step's amaxes, maximised
            over ranks in one all-reduce, enter the history; scale = float8 max / max(history).
A run without history yet (a fresh start, or a checkpoint saved with dynamic scaling) takes its
first step with dynamic scales, recording the amaxes all the same. Recorded amaxes are maxima, so
micro-batches and activation-checkpointing recomputation fold in without changing them. The history
is checkpointed (checkpoint_state): a resumed run scales exactly as an uninterrupted one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torchao.float8.float8_linear import Float8Linear

from titanlike.overrides import foreach
from titanlike.overrides.float8 import amax_to_scale, cast_to_float8, float8_matmul


def _record_max(amax: torch.Tensor, x: torch.Tensor) -> None:
    # Row maxima first, then their maximum: inductor folds a reduction along rows into the kernel
    # that casts the same rows, but runs a reduction over the whole tensor as a pass of its own
    # (timed in docs/benchmarks/2026-11-22-delayed-scaling.md). The maximum is the same either way.
    x = x.detach()
    amax.copy_(torch.maximum(amax, x.abs().amax(dim=-1).max().to(amax.dtype)))


class _GradientCast(torch.autograd.Function):
    """Identity forward; backward records the gradient's amax and, once calibrated, casts it to
    float8 with the delayed scale, so the matmul's backward (torchao) takes it as it is."""

    @staticmethod
    def forward(ctx, y, layer):
        # The layer, not its tensors, rides on ctx: save_for_backward would refuse the in-place
        # update of grad_amax below.
        ctx.layer = layer
        ctx.calibrated, ctx.recording = layer.calibrated, layer.recording
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        layer = ctx.layer
        if ctx.recording:
            _record_max(layer.grad_amax, grad)
        if ctx.calibrated:
            dtype = layer.config.cast_config_grad_output.target_dtype
            grad = cast_to_float8(grad, layer.grad_scale, dtype, layer.linear_mm_config, "GRAD_OUTPUT")
        return grad, None


ROWS = ("input", "grad", "weight")  # the rows of amax_history and of amax / scale


class DelayedFloat8Linear(Float8Linear):
    """torchao's tensorwise Float8Linear with delayed scales for its input, weight and output gradient."""

    def __init__(self, *args, history: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.history = history
        # Python flags, so each combination compiles once: calibrated turns on after a run's first
        # step; recording is on for the steps that measure amaxes (set_recording).
        self.calibrated = False
        self.recording = True
        # Not persistent: the trainer checkpoints the stacked histories of all layers
        # (checkpoint_state below), and model exports never see them.
        for row in ROWS:
            self.register_buffer(f"{row}_amax", torch.zeros((), dtype=torch.float32), persistent=False)
            self.register_buffer(f"{row}_scale", torch.zeros((), dtype=torch.float32), persistent=False)
        self.register_buffer("amax_history", torch.zeros((len(ROWS), history), dtype=torch.float32), persistent=False)

    @classmethod
    def from_linear(cls, linear: Float8Linear, history: int) -> DelayedFloat8Linear:
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False, config=linear.config, history=history)
        new.weight, new.bias = linear.weight, linear.bias
        for name, buf in list(new.named_buffers(recurse=False)):  # where the weight is (meta or not)
            new.register_buffer(name, torch.zeros(buf.shape, device=linear.weight.device), persistent=False)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled():
            x = x.to(torch.get_autocast_gpu_dtype())
        weight = self.weight
        # A weight all-gathered in float8 arrives cast (and its FSDP wrapper, before that, casts
        # itself); only a plain one is ours to scale.
        own_weight = type(weight) in (torch.Tensor, nn.Parameter)
        if self.recording:
            _record_max(self.input_amax, x)
            if own_weight:
                _record_max(self.weight_amax, weight)
        if not self.calibrated:
            return _GradientCast.apply(super().forward(x), self)
        c = self.config
        x = cast_to_float8(x, self.input_scale, c.cast_config_input.target_dtype, self.linear_mm_config, "INPUT")
        if own_weight:
            weight = cast_to_float8(weight, self.weight_scale, c.cast_config_weight.target_dtype,
                                    self.linear_mm_config, "WEIGHT")
        y = float8_matmul(x, weight.t(), self.linear_mm_config, self.config)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return _GradientCast.apply(y, self)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, delayed scaling, amax history of {self.history}"


def convert(model: nn.Module, history: int) -> int:
    """Swap every (tensorwise) Float8Linear for a DelayedFloat8Linear in place; return how many."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is Float8Linear]
    for parent, name, child in swaps:
        setattr(parent, name, DelayedFloat8Linear.from_linear(child, history))
    return len(swaps)


def layers(model: nn.Module) -> list[DelayedFloat8Linear]:
    return [m for m in model.modules() if isinstance(m, DelayedFloat8Linear)]


@torch.no_grad()
def reset(model: nn.Module) -> None:
    """No history: the next step scales dynamically. For a model just materialised (to_empty)."""
    for layer in layers(model):
        for buf in layer.buffers(recurse=False):
            buf.zero_()
        layer.calibrated = False


def set_recording(model: nn.Module, step: int, every: int) -> None:
    """Before training step `step` (from 1): measure amaxes in it if it is one of every `every`-th
    steps (1, 1 + every, ...), or while there is no history yet."""
    for m in layers(model):
        m.recording = not m.calibrated or (step - 1) % every == 0


@torch.no_grad()
def update_scales(model: nn.Module) -> None:
    """After an optimizer step that measured amaxes: those (maximum over ranks) into the history, new scales."""
    found = layers(model)
    if not found or not found[0].recording:
        return
    # One stack for all layers (a stack per layer would be a launch per layer, every step).
    amax = torch.stack([getattr(m, f"{row}_amax") for m in found for row in ROWS]).view(len(found), len(ROWS))
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX)
    # A step whose loss or gradients went non-finite (and was skipped, or is about to be rolled
    # back) leaves no trace: an infinite or NaN amax would scale every later step to nothing.
    amax = torch.where(amax.isfinite(), amax, torch.zeros_like(amax))
    history = torch.stack([m.amax_history for m in found])  # (layers, rows, steps), newest first
    history = torch.cat([amax.unsqueeze(-1), history[..., :-1]], dim=-1)
    _set_history(found, history)


def _set_history(found: list[DelayedFloat8Linear], history: torch.Tensor, calibrated: bool = True) -> None:
    config = found[0].config
    dtypes = {"input": config.cast_config_input.target_dtype, "grad": config.cast_config_grad_output.target_dtype,
              "weight": config.cast_config_weight.target_dtype}
    foreach.copy_([m.amax_history for m in found], list(history.unbind(0)))
    for i, row in enumerate(ROWS):
        scale = amax_to_scale(history[:, i].amax(-1), dtypes[row], config.round_scales_to_power_of_2)
        foreach.copy_([getattr(m, f"{row}_scale") for m in found], list(scale.unbind(0)))
    foreach.zero_([getattr(m, f"{row}_amax") for m in found for row in ROWS])
    for m in found:
        m.calibrated = calibrated


CHECKPOINT_KEY = "float8_amax_history"


def checkpoint_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """For the checkpoint: the amax histories of all layers, (layers, rows, steps), the same on every
    rank; nothing without delayed scaling."""
    found = layers(model)
    return {CHECKPOINT_KEY: torch.stack([m.amax_history for m in found])} if found else {}


@torch.no_grad()
def load_checkpoint_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Apply a loaded checkpoint_state; a checkpoint without one (saved with dynamic scaling, or
    another amax_history) starts the history afresh, with one dynamically scaled step."""
    found = layers(model)
    history = state.get(CHECKPOINT_KEY)
    if not found or history is None or tuple(history.shape) != (len(found), len(ROWS), found[0].history):
        reset(model)
        return
    _set_history(found, history.to(found[0].amax_history.device), calibrated=bool(history.gt(0).any()))
