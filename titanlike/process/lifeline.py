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
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

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


def under_torchrun() -> bool:
    """A worker that torchrun started (it sets TORCHELASTIC_RUN_ID for every worker)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def follow_torchrun() -> bool:
    """For a worker: end with torchrun (see the module docstring). A process not started by torchrun
    is a run's top level and follows nothing."""
    return under_torchrun() and follow_parent(AGENT_PID_ENV)
