"""torchrun, as run_train.sh starts it, ending in one line instead of a traceback.

`python -m titanlike.launch <torchrun arguments>` is `torchrun` itself (torch.distributed.run's
argument parser and launcher), except for how it ends. When a worker fails, torchrun raises
ChildFailedError and prints its traceback and a table; but the worker has already said what went
wrong, as one `error:` line for anything the user can fix, so here torchrun ends with one plain line
that says which rank failed first, and exits with that rank's exit code (2 for a mistake the user
can fix, as a one-process run does). A signal that torchrun forwarded to the workers (preemption)
ends it quietly with 128 + the signal number; run_train.sh then reports whether the workers saved.
"""

from __future__ import annotations

import logging
import socket
import sys


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # Its process manager logs each worker's stop as a warning and an error line of its own
    # ("Sending process ... closing signal", "failed (exitcode: 2) local_rank: ..."): the summary
    # below says the same once. Rendezvous and agent messages still show.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    args = parse_args(argv)
    try:
        run(args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        how = f"exit code {failure.exitcode}" if failure.exitcode >= 0 else f"signal {failure.signal_name()}"
        others = f" ({len(e.failures) - 1} more stopped after it)" if len(e.failures) > 1 else ""
        # Not an "error:" line: the worker's own line above is the one that says what to fix.
        print(f"torchrun: worker rank {rank} on {socket.gethostname()} stopped with {how}{others}; its output "
              f"above says why", file=sys.stderr, flush=True)
        return failure.exitcode if 0 < failure.exitcode < 128 else 1
    except SignalException as e:
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
