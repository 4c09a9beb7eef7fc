"""torchrun, as run_train.sh starts it, ending in one line instead of a traceback.

`python -m titanlike.process.launch <torchrun arguments>` is `torchrun` itself (torch.distributed.run's
argument parser and launcher), except for how it ends. When a worker fails, torchrun raises
ChildFailedError and prints its traceback and a table; but the worker has already said what went
wrong, as one `error:` line for anything the user can fix, so here torchrun ends with one plain line
that says which rank failed first, and exits with that rank's exit code (2 for a mistake the user
can fix, as a one-process run does). A signal that torchrun forwarded to the workers (preemption)
ends it quietly with 128 + the signal number; run_train.sh then reports whether the workers saved.

Ctrl-C (SIGINT) is handled here rather than by torchrun: the first goes to the workers through
torchrun's own shutdown (they finish the step, save and exit 130, while torchrun waits for them);
torchrun would meet a second one by shutting down again with SIGTERM and waiting as long, so
here a second one goes straight to the workers, which then stop at once (stopping.py).

torchrun follows the launcher, and the workers follow torchrun (lifeline.py): a SIGKILL of the
launcher ends the run with a save, as a preemption does, instead of leaving it training headless.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from pathlib import Path

from titanlike.process import lifeline
from titanlike.process.logs import say
from titanlike.run.stopping import PREEMPTED_MARKER_ENV


def worker_process_groups() -> list[int]:
    """The process groups of this process's children: torchrun starts each worker as the leader of
    a session (and so a process group) of its own, with its data-loader workers inside. Linux /proc."""
    groups = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[1]) == os.getpid() and int(fields[2]) != os.getpgrp():  # state, ppid, pgrp, ...
            groups.append(int(fields[2]))
    return groups


def launcher_alive() -> bool:
    """Whether run_train.sh, which started this torchrun, is still its parent (True when no launcher
    named itself: torchrun started some other way)."""
    launcher = os.environ.get(lifeline.LAUNCHER_PID_ENV, "")
    return not launcher.isdigit() or os.getppid() == int(launcher)


def handle_interrupts() -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException

    interrupts = 0

    def on_sigint(signum, frame):
        nonlocal interrupts
        interrupts += 1
        if interrupts == 1:  # what torchrun's own handler does: its agent passes it to the workers
            raise SignalException(f"Process {os.getpid()} got signal: SIGINT", sigval=signal.SIGINT)
        for group in worker_process_groups():
            try:
                os.killpg(group, signal.SIGINT)
            except (ProcessLookupError, PermissionError):
                pass

    signal.signal(signal.SIGINT, on_sigint)


def main(argv: list[str] | None = None) -> int:
    # First, before torch loads (seconds): from here on, the launcher's end is this process's SIGTERM.
    lifeline.follow_parent(lifeline.LAUNCHER_PID_ENV)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # Its process manager logs each worker's stop as a warning and an error line of its own
    # ("Sending process ... closing signal", "failed (exitcode: 2) local_rank: ..."): the summary
    # below says the same once. Rendezvous and agent messages still show.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    # Its agent announces a forwarded signal ("Received 2 death signal, shutting down workers"): the
    # workers say what they do about it, in words.
    logging.getLogger("torch.distributed.elastic.agent.server.api").addFilter(
        lambda record: "death signal" not in str(record.msg))
    args = parse_args(argv)
    # torchrun would install its handler over ours for every signal in this list.
    args.signals_to_handle = ",".join(s for s in args.signals_to_handle.split(",") if s.strip() != "SIGINT")
    handle_interrupts()
    # The workers inherit this: each checks that torchrun is still its parent when it asks to follow it.
    os.environ[lifeline.AGENT_PID_ENV] = str(os.getpid())
    try:
        run(args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        how = f"exit code {failure.exitcode}" if failure.exitcode >= 0 else f"signal {failure.signal_name()}"
        others = f" ({len(e.failures) - 1} more stopped after it)" if len(e.failures) > 1 else ""
        # Not an "error:" line: the worker's own line above is the one that says what to fix.
        say(f"torchrun: worker rank {rank} on {socket.gethostname()} stopped with {how}{others}; its output "
            f"above says why")
        return failure.exitcode if 0 < failure.exitcode < 128 else 1
    except SignalException as e:
        marker = os.environ.get(PREEMPTED_MARKER_ENV)
        if marker and not launcher_alive():  # nobody is left to read the preemption marker
            Path(marker).unlink(missing_ok=True)
        return 128 + int(e.sigval)
    finally:
        os.environ.pop(lifeline.AGENT_PID_ENV, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
