"""Where a run is and when it will end: a progress line on a terminal, the ETA in the log lines.

On a terminal (the logging rank's stderr is a TTY) one line at the bottom is rewritten in place
after every step, at most a few times a second:

    step 37/150 24% | 12,345 tok/s all ranks | ETA 1m23s | loss 2.314 @ step 30

Log lines still scroll above it: the line is erased before each log record and redrawn at the
next step. Anywhere else (a file, a pipe, a scheduler's log) nothing extra is written: the log
lines every metrics.log_freq steps are the plain record, and they carry the step count and ETA.

The rate is measured from the end of the first step of this process (which pays for compilation
and warm-up) over everything the loop does since, validation and checkpoint saves included: the
rest of the run will do them too. No device synchronisation: on a GPU the host runs at most a few
steps ahead of the device, which over a whole run is noise.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import time
from collections.abc import Callable
from typing import TextIO

CLEAR = "\r\033[K"  # back to the start of the line, erase it
REDRAW_EVERY_S = 0.25


def format_duration(seconds: float) -> str:
    """1h02m, 12m05s, 42s: two units at most, to the second."""
    s = max(0, round(seconds))
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    if h:
        return f"{h}h{m:02d}m"
    return f"{m}m{sec:02d}s" if m else f"{sec}s"


def render(step: int, total: int, tokens_per_s: float | None, eta_s: float | None,
           loss: tuple[int, float] | None, width: int) -> str:
    """The progress line, cut to the terminal's width (a wrapped line could not be redrawn in place)."""
    parts = [f"step {step}/{total} {100 * step // total}%"]
    if tokens_per_s is not None:
        parts.append(f"{tokens_per_s:,.0f} tok/s all ranks")  # since step 1; the log line: per device, per window
    if step < total:
        parts.append(f"ETA {format_duration(eta_s)}" if eta_s is not None else "ETA ...")
    if loss is not None:
        parts.append(f"loss {loss[1]:.3f} @ step {loss[0]}")
    line = " | ".join(parts)
    return line if len(line) < width else line[: max(0, width - 2)] + "…"


def wants_terminal_line(stream: TextIO) -> bool:
    """A progress line only on an interactive terminal that can erase a line."""
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        return False
    return tty and os.environ.get("TERM", "") != "dumb"


class Progress:
    """Tracks steps against training.steps; draws the terminal line when `terminal` is true."""

    def __init__(self, first_step: int, total_steps: int, tokens_per_step: int, *, terminal: bool,
                 stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic):
        self.first_step, self.total, self.tokens_per_step = first_step, total_steps, tokens_per_step
        self.terminal = terminal
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self._timed_from: tuple[int, float] | None = None  # (step, time) at the end of the first step
        self._step = first_step - 1
        self._loss: tuple[int, float] | None = None
        self._shown = False
        self._drawn_at = -float("inf")
        self._handlers: list[logging.Handler] = []
        if terminal:
            # Erase the line before any log record reaches the same stream, so records never land
            # on the end of it; the next step draws it again under them.
            for handler in logging.getLogger().handlers:
                if isinstance(handler, logging.StreamHandler) and handler.stream is self.stream:
                    handler.addFilter(self._erase_before_log)
                    self._handlers.append(handler)

    # ---- what the loop tells it ---------------------------------------------------------------

    def step_done(self, step: int) -> None:
        """Right after each step's update: the clock for the rate and the ETA."""
        self._step = step
        if self._timed_from is None:
            self._timed_from = (step, self.clock())

    def show(self) -> None:
        """At the end of each loop iteration (after its log line, validation, checkpoint): redraw the
        terminal line if it is due."""
        now = self.clock()
        if self.terminal and (now - self._drawn_at >= REDRAW_EVERY_S or self._step == self.total):
            self._draw(now)

    def new_stage(self, tokens_per_step: int) -> None:
        """A stage with another batch or seq_len begins: the rate counts its tokens per step."""
        self.tokens_per_step = tokens_per_step

    def logged_loss(self, step: int, loss: float) -> None:
        self._loss = (step, loss)

    # ---- what it reports ---------------------------------------------------------------------------

    def steps_per_s(self, now: float | None = None) -> float | None:
        if self._timed_from is None or self._step <= self._timed_from[0]:
            return None
        elapsed = (self.clock() if now is None else now) - self._timed_from[1]
        return (self._step - self._timed_from[0]) / elapsed if elapsed > 0 else None

    def eta_s(self, now: float | None = None) -> float | None:
        """Seconds until training.steps at the rate so far; None until two steps have been timed, and
        at the last step."""
        rate = self.steps_per_s(now)
        return (self.total - self._step) / rate if rate and self._step < self.total else None

    # ---- the terminal line ---------------------------------------------------------------------

    def _draw(self, now: float) -> None:
        rate = self.steps_per_s(now)
        width = shutil.get_terminal_size((100, 24)).columns
        line = render(self._step, self.total, rate * self.tokens_per_step if rate else None, self.eta_s(now),
                      self._loss, width)
        self._shown, self._drawn_at = self._write(CLEAR + line), now

    def _write(self, text: str) -> bool:
        """Write to the terminal; whether it is still there (a closed one ends the line, never the run)."""
        try:
            self.stream.write(text)
            self.stream.flush()
        except OSError:
            self.terminal = False
        return self.terminal

    def _erase_before_log(self, record: logging.LogRecord) -> bool:
        if self._shown:
            self._write(CLEAR)
            self._shown = False
            self._drawn_at = -float("inf")  # redraw at the next step, under the record
        return True

    def close(self) -> None:
        """Leave the terminal clean: erase the line and detach from logging."""
        if self._shown:
            self._write(CLEAR)
            self._shown = False
        for handler in self._handlers:
            handler.removeFilter(self._erase_before_log)
        self._handlers = []
