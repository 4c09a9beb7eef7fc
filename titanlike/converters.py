"""The run's model converters (model/converter.py's protocol), built from the config through one registry,
and the few calls the trainer makes of them together:

    converters = build_converters(run)            each registry entry's converter for this run, in order
    converters.convert(model, ConvertArgs(...))   on the meta model, before the parallelisms
    converters.compile_options()                  the inductor settings the converted blocks need
    converters.attach(optimizer, counters=, metrics=)   once the weights are set: each converter's start,
                                                  and one hook after each optimizer update (its after_step,
                                                  what it measured to the records)
    converters.states                             name -> converter: the checkpoint's entries (SavedParts)
    converters.record()                           what joins every train record (MetricsLogger)

Which converters run is each one's own section of the config: an entry's builder returns None where the
run does not use it. float8 is always built: with fp8.recipe = none it converts nothing and reports a share
of 0, as the records always carried. There is no list key (a `model.converters = [...]`): fp8.recipe already
says on or off, a second switch for the same thing would need a rule for when the two disagree, and every
config and checkpoint record (fp8.recipe) stays as it was. The order of conversion is CONVERTERS' order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from titanlike.config.run import ResolvedRun
from titanlike.float8 import Float8Converter
from titanlike.model.converter import ConvertArgs, ModelConverter, StepCounter

Builder = Callable[[ResolvedRun], ModelConverter | None]

CONVERTERS: dict[str, Builder] = {
    "float8": lambda run: Float8Converter.from_config(run.cfg.fp8, run.dims.fsdp_shard, run.cfg.metrics.log_freq),
}
"""Each converter's builder, by name (its checkpoint entry's), in the order they convert: the resolved run
-> its converter, or None where the run does not use it."""


class MetricsSink(Protocol):
    """Where what a converter measured after a step goes: scalars to TensorBoard, a note to the next record."""

    def scalars(self, step: int, values: dict[str, float]) -> None: ...

    def note(self, values: dict[str, object]) -> None: ...


def build_converters(run: ResolvedRun) -> ModelConverters:
    """The run's converters: each registry entry's, where its builder returns one."""
    built = (build(run) for build in CONVERTERS.values())
    return ModelConverters([c for c in built if c is not None])


class ModelConverters:
    """The run's converters, called together, in order."""

    def __init__(self, converters: list[ModelConverter]):
        names = [c.name for c in converters]
        assert len(set(names)) == len(names), f"two converters share a checkpoint entry: {names}"
        self.converters = converters

    @property
    def states(self) -> dict[str, ModelConverter]:
        """Each converter by name: its state is the checkpoint's entry of that name."""
        return {c.name: c for c in self.converters}

    def convert(self, model: nn.Module, args: ConvertArgs) -> None:
        for converter in self.converters:
            converter.convert(model, args)

    def compile_options(self) -> dict[str, object]:
        """The inductor settings every converter's blocks need, together (a later converter's win a clash)."""
        options: dict[str, object] = {}
        for converter in self.converters:
            options.update(converter.compile_options())
        return options

    def attach(self, optimizer: torch.optim.Optimizer, *, counters: StepCounter, metrics: MetricsSink) -> None:
        """Once the weights are set (initialised, or loaded): each converter starts, and after each update (a
        hook on the optimizer: a skipped update runs none) each one's after_step, with the step that just
        updated (`counters.step` + 1: the counters move on after the update); what it reports goes to
        `metrics`."""
        for converter in self.converters:
            converter.start(counters)
        if not self.converters:
            return

        def after_update(opt: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            step = counters.step + 1
            for converter in self.converters:
                report = converter.after_step(step)
                if report is not None:
                    metrics.scalars(step, report.scalars)
                    metrics.note(report.note)

        optimizer.register_step_post_hook(after_update)

    def record(self) -> dict[str, float]:
        """What every train record carries of the converters."""
        return {key: value for converter in self.converters for key, value in converter.record().items()}
