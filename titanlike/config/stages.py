"""Training stages: from a step on, a run may read longer samples (data.seq_len), rotate positions with
another RoPE base (model.rope_theta) and use another batch (training.local_batch_size,
training.global_batch_size), as Llama-style pretraining ends with a long-context stage. A
[[data.phase]] item that sets any of these (config/sources.py STAGE_KEYS) starts a stage; what it
leaves unset carries over from the stage before. The first stage is the config's own values.

Plain Python: the schema checks what needs no world size (`check_stages`), the resolved run
(run.py) resolves them once at its world size (`resolve_stages`), and the trainer, the data and the
checkpoint read them. A stage is placed by the data position: stage k holds the global batches
[from_step - 1, next stage's from_step - 1), so in a run without rollbacks it starts at its step,
and a resume at any step finds the same stage from the checkpoint's data position alone.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any

from titanlike.config.loader import ConfigError
from titanlike.config.schema import JobConfig
from titanlike.config.sources import DataSchedule
from titanlike.model.shape import SHAPE_LIMITS, ModelArgs

MIN_SEQ_LEN = 8


@dataclass(frozen=True)
class Stage:
    start_step: int
    """The first step that reads this stage's batches (1 for the first stage)."""
    seq_len: int
    rope_theta: float
    local_batch: int
    global_batch: int
    accum_steps: int
    """Micro-batches per rank per optimizer step at this world size."""

    @property
    def first_batch(self) -> int:
        """The first global batch (numbered from 0) of the stage."""
        return self.start_step - 1

    @property
    def tokens_per_step(self) -> int:
        """Input tokens of one global batch (seq_len a sample)."""
        return self.global_batch * self.seq_len

    def describe(self) -> str:
        return (f"from step {self.start_step}: seq_len {self.seq_len}, rope_theta {self.rope_theta:g}, "
                f"global batch {self.global_batch} ({self.local_batch} a micro-batch, {self.accum_steps} "
                f"micro-batch{'es' if self.accum_steps != 1 else ''} a rank)")


@dataclass(frozen=True)
class Stages:
    """A run's stages in step order (one when [data] changes none of STAGE_KEYS)."""

    stages: tuple[Stage, ...]

    def __len__(self) -> int:
        return len(self.stages)

    def __getitem__(self, index: int) -> Stage:
        return self.stages[index]

    def index_at_batch(self, batches_read: int) -> int:
        """The stage of the global batch read after `batches_read` batches."""
        return max(i for i, s in enumerate(self.stages) if s.first_batch <= batches_read)

    def at_batch(self, batches_read: int) -> Stage:
        return self.stages[self.index_at_batch(batches_read)]

    @property
    def longest(self) -> int:
        return max(s.seq_len for s in self.stages)

    def describe(self) -> str:
        """The table in one line, as a resume compares it with the checkpoint's."""
        return "; ".join(s.describe() for s in self.stages)

    def args_after(self, args: ModelArgs, batches_read: int) -> ModelArgs:
        """The model's shape once `batches_read` global batches have trained it: its RoPE base is that of
        the stage of the last of them (a checkpoint's model_args.json; an export reads it from there)."""
        return replace(args, rope_theta=self.at_batch(max(0, batches_read - 1)).rope_theta)


def _settings(cfg: JobConfig, schedule: DataSchedule) -> list[tuple[int, dict[str, Any]]]:
    """(first step, every STAGE_KEYS value in force) of each stage, from the config's own values on;
    `schedule`: [data]'s, parsed (its stage changes)."""
    current: dict[str, Any] = {"seq_len": cfg.data.seq_len, "rope_theta": None,
                               "local_batch_size": cfg.training.local_batch_size,
                               "global_batch_size": cfg.training.global_batch_size}
    out = [(1, dict(current))]
    for step, changes in schedule.stage_changes:
        current.update(changes)
        out.append((step, dict(current)))
    return out


def stage_seq_lens(cfg: JobConfig, schedule: DataSchedule) -> list[tuple[str, int]]:
    """(option, seq_len) of every stage: data.seq_len, then each stage's of data.phase."""
    return [(_seq_len_option(step), s["seq_len"]) for step, s in _settings(cfg, schedule)]


def _seq_len_option(step: int) -> str:
    return "data.seq_len" if step == 1 else f"data.phase: the stage from step {step}: seq_len"


# A later stage as Stage.describe writes it into a checkpoint's run settings ("data.stages").
_DESCRIBED = re.compile(r"from step (\d+): seq_len (\d+)")


def trained_window(settings: object, step: int) -> int | None:
    """The longest window a checkpoint's weights trained on by its `step`, from the settings its run records
    (config.resumable_settings: data.seq_len, and data.stages as Stage.describe wrote the later stages); a stage
    that starts after `step` has not trained them. None where the settings say no seq_len."""
    first = settings.get("data.seq_len") if isinstance(settings, dict) else None
    if isinstance(first, bool) or not isinstance(first, int) or first < 1:
        return None
    later = settings.get("data.stages") if isinstance(settings, dict) else None
    return max([first, *(int(n) for start, n in _DESCRIBED.findall(later if isinstance(later, str) else "")
                          if int(start) <= step)])


def check_stages(cfg: JobConfig, max_seq_len: int | None, schedule: DataSchedule) -> None:
    """The rules a stage table must keep at any world size; `max_seq_len`: the model's (None for an hf
    shape, checked once its config.json is read). ConfigError (one line) naming the stage. The one place
    that holds every stage's samples, the first's included, to the model's limit."""
    steps, settings = cfg.training.steps, _settings(cfg, schedule)
    for step, s in settings:
        if s["seq_len"] > SHAPE_LIMITS["max_seq_len"]:
            raise ConfigError(f"{_seq_len_option(step)} = {s['seq_len']} is more than titanlike's models take: at most "
                              f"{SHAPE_LIMITS['max_seq_len']:,} tokens")
        if max_seq_len is not None and s["seq_len"] > max_seq_len:
            raise ConfigError(f"{_seq_len_option(step)} = {s['seq_len']} exceeds model.max_seq_len = {max_seq_len}: "
                              f"set --model.max_seq_len {s['seq_len']} or more (it is the model's limit, which an "
                              f"export's max_position_embeddings never passes, and is not raised for you)")
    for step, s in settings[1:]:
        where = f"data.phase: the stage from step {step}"
        if not 1 < step <= steps:
            raise ConfigError(f"{where} must start in [2, training.steps = {steps}] (the first stage applies from "
                              f"step 1; one past the last step is never read)")
        if s["seq_len"] < MIN_SEQ_LEN:
            raise ConfigError(f"{where}: seq_len = {s['seq_len']} must be at least {MIN_SEQ_LEN}")
        theta = s["rope_theta"]
        if theta is not None and not (math.isfinite(theta) and theta > 0):
            raise ConfigError(f"{where}: rope_theta = {theta} must be a finite number > 0")
        local, glob = s["local_batch_size"], s["global_batch_size"]
        if local < 1 or glob < 0:
            raise ConfigError(f"{where}: local_batch_size = {local} must be >= 1 and global_batch_size = {glob} "
                              f">= 0 (0 = local × DP)")
        if glob and glob % local:
            raise ConfigError(f"{where}: global_batch_size = {glob} must be a multiple of local_batch_size = {local} "
                              f"(× the data-parallel degree)")


def resolve_stages(cfg: JobConfig, args: ModelArgs, dp: int, schedule: DataSchedule) -> Stages:
    """The stages at `dp` data-parallel ranks, for the model shape `args` and [data]'s parsed `schedule`;
    ConfigError (one line) for a stage whose batch does not split over the ranks or whose samples exceed
    the model's limit."""
    check_stages(cfg, args.max_seq_len, schedule)
    out: list[Stage] = []
    for step, s in _settings(cfg, schedule):
        local = s["local_batch_size"]
        glob = s["global_batch_size"] or local * dp
        if glob % (local * dp):
            raise ConfigError(
                f"data.phase: the stage from step {step} has a global batch of {glob}, not a multiple of "
                f"local_batch_size × data-parallel degree = {local} × {dp} = {local * dp}")
        theta = s["rope_theta"] if s["rope_theta"] is not None else (out[-1].rope_theta if out else args.rope_theta)
        out.append(Stage(step, s["seq_len"], float(theta), local, glob, glob // (local * dp)))
    return Stages(tuple(out))
