"""The installed console script: `titanlike-train` (pyproject's [project.scripts]) runs titanlike.train:cli."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from conftest import _env
from titanlike.config import load_config, to_toml
from titanlike.preflight import resolved


def console_script() -> str:
    # pip puts console scripts beside the interpreter; a PATH lookup covers other layouts.
    beside = Path(sys.executable).parent / "titanlike-train"
    found = str(beside) if beside.exists() else shutil.which("titanlike-train")
    assert found, "titanlike-train is not installed: run `pip install -e .` in the repository"
    return found


def test_cli_is_importable():
    from titanlike.train import cli, main

    assert callable(cli) and callable(main)


def test_console_script_prints_the_config(tmp_path):
    proc = subprocess.run([console_script(), "--job.print_config", "--training.steps", "7", "--profiling.folder",
                           "prof"], env=_env(), capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    printed = tomllib.loads(proc.stdout)
    assert printed["training"]["steps"] == 7 and printed["profiling"]["folder"] == "prof"
    assert proc.stdout == to_toml(resolved(load_config(["--job.print_config", "--training.steps", "7",
                                                        "--profiling.folder", "prof"])))
    assert not (tmp_path / "outputs").exists()  # printed, not trained


def test_console_script_reports_a_typo_in_one_line(tmp_path):
    proc = subprocess.run([console_script(), "--training.stepz", "7"], env=_env(), capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: unknown config key training.stepz in the command line; did you mean training.steps?"]


def test_an_error_with_stderr_closed_or_broken_still_exits_2_and_writes_nothing_else(tmp_path):
    """With stderr closed (`2>&-`: Python's sys.stderr is None, and print would write the line to stdout,
    the command's output) or a pipe nobody reads any more, the error line has nowhere to go: the exit code
    still says what happened, and no traceback is attempted. titanlike-prepare, whose stdout is its summary
    (every entry point ends through the same errors.error_exit), on an input that does not exist."""
    import os

    command = [sys.executable, "-m", "titanlike.data.prepare", str(tmp_path / "out"), str(tmp_path / "missing.txt")]
    closed = subprocess.run(command, env=_env(), stdout=subprocess.PIPE, text=True, timeout=120, cwd=tmp_path,
                            preexec_fn=lambda: os.close(2))
    assert closed.returncode == 2 and closed.stdout == ""
    read, write = os.pipe()
    os.close(read)  # the reader has gone: a write raises BrokenPipeError
    try:
        broken = subprocess.run(command, env=_env(), stdout=subprocess.PIPE, stderr=write, text=True, timeout=120,
                                cwd=tmp_path)
    finally:
        os.close(write)
    assert broken.returncode == 2 and broken.stdout == ""
    shown = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert shown.returncode == 2 and shown.stderr == f"error: {tmp_path / 'missing.txt'}: no such file or folder\n"
