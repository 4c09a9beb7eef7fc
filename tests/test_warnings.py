"""The default tier prints no warnings: those nobody here can act on are filtered in pyproject.toml's pytest
settings, and titanlike's own are quieted where they are said (tests/test_profiling.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT, _env

# What trips each filtered warning, in a process of its own (torch's import-time warnings come once a process).
TRIGGERS = '''
import torch


def test_a_one_process_checkpoint(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path / "step"))
    dcp.load({"w": torch.zeros(2)}, checkpoint_id=str(tmp_path / "step"))


def test_importing_torch_compile():
    import torch._inductor.compile_fx  # noqa: F401
'''


@pytest.mark.slow
def test_the_filtered_warnings_are_not_shown(tmp_path):
    """The default tier printed 37 warnings, none actionable: DCP's in one process (22) and torch.jit's
    deprecation inside torch's own inductor (14), beside the profiler's (quieted at its source)."""
    (tmp_path / "test_triggers.py").write_text(TRIGGERS)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
                           str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path), str(tmp_path)],
                          env=_env(), capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert "2 passed" in summary and "warning" not in summary, proc.stdout[-3000:]
