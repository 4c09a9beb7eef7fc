"""The run's stage as training reaches it: a long-context stage (config/stages.py) reads longer samples,
rotates with another RoPE base and steps with another batch from a step on. The trainer asks for the
stage of the next global batch before each step (`enter`); when it changes, this switches what
depends on it: the model's rotary tables, the FLOPs per token behind MFU and the tokens per step
behind the progress line's rate. The loader switches its own windows (data/loader.py), from the same
data position, so the two agree by construction, on a fresh run, a resume and a rollback alike.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from titanlike.config.stages import Stage, Stages

logger = logging.getLogger("titanlike")


class StageSwitch:
    def __init__(self, stages: Stages, *, model: Any, metrics: Any, progress: Any,
                 flops_per_token: Callable[[int], int], compiled: bool, is_main: bool):
        """`model`: has init_rope(seq_len, theta); `metrics`: its flops_per_token and start_window();
        `progress`: its tokens_per_step; `flops_per_token(seq_len)`: the model's, at that length."""
        self.stages, self.model, self.metrics, self.progress = stages, model, metrics, progress
        self.flops_per_token, self.compiled, self.is_main = flops_per_token, compiled, is_main
        self.index: int | None = None
        if is_main and len(stages) > 1:
            logger.info(f"{len(stages)} stages: {stages.describe()}")

    def enter(self, batches_read: int) -> Stage:
        """The stage of the global batch after `batches_read`; switched to, if it is another than the last
        step's (or the first call: a resume may start in any stage)."""
        index = self.stages.index_at_batch(batches_read)
        stage = self.stages[index]
        if index == self.index:
            return stage
        first, self.index = self.index is None, index
        self.model.init_rope(stage.seq_len, stage.rope_theta)
        self.metrics.flops_per_token = self.flops_per_token(stage.seq_len)
        self.progress.tokens_per_step = stage.tokens_per_step
        if not first:
            self.metrics.start_window()  # tokens/s and MFU over one stage's steps, never a mix of two
        if self.is_main and (index or not first):
            recompile = " (the compiled blocks recompile for the new shapes at this step)" if self.compiled else ""
            logger.info(f"stage {index + 1} of {len(self.stages)} {stage.describe()}{recompile}")
        return stage

    def record(self) -> dict[str, int]:
        """What a metrics record says of the stage: its seq_len and number, with more than one stage."""
        if len(self.stages) == 1 or self.index is None:
            return {}
        return {"seq_len": self.stages[self.index].seq_len, "stage": self.index + 1}
