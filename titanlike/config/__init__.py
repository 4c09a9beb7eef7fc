"""The job configuration: the schema (schema.py, speed.py, fp8.py with the float8 recipes' facts,
optimizer.py with the optimizers'), the rules across sections (rules.py), reading TOML and the command line
(loader.py), the [data] strings (sources.py) and dataset.json (dataset.py), which model shape a config
means (resolve.py), the degrees and batch plan at a world size (dims.py), and the run all of that
resolves to, once (run.py). Plain Python, the root of the package: it imports nothing of titanlike
but model/'s plain shapes and the shared errors and fs modules, and the preflight checks a config
before any worker imports torch.

    cfg = load_config(["--job.config_file", "train_configs/llama3_1b.toml", "--fp8.recipe", "rowwise"])
    run = resolve_run(cfg, world_size)   # titanlike.config.run
"""

from __future__ import annotations

import os

from titanlike.config import loader
from titanlike.config.dims import check_cp_divides
from titanlike.config.loader import ConfigError, field_docs, to_toml
from titanlike.config.rules import validate_across_sections
from titanlike.config.schema import JobConfig
from titanlike.config.sources import SINGLE, DataSchedule
from titanlike.config.stages import Stages

__all__ = ["ConfigError", "JobConfig", "changed_settings", "field_docs", "help_text", "load_config", "resume_note",
           "resumable_settings", "sections", "to_toml", "validate"]

USAGE = "usage: {prog} [--section.key value ...]   (TOML file via --job.config_file)"


def sections() -> dict[str, type]:
    """Each `[section]` name and its dataclass, in the order of JobConfig."""
    return loader.sections_of(JobConfig)


def validate(cfg: JobConfig) -> None:
    """Checks that need no process group and no GPU: each section's, then those across sections.
    World-size checks are the preflight's (titanlike/preflight.py)."""
    for name in sections():
        getattr(cfg, name).validate()
    validate_across_sections(cfg)


def load_config(argv: list[str] | None = None, world: int | None = None) -> JobConfig:
    """Defaults, then the TOML file (job.config_file, from the CLI), then the CLI overrides; validated. With the
    run's `world` size known, a parallel.cp that cannot split it is said first: the window's rules depend on cp
    (not when the config is only printed, which needs no world)."""

    def checked(cfg: JobConfig) -> None:
        cp = cfg.parallel.cp
        if world and not cfg.job.print_config and isinstance(cp, int) and cp >= 1:
            check_cp_divides(world, cp)
        validate(cfg)

    return loader.load(JobConfig, argv, checked, USAGE.format(prog="run_train.sh"))


def help_text(argv: list[str] | None = None, prog: str = "run_train.sh") -> str:
    """--help: every option with the value a run with `argv` would use, its type, default and meaning; the usage
    line names `prog`, the command that was typed (run_train.sh, titanlike-train)."""
    return loader.help_text(JobConfig, USAGE.format(prog=prog), argv)


def resumable_settings(cfg: JobConfig, schedule: DataSchedule, stages: Stages | None = None) -> dict:
    """The settings a resume may change, by option name: a checkpoint records them, and a resume logs
    one line for each that changed; the configured value applies. `schedule`: [data] as the resolved
    run parsed it; `stages`: the stages it resolved to."""
    o, s = cfg.optimizer, cfg.lr_scheduler
    return {**o.settings(), "lr_scheduler.warmup_steps": s.warmup_steps,
            "lr_scheduler.decay_ratio": s.decay_ratio, "lr_scheduler.decay_type": s.decay_type,
            "lr_scheduler.min_lr_factor": s.min_lr_factor, "training.steps": cfg.training.steps,
            "fp8.recipe": cfg.fp8.recipe, "data.schedule": schedule.describe(),
            "model.attn_mask": cfg.model.attn_mask, "data.seq_len": cfg.data.seq_len,
            **({"data.stages": "; ".join(s.describe() for s in stages.stages[1:]) or "none"} if stages else {}),
            **{source_key(s.name): os.path.abspath(s.path) if s.path else "the embedded corpus"
               for s in schedule.sources}}


def source_key(name: str) -> str:
    """How a resume's line names a source's folder: data.path, or `data source NAME` in a mixture."""
    return "data.path" if name == SINGLE else f"data source {name}"


UNRECORDED_SETTINGS = {"optimizer.ns_coefficients": "quintic"}
"""What a run saved before a setting was recorded ran with: Muon's one polynomial before
optimizer.ns_coefficients existed. A resume of such a checkpoint compares against it."""


def changed_settings(before: dict, now: dict) -> list[str]:
    """The lines a resume logs, one for each setting of `now` (this run's resumable_settings) that differs
    from `before` (the checkpoint's record): "key: checkpoint old → config new", and what it means. A key
    the checkpoint does not record is compared with UNRECORDED_SETTINGS, or not at all."""
    lines = []
    for key, value in now.items():
        old = before.get(key, UNRECORDED_SETTINGS.get(key, value))
        if old != value:
            note = resume_note(key).format(now=value)
            lines.append(f"{key}: checkpoint {old} → config {value}" + (f" ({note})" if note else ""))
    return lines


def resume_note(key: str) -> str:
    """What a change of the resumable setting `key` means, for the line a resume logs ("" if nothing
    beyond the new value applying)."""
    if key == "data.seq_len":
        return ("the data position is kept in global batches, which now hold windows of {now} tokens: the run reads "
                "other samples than one at the old length would")
    if key == "data.stages":
        return ("the stage of the saved data position applies, with the configured seq_len, RoPE base and batch; "
                "a stage reads its own global batches from where it begins")
    if key == "data.path" or key.startswith("data source "):
        return "the data position carries over: the run goes on at the same global batch of the new data's order"
    return ""
