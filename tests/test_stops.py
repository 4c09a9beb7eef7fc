"""How titanlike-prepare, titanlike-export and titanlike-generate end on a stop signal (errors.stops_unwind):
Ctrl-C, SIGTERM and SIGHUP unwind the command to one `error:` line and the shell's exit code (128 + the
signal), also where the command started with SIGINT ignored (a script's `cmd &`); a SIGHUP that `nohup`
ignores stays ignored. The commands' own work is replaced by one that signals the process, so each case is
deterministic and runs in this process."""

from __future__ import annotations

import os
import signal
import time

import pytest

from titanlike.errors import STOPS, Stopped, stopped_exit, stops_unwind


def signal_self(sig: int):
    def work(*args, **kwargs):
        os.kill(os.getpid(), sig)
        time.sleep(5)  # the handler raises before this ends
        raise AssertionError("the signal did not stop the command")

    return work


@pytest.fixture
def dispositions():
    """Every stop signal's disposition put back after the test, whatever it set."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, *STOPS)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_stop_unwinds_and_the_handlers_before_come_back(sig, dispositions):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a script's `cmd &` starts it
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, *STOPS)}
    unwound = []
    with pytest.raises(KeyboardInterrupt if sig == signal.SIGINT else Stopped) as e:
        with stops_unwind():
            try:
                signal_self(sig)()
            finally:
                unwound.append(True)  # a `finally` on the way out runs (a staging folder is removed)
    assert unwound and {s: signal.getsignal(s) for s in before} == before
    assert stopped_exit(e.value, "nothing was written") == 128 + sig


def test_a_sighup_that_nohup_ignores_stays_ignored(dispositions):
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    with stops_unwind():
        os.kill(os.getpid(), signal.SIGHUP)  # ignored: nothing happens
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN


@pytest.mark.parametrize("sig, line", [
    (signal.SIGTERM, "error: stopped by SIGTERM; nothing more was printed\n"),
    (signal.SIGINT, "error: interrupted; nothing more was printed\n"),
])
def test_generate_stopped_says_so_in_one_line(monkeypatch, capsys, dispositions, sig, line):
    from titanlike.hf import generate

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    monkeypatch.setattr(generate, "write_continuation", signal_self(sig))
    assert generate.main(["some/step", "--device", "cpu"]) == 128 + sig
    assert capsys.readouterr().err == line


def test_export_stopped_says_so_in_one_line(monkeypatch, capsys, dispositions):
    from titanlike.hf import export

    monkeypatch.setattr(export, "export", signal_self(signal.SIGTERM))
    assert export.main(["some/step", "out"]) == 128 + signal.SIGTERM
    assert capsys.readouterr().err == "error: stopped by SIGTERM; nothing was written to out\n"
