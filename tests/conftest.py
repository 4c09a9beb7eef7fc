"""Shared test helpers: run the real launcher on the debug model with a list of CLI overrides.

Integration tests are lists of overrides, in the TorchTitan style. Every run is a subprocess
(exactly what a user starts), on CPU, with the gloo backend when it has several ranks.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# The per-machine cache (titanlike/cache.py: the built-in corpus) of this test session: a fresh
# temporary folder, so that tests neither read nor write the user's ~/.cache/titanlike.
CACHE = tempfile.mkdtemp(prefix="titanlike-test-cache-")
os.environ["TITANLIKE_CACHE"] = CACHE


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def corpus() -> tuple[str, str]:
    """The embedded corpus, built once per test session: (train shard, validation shard)."""
    from titanlike.data import build_default_corpus

    return build_default_corpus(CACHE)


def pytest_collection_modifyitems(config, items):
    """`-m gpu` tests need a CUDA GPU: without one they are skipped, so that a `-m` of one's own
    (`pytest -m "not slow"`, which replaces the default `-m 'not gpu'`) still runs on CPU."""
    import torch

    if torch.cuda.is_available():
        return
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(no_gpu)


def _env() -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    # A warm inductor cache makes repeated compile tests ~10 s instead of ~40 s.
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path.home() / ".cache" / "titanlike-inductor"))
    return env


def run_train(dump: Path, *overrides: str, nproc: int = 1, corpus: tuple[str, str] | None = None,
              check: bool = True, timeout: int = 600, device: str = "cpu") -> subprocess.CompletedProcess:
    """Train the debug model: `torchrun --nproc_per_node=nproc run_train.sh <overrides>` literally, on
    `device` (the CPU tier: cpu with gloo; the GPU tier, `-m gpu`: cuda with NCCL)."""
    args = ["--job.config_file", str(ROOT / "train_configs" / "debug_model.toml"), "--job.dump_folder", str(dump),
            "--training.device", device]
    if corpus:
        args += ["--data.path", corpus[0], "--data.val_path", corpus[1]]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "run_train.sh"), *args, *overrides]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if check and proc.returncode != 0:
        raise AssertionError(f"training failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def run_python(*args: str, check: bool = False, timeout: int = 300,
               env: dict | None = None) -> subprocess.CompletedProcess:
    """`python <args>` from the repository root (for single-process entry points and scripts)."""
    proc = subprocess.run([sys.executable, *args], env=env or _env(), capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def run_probe(script: str, out: Path, device: str = "cpu") -> dict:
    """`torchrun --nproc_per_node=2 tests/probes/<script> OUT.json DEVICE`; the JSON rank 0 wrote there."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(ROOT / "tests" / "probes" / script), str(out), device],
                          env=_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(Path(out).read_text())


def metrics(dump: Path, kind: str = "train") -> list[dict]:
    """The metrics.jsonl records of one kind (train or val), in order."""
    path = Path(dump) / "metrics.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("kind") == kind]


def losses(dump: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics(dump)}
