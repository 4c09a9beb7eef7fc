"""What the user sees when something is theirs to fix: one `error:` line, never a traceback."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from collections.abc import Iterator
from typing import NoReturn


class UserError(Exception):
    """Something the user can fix (config, data, checkpoint, hardware choice).

    `main()` prints its message as one line on stderr and exits non-zero. Raise it with a
    message that names what was wrong and what would be valid.
    """

    # True when every rank meets the same error (config, data files): only rank 0 reports it.
    same_on_all_ranks = False


EXIT_CODE = 2  # what an entry point returns for a mistake the user can fix


def say_error(line: str) -> None:
    """`line` on stderr, if there is one to write to: a command started with stderr closed (`2>&-`, where
    Python's sys.stderr is None and print would fall back to stdout, the command's output) or into a pipe
    whose reader has gone still ends with its exit code, not a traceback nobody can read."""
    stream = sys.stderr
    if stream is None:
        return
    try:
        print(line, file=stream, flush=True)
    except (OSError, ValueError):  # a closed or broken stream
        pass


def error_exit(error: BaseException) -> int:
    """How every entry point ends on a mistake the user can fix: its one `error:` line on stderr; returns
    the exit code."""
    say_error(f"error: {error}")
    return EXIT_CODE


class ArgumentParser(argparse.ArgumentParser):
    """argparse for the console scripts, whose mistakes end as one `error:` line and exit code 2
    (argparse's own prints the usage too); `--help` shows the usage."""

    def error(self, message: str) -> NoReturn:
        say_error(f"error: {message} (see {self.prog} --help)")
        raise SystemExit(2)


class Stopped(BaseException):
    """A stop signal (SIGTERM, SIGHUP) arrived while a command ran: a BaseException, as KeyboardInterrupt, so
    that no handler keeps it and every `finally` on the way out runs (a staging folder is removed)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_stopped(signum: int, frame) -> None:
    raise Stopped(signum)


# What a scheduler or `kill` sends (SIGTERM) and what a closed terminal sends (SIGHUP); SIGINT is Ctrl-C.
STOPS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n))


@contextlib.contextmanager
def stops_unwind() -> Iterator[None]:
    """While the body runs, SIGTERM and SIGHUP raise Stopped and SIGINT KeyboardInterrupt, also where the
    process started with SIGINT ignored (every `cmd &` of a script starts it so, and Python leaves it ignored):
    the command unwinds, where the default action would end it at once with no line and leave its partial
    output. A stop signal the process started ignoring stays ignored (`nohup` ignores SIGHUP so that a closed
    terminal does not end the command). The handlers before are put back after."""
    previous = {sig: signal.signal(sig, _raise_stopped) for sig in STOPS if signal.getsignal(sig) == signal.SIG_DFL}
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def stopped_exit(error: BaseException, what_is_left: str) -> int:
    """How a command stopped by a signal ends: one line saying which signal and `what_is_left` ("nothing was
    written"), exit code 128 + the signal, as the shell reports a process the signal ended."""
    signum = error.signum if isinstance(error, Stopped) else signal.SIGINT
    name = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
    say_error(f"error: {name}; {what_is_left}")
    return 128 + signum
