"""The preflight: everything about a run that can be checked without torch, before any worker starts.

`run_train.sh` runs `python -m titanlike.preflight` with the world size it is about to launch
(TITANLIKE_PREFLIGHT_WORLD) and starts torchrun only if it exits 0; so a mistyped option, an
impossible batch, a shape that cannot be built, a wrong data file or a folder in use costs a fraction
of a second and one `error:` line (exit 2), not a queue slot. It imports no torch (nor numpy, which
only the data check loads): the config schema, the model shapes and the file checks are plain Python.

    exit 0   the config is fine: the launcher goes on
    exit 2   one `error:` line on stderr
    exit 3   printed what was asked (--help, --job.print_config): the launcher stops there
"""

from __future__ import annotations

import dataclasses
import os
import sys

from titanlike.config import JobConfig, help_text, load_config, to_toml
from titanlike.config.resolve import resolve_model, with_resolved_shape
from titanlike.config.run import ResolvedRun, resolve_run
from titanlike.errors import UserError, error_exit
from titanlike.plan.fit import fitted, out_of_reach, usable_gib

PRINTED = 3
WORLD_ENV = "TITANLIKE_PREFLIGHT_WORLD"
LOCAL_ENV = "TITANLIKE_PREFLIGHT_LOCAL"


def resolved(cfg: JobConfig) -> JobConfig:
    """The config as the run will use it: [model] with the shape it resolves to (the preset's or the
    data's values where the config leaves them unset), for --job.print_config, which needs no world
    size (a resolved run's own is ResolvedRun.resolved_config()). Printed with `print_config = false`: the
    request to print is the command line's, and a saved copy of the output is a config that trains."""
    from titanlike import overrides

    overrides.chosen_names(cfg.parallel.overrides)  # a printed config trains: the names the run would refuse
    cfg = dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, print_config=False))
    return with_resolved_shape(cfg, resolve_model(cfg))


def check(cfg: JobConfig, world_size: int) -> ResolvedRun:
    """The checks that need the world size but no GPU; returns the resolved run (degrees, batch plan,
    shape, sources, folders) they were made on."""
    from titanlike import overrides
    from titanlike.config.host import runs_on_cpu
    from titanlike.data.recorded import check_against_record
    from titanlike.data.shards import open_shards
    from titanlike.plan.estimate import cpu_host_problem

    overrides.chosen_names(cfg.parallel.overrides)  # names it knows (the probes need torch: the trainer's)
    run = resolve_run(cfg, world_size)  # reads dataset.json / an hf config.json: a bad shape stops here
    if runs_on_cpu(cfg.training.device):  # a GPU config on a machine without a GPU: the model in host memory
        problem = cpu_host_problem(cfg, world_size, local_processes(world_size), run.model.args)
        if problem:
            raise UserError(problem)
    info = run.model.dataset  # data.path's dataset.json, or the one tokenizer of a mixture's sources
    limit, source = ((info.vocab_size, f"its tokenizer ({info.path})") if info else
                     (run.model.args.vocab_size, "the model's vocabulary"))
    # Shard headers only: cheap, and catches wrong files before any GPU is touched. Each must hold a
    # sample of the longest stage's length (data.seq_len, or a long-context stage's).
    seq_len = run.stages.longest
    # And the shards a dataset.json records: by name and token count (their contents are the run's to read).
    paths = ([(s.splits()[0], f"data source {s.name}") for s in run.schedule.sources] if run.schedule.mixed else
             [] if run.builtin_corpus else [(cfg.data.path, "data.path")])
    for path, what in paths:
        check_against_record(open_shards(path, seq_len, limit, source, what), path, contents=False)
    if cfg.metrics.enable_wandb:
        from titanlike.records.wandb_sink import check_installed

        check_installed()  # found, not imported
    return run


def beyond_the_gpu(cfg: JobConfig, world: int) -> str | None:
    """Why no combination of levers fits this GPU run in the memory it has (training.gpu_memory_limit_gib,
    else the smallest card nvidia-smi shows), or None: also when that memory is unknown, when fit_gib
    chooses the levers (it has its own refusal), and for a CPU run."""
    from titanlike.config.host import runs_on_cpu, smallest_gpu

    if cfg.training.fit_gib or runs_on_cpu(cfg.training.device):
        return None
    cap = cfg.training.gpu_memory_limit_gib
    if cap:
        return out_of_reach(cfg, world, cap, f"in training.gpu_memory_limit_gib = {cap:g} GiB")
    card = smallest_gpu()
    if card is None:
        return None
    name, gib = card
    return out_of_reach(cfg, world, usable_gib(gib, world), f"on this host's {name} ({gib:.1f} GiB)")


def gpu_card(cfg: JobConfig) -> tuple[str, float] | None:
    """(name, GiB) of the smallest GPU nvidia-smi shows this process, for `fit_gib = auto`; None without one."""
    from titanlike.config.host import smallest_gpu

    return smallest_gpu() if cfg.training.fit_gib == "auto" else None


def printed(text: str) -> int:
    """Print `text` and return PRINTED, also when the reader went away first (`--help | head -3`)."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        # Nothing more can reach the reader; point stdout at /dev/null so that the interpreter's own flush
        # at exit does not fail again with a traceback.
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass  # a stdout without a file descriptor of its own: nothing left to flush into the pipe
        os.close(devnull)
    return PRINTED


def local_processes(world: int) -> int:
    """The processes run_train.sh starts on this host (NGPU; TITANLIKE_PREFLIGHT_LOCAL), else all of `world`."""
    text = os.environ.get(LOCAL_ENV, "")
    return int(text) if text.isdigit() and int(text) >= 1 else world


def world_size() -> int:
    """The world size run_train.sh is about to launch (NGPU × NNODES), checked."""
    text = os.environ.get(WORLD_ENV, "1")
    if not (text.isdigit() and 1 <= int(text) <= 2**24):
        raise UserError(f"{WORLD_ENV}={text!r}: the world size must be a whole number >= 1 (NGPU × NNODES)")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if any(a in ("-h", "--help") for a in argv):
            return printed(help_text(argv) + "\n")
        world = world_size()
        cfg = load_config(argv, world)
        if cfg.job.print_config:
            return printed(to_toml(resolved(cfg)))
        # training.fit_gib: a target nothing reaches stops here (`auto`: the smallest card nvidia-smi shows).
        cfg = fitted(cfg, argv, world, card=gpu_card(cfg))
        run = check(cfg, world)
        problem = beyond_the_gpu(cfg, world)  # a window no lever fits stops here, not at its first step
        if problem:
            raise UserError(problem)
        from titanlike.records.folder import check_not_in_use

        check_not_in_use(run.dump_folder, run.checkpoint_folder)  # a second run into a folder in use
    except UserError as e:
        return error_exit(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
