"""Float8 training through torchao, as one component the trainer holds: Float8Training.

The trainer calls it at a handful of moments of a run, in this order:

  Float8Training.from_config  resolve the options (options.py) from [fp8] and the data-parallel degree
  check_device          before any real work, one tiny float8 matmul on the actual device, so a GPU
                        that cannot run the recipe stops the run with one line, not a kernel error
  convert               on the meta model, before activation checkpointing, compile and FSDP: time
                        whole blocks if fp8.auto_filter = measure (measure.py), swap the chosen
                        Linears for torchao's Float8Linear (layers.py), with fp8.scaling = delayed
                        for DelayedFloat8Linear (delayed.py)
  compile_options       what torch.compile needs for the converted blocks; installs the fused
                        all-gather cast (all_gather.py)
  after_materialize     the model has memory: delayed scaling starts without history
  after_load            the weights were initialised, loaded or rolled back: the float8 all-gather
                        scales follow them
  before_step / after_optimizer_step
                        around each step: whether delayed scaling measures amaxes in it; then its
                        amaxes into the history and the weights' scales for the next all-gather
  state_dict / load_state_dict
                        what a checkpoint holds of float8 (delayed scaling's amax history)
  health                every few log steps, the weight casts' saturation and underflow (health.py)

Nothing outside this package needs to know which of these do work for a given recipe.
"""

from __future__ import annotations

import torch
from torch import nn

from titanlike.float8 import all_gather, health, layers, measure
from titanlike.float8.health import health_summary, weight_health
from titanlike.float8.layers import Float8Report
from titanlike.float8.options import Float8Options, inductor_options

__all__ = ["Float8Options", "Float8Report", "Float8Training", "health_summary", "inductor_options", "weight_health"]


class Float8Training:
    """The float8 side of one run: frozen options in, a report of what was converted, and the
    hooks the trainer calls. One object per run; it keeps the model it converted."""

    def __init__(self, options: Float8Options):
        self.options = options
        self.report = Float8Report()
        self.model: nn.Module | None = None
        # The delayed-scaling module when fp8.scaling = delayed, else None; imported only then, as
        # it imports torchao at once.
        self._delayed = None
        if options.delayed:
            from titanlike.float8 import delayed

            self._delayed = delayed

    @classmethod
    def from_config(cls, fp8_cfg, dp_shard: int) -> Float8Training:
        return cls(Float8Options.from_config(fp8_cfg, dp_shard))

    @property
    def enabled(self) -> bool:
        return self.options.enabled

    # ---- building the model ------------------------------------------------------------------------

    def check_device(self, device: torch.device) -> None:
        """Stop with one line if this device cannot run the recipe (layers.check_device)."""
        layers.check_device(self.options, device)

    def convert(self, model: nn.Module, tokens: int, device: torch.device, seq_len: int = 0) -> Float8Report:
        """Convert the chosen Linears of `model` in place (`tokens` per micro-batch of sequences of
        `seq_len`, for timing blocks when fp8.auto_filter = measure); returns, and keeps, the report."""
        self.model = model
        plan = measure.measure(model, self.options, tokens, device, seq_len)
        self.report = layers.convert(model, self.options, plan)
        if self._delayed:
            self._delayed.convert(model, self.options.amax_history)
        return self.report

    def compile_options(self) -> dict[str, object]:
        """What float8 needs from torch.compile, when compile.enable is on (and only then: a run
        without compile may be one where inductor cannot run): installs the fused all-gather cast
        and returns the inductor options for compiling the converted blocks."""
        if self.options.fsdp_float8_all_gather:
            all_gather.fuse_all_gather_cast()
        return inductor_options(self.options.recipe) if self.enabled else {}

    def matmul_share(self, flops_per_token: int) -> float:
        """Share of the model's training matmul FLOPs that run in float8."""
        return layers.float8_matmul_share(self.model, flops_per_token) if self.model is not None else 0.0

    def log(self, share: float) -> None:
        """The start-up lines: what converted, what did not and why."""
        layers.log_report(self.options, self.report, share)

    def after_materialize(self) -> None:
        """Once the model has memory (to_empty): delayed scaling starts without history."""
        if self._delayed:
            self._delayed.reset(self.model)

    def after_load(self) -> None:
        """Once the weights are set other than by a training step (initialised, loaded from a
        checkpoint, rolled back): the float8 all-gather's weight scales follow them, never earlier."""
        if self.options.precompute_scales:
            assert self.model is not None, "after_load() follows convert()"
            all_gather.precompute_scales(self.model)

    # ---- each training step ------------------------------------------------------------------------

    def before_step(self, step: int) -> None:
        """Before training step `step` (from 1): whether delayed scaling measures amaxes in it (fp8.amax_every)."""
        if self._delayed:
            self._delayed.set_recording(self.model, step, self.options.amax_every)

    def after_optimizer_step(self) -> None:
        """After each step's update: its amaxes into delayed scaling's history (one all-reduce for
        all layers), then all weights' scales for the next float8 all-gather (one all-reduce)."""
        if self._delayed:
            self._delayed.update_scales(self.model)
        self.after_load()

    # ---- the checkpoint ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """What float8 adds to a checkpoint (torch's Stateful protocol): delayed scaling's amax
        history under its own top-level key, `float8_amax_history` (the key checkpoints have always
        used); nothing otherwise. Its tensors are also the buffers a checkpoint load fills."""
        return self._delayed.checkpoint_state(self.model) if self._delayed else {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Apply what a checkpoint held of state_dict(); a key it lacked (a checkpoint saved with
        dynamic scaling, or another amax_history) starts the history afresh."""
        if self._delayed:
            self._delayed.load_checkpoint_state(self.model, state)

    # ---- health ------------------------------------------------------------------------------------

    def health(self, step: int, log_freq: int) -> dict[str, dict[str, float]]:
        """Every log_freq × fp8.health_log_freq steps, each float8 layer's weight-cast health
        (health.weight_health; {} at other steps). A collective: every rank calls it at the same steps."""
        every = log_freq * self.options.health_log_freq
        if not (self.enabled and every and step % every == 0 and self.model is not None):
            return {}
        return health.weight_health(self.model)
