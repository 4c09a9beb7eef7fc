"""Which rank's log is printed, and how: the lines of rank LOG_RANK (default 0) at INFO, the others'
warnings and errors only, each prefixed with its rank when there are several.

A console that goes away does not end the run: Ctrl-C on `titanlike-train … | tee log` ends tee
before the run has finished its step and saved, and a closed terminal takes stderr with it. The
first write that fails points stderr (and stdout, where it is the same file) at /dev/null; the run
goes on to its save, and the run folder's train.log keeps every line, one saying the console went."""

from __future__ import annotations

import logging
import os
import sys

from titanlike.errors import UserError

logger = logging.getLogger("titanlike")


def silence_console() -> None:
    """stderr, and stdout where it is the same file (`2>&1 | tee`), written to /dev/null from now on."""
    try:
        same = os.path.sameopenfile(1, 2)
    except OSError:
        same = False
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        if same:
            os.dup2(null, 1)
    finally:
        os.close(null)


def say(line: str) -> None:
    """One line on stderr, where a console that has gone away (a closed pipe or terminal) is no error, nor a
    stderr closed from the start (sys.stderr None: print would write to stdout)."""
    if sys.stderr is None:
        return
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        silence_console()


class ConsoleHandler(logging.StreamHandler):
    """The log on stderr, until stderr goes away: then silence_console, and one line to the other
    handlers (train.log) that says so."""

    def handleError(self, record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        if not isinstance(error, OSError):
            super().handleError(record)
            return
        silence_console()
        logger.warning(f"the console is gone (stderr: {error.strerror or error}): the run goes on, its log in "
                       f"train.log only")


def setup_logging(rank: int) -> None:
    text = os.environ.get("LOG_RANK", "0")
    if not (text.isascii() and text.isdigit()):
        raise UserError(f"LOG_RANK={text!r}: must be a whole number, the rank whose log is printed (default 0)")
    log_rank = int(text)
    level = logging.INFO if rank == log_rank else logging.WARNING
    prefix = f"[rank{rank}] " if int(os.environ.get("WORLD_SIZE", 1)) > 1 else ""
    logging.basicConfig(level=level, format=f"{prefix}%(asctime)s %(message)s", datefmt="%H:%M:%S", force=True,
                        handlers=[ConsoleHandler(sys.stderr)])
    logger.setLevel(level)
    # torchao reports optional CUDA extensions it could not load, and trips a pytree deprecation
    # notice at import: neither is actionable for a user.
    logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
