"""scripts/bench_checkpoint_hash.py: the save it times checksums with the hash it names."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

from conftest import run_python

ROOT = Path(__file__).resolve().parent.parent


def load_bench():
    path = ROOT / "scripts" / "bench_checkpoint_hash.py"
    spec = importlib.util.spec_from_file_location("bench_checkpoint_hash", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_timed_save_checksums_every_file_with_the_hash_it_names(tmp_path):
    """The numbers of docs/benchmarks/2026-12-02-checkpoint-hash-cost.md are whole saves (StepWriter.write) with the
    manifest's large-file checksum swapped: the candidate reads every byte of every file the save writes, and the
    manifest's own CRC-32 is back afterwards."""
    from titanlike.checkpoint import manifest

    bench = load_bench()
    read: list[int] = []

    def counting():
        return lambda piece: read.append(len(piece))

    states = {"model": {"w": torch.ones(3 * 2**20 // 4), "b": torch.ones(5)}}
    best = bench.saves(states, tmp_path, ["crc32 (zlib)", "counting"], {"crc32 (zlib)": None, "counting": counting},
                       repeat=1)
    assert set(best) == {"crc32 (zlib)", "counting"} and all(0 < s < 60 for s in best.values())
    step = tmp_path / "ckpt" / "step-2"  # the counting save, the second
    written = sum(os.path.getsize(step / n) for n in os.listdir(step) if n != manifest.MANIFEST)
    assert sum(read) == written > 3 * 2**20
    assert manifest.file_crc32 is not None and manifest.file_crc32.__module__ == "titanlike.checkpoint.manifest"
    assert run_python("scripts/bench_checkpoint_hash.py", "--help").returncode == 0
