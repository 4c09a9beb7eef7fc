"""The run a config means at a world size, resolved once: the model's shape, the data-parallel degrees
and batch plan, the data's sources and phases, and the folders it writes to.

The preflight builds it (no torch) and runs every check on it; the trainer builds the same object and
reads it, rather than each part deriving its own piece from the config again.

    run = resolve_run(load_config(argv), world_size)
    run.model.args, run.dims.accum_steps, run.schedule.phases, run.stages, run.checkpoint_folder
"""

from __future__ import annotations

from dataclasses import dataclass

from titanlike.config.dims import ParallelDims, parallel_dims
from titanlike.config.resolve import ResolvedModel, resolve_model, with_resolved_shape
from titanlike.config.schema import JobConfig, in_dump_folder
from titanlike.config.sources import DataSchedule, schedule_of
from titanlike.config.stages import Stages, resolve_stages


@dataclass(frozen=True)
class ResolvedRun:
    cfg: JobConfig
    """The validated config it was resolved from."""
    model: ResolvedModel
    """The shape (preset or config.json, overrides, the data's vocabulary), its name and the data's dataset.json."""
    dims: ParallelDims
    """The data-parallel degrees at this world size and the batch plan (the same on every rank)."""
    schedule: DataSchedule
    """[data]'s sources and phases, parsed once."""
    stages: Stages
    """The seq_len, RoPE base and batch from each step on (one stage unless data.phase changes them);
    the first is data.seq_len, the shape's rope_theta and the batch plan of `dims`."""
    dump_folder: str
    """job.dump_folder: the run's own folder."""
    checkpoint_folder: str
    """checkpoint.folder, resolved against the dump folder unless absolute."""

    @property
    def builtin_corpus(self) -> bool:
        """Whether the run reads the embedded corpus (no data.path, no data.mix)."""
        return self.schedule.builtin_corpus

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over all ranks."""
        return self.dims.global_batch

    @property
    def accum_steps(self) -> int:
        """Micro-batches per rank per optimizer step."""
        return self.dims.accum_steps

    @property
    def notes(self) -> tuple[str, ...]:
        """Lines the trainer logs once at start: what the resolution derived, and settings that do something
        other than their names suggest."""
        return self.model.notes + tuple(note for note in (warmup_note(self.cfg),) if note)

    def resolved_config(self) -> JobConfig:
        """The config with [model] as resolved: what config.toml records."""
        return with_resolved_shape(self.cfg, self.model)


def resolve_run(cfg: JobConfig, world_size: int) -> ResolvedRun:
    """Everything the config means at this world size that needs no GPU; ConfigError (one line) for a
    world size, batch or shape that does not work. Reads dataset.json files and an hf config.json."""
    dims = parallel_dims(cfg, world_size)
    schedule = schedule_of(cfg.data)
    model = resolve_model(cfg, schedule)
    stages = resolve_stages(cfg, model.args, dims.dp, schedule)
    checkpoints = in_dump_folder(cfg.job.dump_folder, cfg.checkpoint.folder)
    return ResolvedRun(cfg, model, dims, schedule, stages, cfg.job.dump_folder, checkpoints)


def warmup_note(cfg: JobConfig) -> str | None:
    """A warmup as long as the run, or longer: the LR still rises at the last step and never reaches its peak.
    Said, not refused: a short trial run (`--training.steps 5`) with the default warmup of 10 steps is common and
    harmless, while a long run that never leaves its warmup trains at a fraction of the LR without a word."""
    warmup, steps = cfg.lr_scheduler.warmup_steps, cfg.training.steps
    if warmup < steps:
        return None
    return (f"lr_scheduler.warmup_steps = {warmup} is not below training.steps = {steps}: the LR still rises at the "
            f"last step and never reaches optimizer.lr = {cfg.optimizer.lr:g} (no stable or decay phase); set "
            f"--lr_scheduler.warmup_steps below {steps} to train at the peak")
