"""The protocol of a model converter: a component that changes the model's modules before the parallelisms
wrap them (float8's Linears, a weight-only cast, another low-precision recipe), and may act after each
optimizer step, keep state in the checkpoint and report a value in every train record.

The trainer builds the run's converters from the config through one registry (titanlike/converters.py) and
speaks to them through this protocol only; the checkpoint holds each one's state under its name, and the
records get what each reports. A new converter is one module that implements it, one registry entry, and
what turns it on in the config (docs/architecture.md, "How to add a converter").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn


class StepCounter(Protocol):
    """The run's counters: `step` is the steps completed (a rollback sets it back)."""

    step: int


@dataclass(frozen=True)
class ConvertArgs:
    """What a converter may read of the run when it converts the model (on the meta device, at the first
    stage, before activation checkpointing, compile and FSDP)."""

    device: torch.device
    """Where the run computes (a converter may check that this device can run what it converts to)."""
    batch: int = 1
    """Sequences a micro-batch holds on one rank."""
    seq_len: int = 1
    """Tokens of each sequence this rank holds (with context parallelism, its part of the window)."""
    flops_per_token: int = 0
    """The model's training FLOPs per token (0: not known; a share of them cannot be reported)."""
    block_sample: Callable[[int, int, torch.device], tuple[nn.Module, tuple[torch.Tensor, ...]]] | None = None
    """A fresh block of the model's shape and its forward's arguments, (batch, seq, device) -> (block, args):
    for timing blocks (model.sample_block)."""
    compiled: bool = False
    """The run compiles its blocks (compile.enable): inductor can run."""


@dataclass(frozen=True)
class StepReport:
    """What a converter measured after a step, for the records: `scalars` to TensorBoard (per layer, say),
    `note` to join the next train record."""

    scalars: dict[str, float]
    note: dict[str, object]


class ModelConverter(Protocol):
    """One model converter. Its state is a checkpoint entry (torch's Stateful protocol); a checkpoint saved
    without it (or with another shape of it) loads as a fresh start: `partial_load`."""

    name: str
    """Its checkpoint entry's name; also how the registry and a start line call it."""
    partial_load: bool

    def convert(self, model: nn.Module, args: ConvertArgs) -> None:
        """Change the model's modules in place (on the meta device), and say what it did (a log line)."""

    def compile_options(self) -> dict[str, object]:
        """Inductor settings the converted blocks need when compiled ({} for none)."""

    def start(self, counters: StepCounter) -> None:
        """The weights are set (initialised, or loaded by a resume): before the first step. `counters.step`
        stays readable for a later load (a rollback sets it back)."""

    def after_step(self, step: int) -> StepReport | None:
        """After the optimizer updated the weights in step `step` (not after a skipped update): the
        converter's own follow-up (scales, histories); what it measured, or None."""

    def record(self) -> dict[str, float]:
        """Values that join every train record after the first (float8_matmul_share)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Its checkpoint state: tensors (saved with DCP), or {} for none."""

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """After the model's weights were loaded (a resume or a rollback): its state, {} where the checkpoint
        had none."""
