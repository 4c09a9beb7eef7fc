"""The job configuration: the schema (schema.py, speed.py), reading TOML and the command line
(loader.py), the [data] strings (sources.py) and dataset.json (dataset.py), which model shape a config
means (resolve.py), the degrees and batch plan at a world size (dims.py), and the run all of that
resolves to, once (run.py). Plain Python, the root of the package: it imports nothing of titanlike
but model/'s plain shapes and the shared errors and fs modules, and the preflight checks a config
before any worker imports torch.

    cfg = load_config(["--job.config_file", "train_configs/llama3_1b.toml", "--fp8.recipe", "rowwise"])
    run = resolve_run(cfg, world_size)   # titanlike.config.run
"""

from __future__ import annotations

from titanlike.config import loader
from titanlike.config.loader import ConfigError, field_docs, to_toml
from titanlike.config.schema import JobConfig, validate_across_sections
from titanlike.config.sources import DataSchedule, schedule_of

__all__ = ["ConfigError", "JobConfig", "field_docs", "help_text", "load_config", "resumable_settings", "sections",
           "to_toml", "validate"]

USAGE = "usage: run_train.sh [--section.key value ...]   (TOML file via --job.config_file)"


def sections() -> dict[str, type]:
    """Each `[section]` name and its dataclass, in the order of JobConfig."""
    return loader.sections_of(JobConfig)


def validate(cfg: JobConfig) -> None:
    """Checks that need no process group and no GPU: each section's, then those across sections.
    World-size checks are the preflight's (titanlike/preflight.py)."""
    for name in sections():
        getattr(cfg, name).validate()
    validate_across_sections(cfg)


def load_config(argv: list[str] | None = None) -> JobConfig:
    """Defaults, then the TOML file (job.config_file, from the CLI), then the CLI overrides; validated."""
    return loader.load(JobConfig, argv, validate, USAGE)


def help_text() -> str:
    return loader.help_text(JobConfig, USAGE)


def resumable_settings(cfg: JobConfig, schedule: DataSchedule | None = None) -> dict:
    """The settings a resume may change, by option name: a checkpoint records them, and a resume logs
    one line for each that changed; the configured value applies. `schedule`: [data] as already parsed
    (the resolved run's; else parsed here)."""
    o, s = cfg.optimizer, cfg.lr_scheduler
    schedule = schedule_of(cfg.data) if schedule is None else schedule
    return {"optimizer.lr": o.lr, "optimizer.weight_decay": o.weight_decay, "optimizer.betas": list(o.betas),
            "optimizer.eps": o.eps, "lr_scheduler.warmup_steps": s.warmup_steps,
            "lr_scheduler.decay_ratio": s.decay_ratio, "lr_scheduler.decay_type": s.decay_type,
            "lr_scheduler.min_lr_factor": s.min_lr_factor, "training.steps": cfg.training.steps,
            "fp8.recipe": cfg.fp8.recipe, "data.schedule": schedule.describe(),
            "model.attn_mask": cfg.model.attn_mask}
