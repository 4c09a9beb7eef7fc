"""`titanlike-train` (`python -m titanlike.train`): the config, the levers training.fit_gib picks, the
Trainer (trainer.py), and how a run ends: exit code 0, one `error:` line and exit code 2 for anything
the user can fix (a stop's own code for a signal, run/stopping.py), a traceback only for what is not
understood."""

from __future__ import annotations

import logging
import os
import signal
import sys

import torch.distributed as dist

from titanlike import parallel
from titanlike.config import help_text, load_config, to_toml
from titanlike.config.dims import world_from_env
from titanlike.errors import EXIT_CODE, UserError, error_exit
from titanlike.plan.fit import fitted
from titanlike.preflight import printed, resolved
from titanlike.process import faults, lifeline
from titanlike.process.logs import say, setup_logging
from titanlike.run import stopping
from titanlike.trainer import Trainer

logger = logging.getLogger("titanlike")

__all__ = ["Trainer", "cli", "main"]


def main(argv: list[str] | None = None) -> int:
    lifeline.follow_torchrun()  # a torchrun worker ends with it (process/lifeline.py); a top-level run follows nothing
    # Ctrl-C (or `kill -INT`) stops a run even where it started with SIGINT ignored, as a script's `… &` starts
    # it (Python then leaves it ignored): the build would be deaf to it, and under torchrun the whole run.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    parallel.default_allocator_settings()
    world, rank, _ = world_from_env()
    try:
        setup_logging(rank)
    except UserError as e:
        return error_exit(e) if rank == 0 else EXIT_CODE
    trainer = cfg = None
    argv = list(sys.argv[1:] if argv is None else argv)
    publish = True  # whether every rank reaches the end together (a failure of one rank alone: no)
    build_stops = stopping.BuildStops()
    build_stops.install()  # a preemption before the loop: one line, not a silent death
    try:
        if any(a in ("-h", "--help") for a in argv):
            if rank == 0:  # run_train.sh under torchrun runs this with its own name; else titanlike-train was typed
                launcher = os.path.basename(sys.argv[0]) == "run_train.sh"
                printed(help_text(argv, prog="run_train.sh" if launcher else "titanlike-train") + "\n")
            return 0
        cfg = load_config(argv, world)
        if cfg.job.print_config:
            if rank == 0:
                printed(to_toml(resolved(cfg)))  # also into a pipe whose reader stopped early (`| head`)
            return 0
        # training.fit_gib: the fastest levers whose estimate fits, one line saying which (config.toml records them).
        cfg = fitted(cfg, argv, world, say=logger.info if rank == 0 else None, card=parallel.this_gpu())
        trainer = Trainer(cfg)
        return trainer.train()
    except KeyboardInterrupt:
        # Ctrl-C before the training loop (building, compiling, loading): nothing trained to save.
        if rank == 0:
            say("interrupted before training started: nothing saved")
        publish = world == 1
        return stopping.EXIT_CODE[stopping.INTERRUPTED]
    except stopping.StoppedWhileBuilding as e:
        # SIGTERM (a scheduler's preemption, `timeout`), SIGUSR1 or SIGHUP before the loop: nothing trained to save.
        if rank == 0:
            say(e.line())
        publish = world == 1
        return 128 + e.signum
    except UserError as e:
        publish = world == 1 or e.same_on_all_ranks
        return error_exit(e) if rank == 0 or not e.same_on_all_ranks else EXIT_CODE
    except RuntimeError as e:  # out of memory, or a peer rank gone: one line where it is one of those
        publish = world == 1
        known = faults.explain(e, cfg, world, rank, **(trainer.fault_facts() if trainer is not None else {}))
        if known is None:
            raise
        say(f"error: {known[1]}")
        return known[0]
    except BaseException:
        publish = world == 1
        raise
    finally:
        build_stops.building = False
        try:
            if trainer is not None:
                try:
                    trainer.close(publish=publish)
                except UserError as e:  # publishing the save in flight failed: say so, after the first error
                    say(f"error: {e}")
            if dist.is_initialized():
                parallel.destroy_process_group()
        finally:
            build_stops.end()  # after the trainer's StopSignals.restore, which puts ours back


def cli() -> None:
    """The `titanlike-train` console script: same as `python -m titanlike.train`."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
