"""Stopping early without losing work: a scheduler's preemption, or the user's Ctrl-C.

    signal                 what the run does                                          exit code
    SIGTERM, SIGUSR1,      finish the step, save a checkpoint, one line, stop         0
    SIGHUP (a closed terminal or ssh session)
    SIGINT (Ctrl-C)        the same, but report the interruption                      130
    a second SIGINT        stop at once: no save (the step in flight is lost)         130 (killed by SIGINT)
    any of them before     stop the build: nothing trained, nothing saved; one line   128 + signal (130 for
    the training loop                                                                SIGINT, 143 SIGTERM)

Schedulers preempt with SIGTERM or SIGUSR1 and requeue the same command, which resumes: exit 0.
Ctrl-C exits 130 as any interrupted command does (128 + SIGINT), yet keeps what was trained. The
checkpoint is saved even without checkpoint.enable; the same command resumes from it.

The handlers only record the request; the training loop acts on it between steps, after every rank
has agreed on it (CheckpointManager.due), so all ranks stop after the same step. A second
Ctrl-C restores the default action of SIGINT, which ends the process even while it waits inside a
long native call (a collective, a save). Under torchrun the workers run in process groups of their
own and get their signals from torchrun; titanlike.process.launch passes a second Ctrl-C on to them.
"""

from __future__ import annotations

import logging
import os
import signal

logger = logging.getLogger("titanlike")

# run_train.sh names a file here; a worker that stopped for a preemption creates it, so that the
# launcher reports a clean stop (exit 0) even though torchrun exits 128 + signal after forwarding one.
PREEMPTED_MARKER_ENV = "TITANLIKE_PREEMPTED_MARKER"

NONE, PREEMPTED, INTERRUPTED = 0, 1, 2
EXIT_CODE = {NONE: 0, PREEMPTED: 0, INTERRUPTED: 128 + signal.SIGINT}

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)


class StopSignals:
    """The stop request this process has received: NONE, PREEMPTED or INTERRUPTED."""

    def __init__(self, announce: bool):
        self.request = NONE
        self.announce = announce  # the rank that logs says, at once, what a Ctrl-C will do
        self._previous: dict = {}

    def install(self) -> None:
        for sig in PREEMPTION_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._preempt)
        self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._interrupt)

    def restore(self) -> None:
        """The handlers the process had before install() (a run inside a longer-lived process ends)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _preempt(self, signum, frame) -> None:
        self.request = max(self.request, PREEMPTED)

    def _interrupt(self, signum, frame) -> None:
        self.request = INTERRUPTED
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # the next Ctrl-C ends the process at once
        if self.announce:
            # os.write, not print: a handler can run in the middle of a print to the same stream.
            # \r and erase-line: a progress line (progress.py) may be on the terminal.
            erase = "\r\033[K" if os.isatty(2) else ""
            try:
                os.write(2, f"{erase}Ctrl-C: finishing this step, then saving a checkpoint (Ctrl-C again stops at "
                            f"once)\n".encode())
            except OSError:  # stderr gone (Ctrl-C on `… | tee log` ends tee first): the run still saves
                pass


class StoppedWhileBuilding(BaseException):
    """A preemption signal before the training loop took the stop signals over: nothing was trained, so
    nothing is saved. A BaseException, as KeyboardInterrupt is, so that no `except Exception` of the
    build swallows it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    def line(self) -> str:
        return (f"preempted before training started ({signal.Signals(self.signum).name}): nothing saved; run the "
                f"same command to start again")


class BuildStops:
    """While the run is built (config, model, compile, data, a checkpoint's load), a preemption signal ends
    it with one line (train.main's) instead of its default action, which killed the process without a
    word. The loop's StopSignals take over from there. Only signals at their default action are taken: one
    that nohup set to ignore stays ignored. `end()` gives the signals their default action back: one that
    comes while the run closes (publishing a save) ends it as it always did."""

    def __init__(self) -> None:
        self._previous: dict = {}
        self.building = False

    def install(self) -> None:
        for sig in PREEMPTION_SIGNALS:
            if signal.getsignal(sig) is signal.SIG_DFL:
                self._previous[sig] = signal.signal(sig, self._stop)
        self.building = True

    def _stop(self, signum, frame) -> None:
        if self.building:
            raise StoppedWhileBuilding(signum)
        # Reinstalled behind the loop's handlers (StopSignals.restore) once the build is over: the default action.
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def end(self) -> None:
        self.building = False
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def stopped_line(request: int, step: int, checkpoint: str) -> str:
    """The one line a stopped run ends with. The same command resumes from the save, with or without
    checkpoint.enable (the checkpoint manager resumes from a stop's save either way)."""
    what = "preempted" if request == PREEMPTED else "interrupted"
    return f"{what}: stopped after step {step}; checkpoint at {checkpoint}; run the same command to resume"


def stopped(request: int, step: int, checkpoint: str | None, *, local_rank: int, is_main: bool) -> int:
    """A run that stopped on `request` after `step`, its save in `checkpoint`: tell the launcher of a
    clean preemption (the first rank of each node), say it in one line; returns the exit code."""
    marker = os.environ.get(PREEMPTED_MARKER_ENV)
    if request == PREEMPTED and marker and local_rank == 0:
        open(marker, "w").close()
    if is_main:
        logger.info(stopped_line(request, step, checkpoint or "(none)"))
    return EXIT_CODE[request]
