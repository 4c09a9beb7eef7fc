"""Float8 training through torchao, as one model converter (model/converter.py's protocol):

    float8 = Float8Converter.from_config(cfg.fp8, dp_shard, log_freq)   options from [fp8] and the degree
    float8.convert(model, ConvertArgs(device=..., ...))   on the meta model, before activation checkpointing,
                                                     compile and FSDP: checks that this device can run the
                                                     recipe (one line if not), times whole blocks if
                                                     fp8.auto_filter = measure (measure.py), swaps the chosen
                                                     Linears for torchao's Float8Linear (layers.py) or
                                                     DelayedFloat8Linear (delayed.py), logs what it did
    float8.compile_options()                         what torch.compile needs for the converted blocks
    float8.start(counters)                           once the weights are set (initialised or loaded)
    float8.after_step(step)                          after each optimizer update: delayed scaling's history,
                                                     the weights' scales for the next float8 all-gather,
                                                     weight health every few log steps (returned, for the
                                                     records)
    float8.record()                                  float8_matmul_share, for every train record

Its state, in the checkpoint under "float8", is delayed scaling's amax history, and loading it (a resume or
a rollback) recomputes the all-gather scales from the loaded weights, after them, never before. What each
recipe is (its all-gather, its matmuls' dtypes, what it needs of a GPU) is config/fp8.py's RECIPES; nothing
outside this package needs to know which of these steps do work for a recipe.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from titanlike import overrides
from titanlike.config.fp8 import Fp8
from titanlike.float8 import all_gather, health, layers, measure
from titanlike.float8.health import health_summary, weight_health
from titanlike.float8.layers import Float8Report
from titanlike.float8.options import Float8Options, inductor_options
from titanlike.model.converter import ConvertArgs, StepCounter, StepReport

logger = logging.getLogger("titanlike")

__all__ = ["Float8Converter", "Float8Options", "Float8Report", "health_summary", "inductor_options", "weight_health"]


class Float8Converter:
    """The float8 side of one run: frozen options in, the model converted, what follows each update."""

    name = "float8"
    # Its checkpoint entries may be absent (saved with dynamic scaling, or with float8 off) or shaped
    # otherwise (another amax_history): then delayed scaling starts afresh (see load_state_dict).
    partial_load = True

    def __init__(self, options: Float8Options, log_freq: int = 1):
        """`log_freq`: metrics.log_freq (weight health every log_freq × fp8.health_log_freq steps)."""
        self.options = options
        self.health_every = log_freq * options.health_log_freq
        self.report = Float8Report()
        self.model: nn.Module | None = None
        self._counters: StepCounter | None = None
        self._loaded = False
        # The delayed-scaling module when fp8.scaling = delayed, else None; imported only then, as
        # it imports torchao at once.
        self._delayed = None
        self.notes: list[str] = []  # what convert() says beside its report
        if self.options.delayed and not overrides.active("delayed_scaling"):
            why = overrides.probe("delayed_scaling") or "parallel.overrides leaves it off"
            self.notes.append(f"fp8.scaling = delayed runs as dynamic: delayed scaling builds on torchao internals, "
                              f"off here ({why})")
            self.options = dataclasses.replace(self.options, scaling="dynamic")
        if self.options.delayed:
            from titanlike.float8 import delayed

            self._delayed = delayed

    @classmethod
    def from_config(cls, fp8_cfg: Fp8, dp_shard: int, log_freq: int = 1) -> Float8Converter:
        """`dp_shard`: the ranks FSDP shards weights over (dp_shard × cp)."""
        return cls(Float8Options.from_config(fp8_cfg, dp_shard), log_freq)

    @property
    def enabled(self) -> bool:
        return self.options.enabled

    def convert(self, model: nn.Module, args: ConvertArgs) -> None:
        """Convert the chosen Linears of `model` in place and log what converted and why not (with the
        share of the args' `flops_per_token` that runs in float8); `self.report` says it. `block_sample`
        gives a fresh block and its forward's arguments, for timing blocks when fp8.auto_filter = measure
        (micro-batches of `batch` sequences of `seq_len`). `compiled`: the run compiles (compile.enable),
        so inductor can run, and the float8 all-gather's weight cast may be compiled too."""
        layers.check_device(self.options, args.device)
        self.model = model
        plan = measure.measure(model, self.options, args.batch, args.seq_len, args.device, args.block_sample)
        self.report = layers.convert(model, self.options, plan)
        if self.options.fsdp_float8_all_gather:
            all_gather.use_fused_cast(args.compiled and overrides.active("fused_float8_weight_cast"))
        if self._delayed:
            self._delayed.convert(model, self.options.amax_history)
        if args.flops_per_token:
            self.report.matmul_share = layers.float8_matmul_share(model, args.flops_per_token, self.options.recipe)
        layers.log_report(self.options, self.report)
        for note in self.notes:
            logger.info(note)

    def compile_options(self) -> dict[str, object]:
        """What float8 needs from torch.compile, when compile.enable is on (and only then: a run
        without compile may be one where inductor cannot run): the inductor options for compiling the
        converted blocks."""
        return inductor_options(self.options.recipe) if self.enabled else {}

    def start(self, counters: StepCounter) -> None:
        """Once the weights are set (initialised, or loaded by a resume): delayed scaling's history (fresh
        unless loaded), the all-gather's scales and the first step's recording follow them. `counters.step`
        counts the steps completed (the run's counters, which a rollback sets back)."""
        if not self.enabled or self.model is None:
            return
        self._counters = counters
        if self._delayed and not self._loaded:
            self._delayed.reset(self.model)  # materialised just now: no history yet
        self._after_weights_set()

    def after_step(self, step: int) -> StepReport | None:
        """After the update of step `step`: delayed scaling's amaxes into its history, the next all-gather's
        scales; every metrics.log_freq × fp8.health_log_freq steps the weights' health, returned."""
        model = self.model
        if not self.enabled or model is None or self._counters is None:
            return None
        if self._delayed:
            # Its amaxes into the history (one all-reduce for all layers); the next step measures or not.
            self._delayed.update_scales(model)
            self._delayed.set_recording(model, step + 1, self.options.amax_every)
        if self.options.precompute_scales:
            all_gather.precompute_scales(model)  # one all-reduce for every weight's scale
        if not (self.health_every and step % self.health_every == 0):
            return None
        values = health.weight_health(model)  # a collective: every rank runs it at the same steps
        return StepReport(scalars={f"fp8/{name}/{key}": v for name, h in values.items() for key, v in h.items()},
                          note=health_summary(values))

    def record(self) -> dict[str, float]:
        """What every train record carries of float8: the share of the matmul FLOPs that run in it."""
        return {"float8_matmul_share": self.report.matmul_share}

    def _after_weights_set(self) -> None:
        """The weights were initialised, loaded or rolled back: the all-gather's scales follow them, and
        the next step's delayed recording is set for its place in the schedule."""
        assert self.model is not None
        if self.options.precompute_scales:
            all_gather.precompute_scales(self.model)
        if self._delayed and self._counters is not None:
            self._delayed.set_recording(self.model, self._counters.step + 1, self.options.amax_every)

    # ---- the checkpoint (torch's Stateful protocol) -------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Delayed scaling's amax history under `float8_amax_history`; nothing otherwise."""
        return self._delayed.checkpoint_state(self.model) if self._delayed and self.model is not None else {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """After the model's weights were loaded: the history (or a fresh start without one), then the
        scales from the loaded weights."""
        if not self.enabled or self.model is None:
            return
        if self._delayed:
            self._delayed.load_checkpoint_state(self.model, state)
        self._loaded = True
        self._after_weights_set()
