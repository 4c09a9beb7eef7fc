"""Progress: a line rewritten in place on a terminal, plain log lines with the ETA elsewhere."""

from __future__ import annotations

import io
import logging

import pytest
import torch

from titanlike.records import progress
from titanlike.records.metrics import MetricsLogger, format_line
from titanlike.records.progress import CLEAR, Progress, format_duration, render, wants_terminal_line


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_format_duration():
    assert [format_duration(s) for s in (0, 0.4, 42, 60, 725, 3600, 3725.0, 90000)] == [
        "0s", "0s", "42s", "1m00s", "12m05s", "1h00m", "1h02m", "25h00m"]


def test_render_names_step_rate_eta_and_last_loss():
    assert render(37, 150, 12345.6, 83, (30, 2.3141), 200) == \
        "step 37/150 24% | 12,346 tok/s all ranks | ETA 1m23s | loss 2.314 @ step 30"
    assert render(1, 150, None, None, None, 200) == "step 1/150 0% | ETA ..."  # not timed yet
    assert (render(150, 150, 9000, None, (150, 1.5), 200)
            == "step 150/150 100% | 9,000 tok/s all ranks | loss 1.500 @ step 150")


def test_render_fits_the_terminal_width():
    line = render(37, 150, 12345.6, 83, (30, 2.3141), 20)
    assert len(line) < 20 and line.startswith("step 37/150") and line.endswith("…")


def test_only_a_real_terminal_gets_the_line(monkeypatch):
    monkeypatch.setenv("TERM", "xterm")
    assert wants_terminal_line(Terminal()) and not wants_terminal_line(io.StringIO())
    monkeypatch.setenv("TERM", "dumb")
    assert not wants_terminal_line(Terminal())


def test_rate_and_eta_leave_out_the_first_step():
    clock = Clock()
    p = Progress(first_step=11, total_steps=100, tokens_per_step=4096, terminal=False, clock=clock)
    clock.now += 30.0  # compilation and warm-up: not a rate
    p.step_done(11)
    assert p.eta_s() is None
    for step in range(12, 21):
        clock.now += 2.0
        p.step_done(step)
    assert p.steps_per_s() == pytest.approx(0.5)
    assert p.eta_s() == pytest.approx(80 * 2.0)  # 80 steps left at 2 s each
    clock.now += 2.0
    p.step_done(100)
    assert p.eta_s() is None  # nothing left


def test_terminal_line_is_redrawn_in_place_and_throttled():
    clock, term = Clock(), Terminal()
    p = Progress(first_step=1, total_steps=10, tokens_per_step=1000, terminal=True, stream=term, clock=clock)
    p.step_done(1)
    p.show()
    clock.now += 1.0
    p.step_done(2)
    p.show()
    clock.now += 0.1  # within REDRAW_EVERY_S: no redraw
    p.step_done(3)
    p.show()
    out = term.getvalue()
    assert out == CLEAR + "step 1/10 10% | ETA ..." + CLEAR + "step 2/10 20% | 1,000 tok/s all ranks | ETA 8s"
    assert "\n" not in out
    clock.now += progress.REDRAW_EVERY_S  # 3 steps in 1.35 s since step 1
    p.step_done(4)
    p.show()
    assert term.getvalue().endswith(CLEAR + "step 4/10 40% | 2,222 tok/s all ranks | ETA 3s")
    p.close()
    assert term.getvalue().endswith(CLEAR)  # the terminal is left clean


def test_log_records_are_written_above_the_line():
    clock, term = Clock(), Terminal()
    handler = logging.StreamHandler(term)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    log = logging.getLogger("titanlike.test_progress")
    log.setLevel(logging.INFO)
    try:
        p = Progress(first_step=1, total_steps=10, tokens_per_step=1000, terminal=True, stream=term, clock=clock)
        p.step_done(1)
        p.show()
        log.info("train step 1")
        # The line was erased before the record, so the record starts a clean line.
        assert term.getvalue() == CLEAR + "step 1/10 10% | ETA ..." + CLEAR + "train step 1\n"
        clock.now += 0.01
        p.step_done(2)
        p.show()  # redrawn under the record at once, however recent the last draw
        assert term.getvalue().endswith("train step 1\n" + CLEAR + "step 2/10 20% | 100,000 tok/s all ranks | ETA 0s")
        p.close()
        log.info("done")
        assert term.getvalue().endswith(CLEAR + "done\n")
        assert not handler.filters  # detached
    finally:
        root.removeHandler(handler)


class ClosedTerminal(Terminal):
    """A terminal that went away (a closed ssh session): every write fails, as on a hung-up tty."""

    def write(self, text: str) -> int:
        raise OSError(5, "Input/output error")


def test_a_closed_terminal_ends_the_line_not_the_run():
    """The line is drawn while the terminal is there; once it is gone, neither a redraw, a log record
    (whose filter erases the line) nor close raises: the run goes on to its save."""
    clock, term = Clock(), Terminal()
    handler = logging.StreamHandler(term)
    root = logging.getLogger()
    root.addHandler(handler)
    log = logging.getLogger("titanlike.test_progress")
    log.setLevel(logging.INFO)
    try:
        p = Progress(first_step=1, total_steps=10, tokens_per_step=1000, terminal=True, stream=term, clock=clock)
        p.step_done(1)
        p.show()
        term.__class__ = ClosedTerminal  # the terminal goes, with the line on it
        log.info("checkpoint step 1: saved")
        clock.now += progress.REDRAW_EVERY_S
        p.step_done(2)
        p.show()
        p.close()
        assert not p.terminal
    finally:
        root.removeHandler(handler)


def test_no_terminal_no_line():
    clock, stream = Clock(), io.StringIO()
    p = Progress(first_step=1, total_steps=10, tokens_per_step=1000, terminal=False, stream=stream, clock=clock)
    for step in range(1, 11):
        clock.now += 1
        p.step_done(step)
        p.show()
    p.close()
    assert stream.getvalue() == ""


def test_plain_log_line_carries_the_step_count_and_eta():
    record = {"step": 20, "loss": 3.14159, "grad_norm": 1.5, "lr": 1e-3, "tps": 1234.0, "data_share": 0.0}
    assert format_line("train", record, 150, 65) == \
        "train step     20/150 | loss 3.1416 | grad 1.500 | lr 1.00e-03 | 1,234 tok/s/dev | data 0% | ETA 1m05s"
    assert format_line("val", {"step": 50, "loss": 2.0, "ppl": 7.389}) == "val step     50 | loss 2.0000 | ppl 7.39"


def test_cpu_log_line_has_no_tflops_or_mfu_column(tmp_path, caplog):
    m = MetricsLogger(str(tmp_path), is_writer=True, tensorboard=False, device=torch.device("cpu"),
                      constants={})
    with caplog.at_level(logging.INFO, logger="titanlike"):
        m.log(20, {"loss": 3.0, "tps": 1234.0, "tflops": 0.0012, "mfu": None}, total_steps=150, eta_s=65)
    m.close()
    assert caplog.messages == ["train step     20/150 | loss 3.0000 | 1,234 tok/s/dev | ETA 1m05s"]
    # The record keeps them: metrics.jsonl is the same on every device.
    assert '"tflops": 0.0012' in (tmp_path / "metrics.jsonl").read_text()
