"""The processes inside a run follow the one that started them.

A run over several processes is three levels: run_train.sh (the launcher), torchrun in a process
group of its own (so that a terminal's Ctrl-C reaches it once, passed on by the launcher), and the
workers, each in a session of its own (as torchrun starts them). A signal to one group does not
reach the others, and a process whose parent dies is adopted by init and goes on: a SIGKILL of the
launcher's group would leave torchrun and its workers training headless, holding the run folder's
lock. So each inner level asks the kernel for SIGTERM when its parent ends (Linux's
PR_SET_PDEATHSIG), and SIGTERM is what preemption sends:

    the launcher dies   torchrun gets SIGTERM and forwards it: the workers finish the step, save, stop
    torchrun dies       each worker gets SIGTERM: finish the step, save, stop (before the loop: exit)

The top level (the launcher, or one `python -m titanlike.train`) never follows its parent: it must
outlive a closed terminal under nohup. Nothing here imports torch.

Helpers inside a level (data-loader workers) share its process group, and a stop sent to the group
(a terminal's Ctrl-C or SIGHUP, `timeout`, `kill -TERM -- -PGID`, SLURM signalling every process of
a job step, `pkill -f run_train.sh`) reaches them too. Such a stop is the trainer's to act on (it
finishes the step and saves, with their help): the helpers ignore it (`ignore_stops`) and end with
the trainer (`end_with`). A helper is started with the stops held (`signals_held`), so that none
reaches it before it ignores them.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Iterable, Iterator

from titanlike.run.stopping import PREEMPTION_SIGNALS

PR_SET_PDEATHSIG = 1  # linux/prctl.h

# run_train.sh exports its own pid here before it starts torchrun, and titanlike.process.launch exports
# torchrun's before it starts the workers: a child that finds another parent was orphaned before it
# could ask to follow (the kernel only signals a death that comes after the request).
LAUNCHER_PID_ENV = "TITANLIKE_LAUNCHER_PID"
AGENT_PID_ENV = "TITANLIKE_AGENT_PID"


def _on_parent_death(sig: signal.Signals, parent_pid: int | None) -> bool:
    """Ask the kernel for `sig` when the parent process ends (Linux's PR_SET_PDEATHSIG); if `parent_pid` is
    given and is no longer the parent, the parent died before the request: `sig` now, as if after it.
    Returns whether the kernel took the request (False off Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)
    return True


def follow_parent(expected_env: str) -> bool:
    """Ask for SIGTERM when the parent process ends; if the parent named by `expected_env` (a pid in
    the environment, when set) has already gone, SIGTERM now. Returns whether the kernel took the
    request (False off Linux, where a run's inner levels do not follow their parent)."""
    expected = os.environ.get(expected_env, "")
    return _on_parent_death(signal.SIGTERM, int(expected) if expected.isdigit() else None)


def end_with(parent_pid: int) -> bool:
    """For a helper process that holds nothing of its own (a data-loader or tokenizing worker): the kernel
    kills it the moment its parent `parent_pid` ends, however that ends (a SIGKILL included), rather than
    leaving it to notice later or never; if the parent has already gone, it ends now. Returns whether the
    kernel took the request (False off Linux)."""
    return _on_parent_death(signal.SIGKILL, parent_pid)


STOP_SIGNALS = (signal.SIGINT, *PREEMPTION_SIGNALS)
"""What stops a run (run/stopping.py): Ctrl-C and the preemption signals."""


@contextlib.contextmanager
def signals_held(signals: Iterable[int]) -> Iterator[None]:
    """`signals` held (blocked) in this thread while it starts child processes: a child forked here starts
    with them held and takes them only once it unblocks them, with its own handling in place. A signal that
    arrives meanwhile waits: the parent takes it when the block ends. (Off POSIX: nothing is held.)"""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def ignore_stops(parent_pid: int) -> None:
    """For a helper process of a run (a data-loader worker), started inside `signals_held(STOP_SIGNALS)`:
    the stops sent to its process group, or to every process of the run, are the trainer's to act on, and
    it goes on using the helper to finish the step (torch's worker would die on SIGTERM, and torch's SIGCHLD
    handler raise in the trainer: a traceback, nothing saved). So they are ignored, all but a SIGTERM from
    `parent_pid` itself: that is how torch and multiprocessing end a worker that did not stop when told (at
    the trainer's exit among others), and it ends the helper as torch's own handler would (exit 0). A stop
    held since the fork is taken for what it is: ignored, or from the parent."""
    others = [sig for sig in STOP_SIGNALS if sig != signal.SIGTERM]
    for sig in others:
        signal.signal(sig, signal.SIG_IGN)
    if not hasattr(signal, "sigwaitinfo"):  # not POSIX: no sender to tell, and no group to share
        return
    # SIGTERM stays held in this thread and so in every thread it starts; one thread takes each and reads
    # its sender, which a handler cannot.
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
    threading.Thread(target=_exit_on_sigterm_from, args=(parent_pid,), name="sigterm-from-parent", daemon=True).start()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, others)


def _exit_on_sigterm_from(parent_pid: int) -> None:
    while signal.sigwaitinfo([signal.SIGTERM]).si_pid != parent_pid:
        pass
    os._exit(0)


def under_torchrun() -> bool:
    """A worker that torchrun started (it sets TORCHELASTIC_RUN_ID for every worker)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def follow_torchrun() -> bool:
    """For a worker: end with torchrun (see the module docstring). A process not started by torchrun
    is a run's top level and follows nothing."""
    return under_torchrun() and follow_parent(AGENT_PID_ENV)
