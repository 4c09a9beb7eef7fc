"""`./run_train.sh` (bash mode) and `torchrun ... run_train.sh` (Python mode) mean the same run, and the
launcher says things once."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib

import pytest

from conftest import ROOT, _env


def bash_mode(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(ROOT / "run_train.sh"), *args], env={**_env(), **env}, capture_output=True,
                          text=True, timeout=300, cwd=ROOT)


def python_mode(*args: str, nproc: int = 1, **env: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "run_train.sh"), *args]
    return subprocess.run(cmd, env={**_env(), **env}, capture_output=True, text=True, timeout=300, cwd=ROOT)


def printed_config(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tomllib.loads(proc.stdout)


@pytest.mark.slow  # torchrun twice: the slow tier, where the launcher's other modes run

class ClosedPipe:
    """A stdout whose reader went away (`--help | head -3`): every write and flush fails, as a closed pipe's
    does; its descriptor is a stand-in file, which the command points at /dev/null."""

    def __init__(self, stand_in: int):
        self.stand_in = stand_in

    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        raise BrokenPipeError(32, "Broken pipe")

    def fileno(self):
        return self.stand_in


def closed_pipe(tmp_path) -> ClosedPipe:
    return ClosedPipe(os.open(tmp_path / "stdout", os.O_WRONLY | os.O_CREAT))

def test_torchrun_with_no_arguments_trains_what_the_launcher_trains():
    launcher = printed_config(bash_mode("--job.print_config"))
    torchrun = printed_config(python_mode("--job.print_config"))
    assert torchrun == launcher
    # The debug config (the dataclass defaults are the same job: test_config.py).
    assert launcher["job"]["config_file"].endswith("train_configs/debug_model.toml")
    assert launcher["training"]["local_batch_size"] == 16 and launcher["job"]["dump_folder"] == "./outputs/debug"


@pytest.mark.slow  # four launches, both modes: 13-16 s of the default tier
def test_config_file_env_and_an_explicit_config_file_mean_the_same_in_both_modes(tmp_path):
    mine = tmp_path / "mine.toml"
    mine.write_text("[training]\nsteps = 7\n")
    env_launcher = printed_config(bash_mode("--job.print_config", CONFIG_FILE=str(mine)))
    env_torchrun = printed_config(python_mode("--job.print_config", CONFIG_FILE=str(mine)))
    assert env_torchrun == env_launcher and env_launcher["training"]["steps"] == 7
    assert env_launcher["job"]["config_file"] == str(mine)
    # A --job.config_file on the command line wins over CONFIG_FILE, in either spelling.
    other = tmp_path / "other.toml"
    other.write_text("[training]\nsteps = 9\n")
    for args in (["--job.config_file", str(other)], [f"--job.config_file={other}"]):
        launcher = printed_config(bash_mode("--job.print_config", *args, CONFIG_FILE=str(mine)))
        torchrun = printed_config(python_mode("--job.print_config", *args, CONFIG_FILE=str(mine)))
        assert torchrun == launcher and launcher["training"]["steps"] == 9, args


@pytest.mark.parametrize("ngpu", ["1", "2"])
def test_help_is_printed_once(ngpu):
    proc = bash_mode("--help", NGPU=ngpu)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("usage: run_train.sh") == 1, proc.stdout[:500]
    assert "--training.steps" in proc.stdout


@pytest.mark.slow
def test_help_under_torchrun_is_printed_once():
    proc = python_mode("--help", nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("usage: run_train.sh") == 1


def test_the_launcher_is_python_without_warnings():
    """torchrun runs run_train.sh with Python: its bash half must not make Python warn (an escape such as
    a backslash before a dollar sign is a SyntaxWarning from Python 3.12 on, printed by every worker)."""
    with open(ROOT / "run_train.sh") as f:
        source = f.read()
    proc = subprocess.run([sys.executable, "-W", "error", "-c", "import sys; compile(sys.stdin.read(), 'run_train.sh', "
                           "'exec')"], input=source, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("env", [{"NGPU": "0"}, {"NGPU": "-2"}, {"NGPU": "abc"}, {"NGPU": "08"},
                                 {"NGPU": "99999999999999999999"}, {"NNODES": "0"}, {"NNODES": "abc"},
                                 {"LOG_RANK": "abc"}, {"LOG_RANK": "-1"}, {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "abc"}])
def test_a_bad_ngpu_or_nnodes_is_one_line(env):
    """Checked by bash before Python starts: one line naming the variable and what it may be, exit 2."""
    proc = bash_mode("--job.print_config", **env)
    (name, value), = env.items()
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {name}={value!r}: "), proc.stderr
    assert "whole number" in lines[0] and proc.stdout == ""


def test_a_python_that_is_not_there_is_one_line():
    proc = bash_mode("--job.print_config", PYTHON="/nonexistent/python3")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == ["error: PYTHON='/nonexistent/python3': no such command; set PYTHON to "
                                                "the Python that has titanlike's packages (default python3)"]


def test_a_bad_log_rank_is_one_line_from_the_trainer_too(monkeypatch, capsys):
    """`titanlike-train` (no launcher to check it first): one line, exit 2."""
    from titanlike import train

    monkeypatch.setenv("LOG_RANK", "first")
    assert train.main(["--job.print_config"]) == 2
    err = capsys.readouterr().err
    assert err == "error: LOG_RANK='first': must be a whole number, the rank whose log is printed (default 0)\n"


def test_help_into_a_closed_pipe_is_no_traceback(monkeypatch, capsys, tmp_path):
    """`./run_train.sh --help | head -3`: the reader goes away before the help is written."""
    from titanlike import preflight

    pipe = closed_pipe(tmp_path)
    for args in (["--help"], ["--job.print_config"]):
        monkeypatch.setattr(sys, "stdout", pipe)
        assert preflight.main(args) == preflight.PRINTED
        monkeypatch.undo()
    os.close(pipe.stand_in)
    assert "Traceback" not in capsys.readouterr().err


def test_a_world_size_of_zero_is_one_line(monkeypatch, capsys):
    from titanlike import preflight

    monkeypatch.setenv(preflight.WORLD_ENV, "0")
    assert preflight.main(["--job.dump_folder", "/nonexistent-dump"]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_titanlike_train_help_names_the_command_typed_and_survives_a_closed_pipe(tmp_path, monkeypatch, capsys):
    """`titanlike-train --help` said `usage: run_train.sh`; `titanlike-train --help | head -1` ended in a
    BrokenPipeError traceback (the preflight's help did not)."""
    import logging

    from titanlike import train

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # what main() would set, put back
    handlers, level = list(logging.root.handlers), logging.root.level
    try:
        for argv0, usage in (("/usr/bin/titanlike-train", "usage: titanlike-train "),
                             ("/repo/run_train.sh", "usage: run_train.sh ")):  # torchrun runs the launcher's file
            monkeypatch.setattr(sys, "argv", [argv0])
            assert train.main(["--help"]) == 0
            assert capsys.readouterr().out.startswith(usage)
        pipe = closed_pipe(tmp_path)
        for args in (["--help"], ["--job.print_config"]):
            monkeypatch.setattr(sys, "stdout", pipe)
            assert train.main(args) == 0
            monkeypatch.setattr(sys, "stdout", sys.__stdout__)
        os.close(pipe.stand_in)
    finally:
        logging.root.handlers[:] = handlers
        logging.root.setLevel(level)
    assert "Traceback" not in capsys.readouterr().err
