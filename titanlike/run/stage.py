"""The run's stage, owned in one place: its seq_len, RoPE base and batch (config/stages.py), and the
numbers that follow from them: FLOPs per token (behind MFU), tokens per step (behind the progress
line's rate) and a rank's tokens per step. The trainer reads these only from here.

The model is built with the first stage (its rotary tables, float8's sample shapes). Before each step
the trainer asks for the stage of the next global batch (`enter`); only when it differs from the one
the model has (a long-context stage begins, or a resume lands in a later stage) does this switch the
model's rotary tables and hand the new stage back, for the trainer to tell metrics and progress. The
loader switches its own windows (data/loader.py) from the same data position, so the two agree by
construction, on a fresh run, a resume and a rollback alike.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from titanlike.config.stages import Stage, Stages

logger = logging.getLogger("titanlike")


class RotaryModel(Protocol):
    """What a stage switch needs of the model: rotary tables for a length and a base."""

    def init_rope(self, seq_len: int, theta: float | None = None) -> None: ...


@dataclass(frozen=True)
class RunStage:
    """One stage and the numbers that follow from it at this run's context-parallel degree."""

    index: int
    """0 for the first stage."""
    stage: Stage
    flops_per_token: int
    """Training FLOPs per token at this seq_len (model/shape.py): MFU's numerator."""
    cp: int
    """Context-parallel degree: each rank holds seq_len / cp tokens of every sample."""

    @property
    def seq_len(self) -> int:
        return self.stage.seq_len

    @property
    def rope_theta(self) -> float:
        return self.stage.rope_theta

    @property
    def local_batch(self) -> int:
        return self.stage.local_batch

    @property
    def global_batch(self) -> int:
        return self.stage.global_batch

    @property
    def accum_steps(self) -> int:
        return self.stage.accum_steps

    @property
    def tokens_per_step(self) -> int:
        """Input tokens of one global batch, over all ranks."""
        return self.stage.tokens_per_step

    @property
    def rank_seq_len(self) -> int:
        """The tokens of each sample one rank holds (its part, with context parallelism)."""
        return self.seq_len // self.cp

    @property
    def rank_tokens_per_step(self) -> int:
        """This rank's input tokens of one step: its micro-batches, its part of each sample."""
        return self.accum_steps * self.local_batch * self.rank_seq_len


class RunStages:
    """The run's stages, the one the model has, and the switch to the next."""

    def __init__(self, stages: Stages, *, flops_per_token: Callable[[int], int], cp: int, compiled: bool,
                 is_main: bool):
        """`flops_per_token(seq_len)`: the model's, at that length; `compiled`: the blocks recompile at a
        switch (said in its line)."""
        self.stages, self.flops_per_token, self.cp = stages, flops_per_token, cp
        self.compiled, self.is_main = compiled, is_main
        self.first = self._numbers(0)
        """The stage the model is built with."""
        self.current = self.first
        self._entered = False
        if is_main and len(stages) > 1:
            logger.info(f"{len(stages)} stages: {stages.describe()}")

    def _numbers(self, index: int) -> RunStage:
        stage = self.stages[index]
        return RunStage(index, stage, self.flops_per_token(stage.seq_len), self.cp)

    def enter(self, batches_read: int, model: RotaryModel) -> RunStage | None:
        """Before a step: the stage of the global batch after `batches_read`. Returns it when it is another
        than the model's (the model's rotary tables are switched to it), else None."""
        index = self.stages.index_at_batch(batches_read)
        self._entered = True
        if index == self.current.index:
            return None
        self.current = self._numbers(index)
        model.init_rope(self.current.seq_len, self.current.rope_theta)
        if self.is_main:
            recompile = " (the compiled blocks recompile for the new shapes at this step)" if self.compiled else ""
            logger.info(f"stage {index + 1} of {len(self.stages)} {self.current.stage.describe()}{recompile}")
        return self.current

    def record(self) -> dict[str, int]:
        """What a metrics record says of the stage: its seq_len and number, with more than one stage."""
        if len(self.stages) == 1 or not self._entered:
            return {}
        return {"seq_len": self.current.seq_len, "stage": self.current.index + 1}
