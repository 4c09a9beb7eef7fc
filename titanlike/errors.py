"""What the user sees when something is theirs to fix: one `error:` line, never a traceback."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class UserError(Exception):
    """Something the user can fix (config, data, checkpoint, hardware choice).

    `main()` prints its message as one line on stderr and exits non-zero. Raise it with a
    message that names what was wrong and what would be valid.
    """

    # True when every rank meets the same error (config, data files): only rank 0 reports it.
    same_on_all_ranks = False


EXIT_CODE = 2  # what an entry point returns for a mistake the user can fix


def error_exit(error: BaseException) -> int:
    """How every entry point ends on a mistake the user can fix: its one `error:` line on stderr; returns
    the exit code."""
    print(f"error: {error}", file=sys.stderr)
    return EXIT_CODE


class ArgumentParser(argparse.ArgumentParser):
    """argparse for the console scripts, whose mistakes end as one `error:` line and exit code 2
    (argparse's own prints the usage too); `--help` shows the usage."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)
