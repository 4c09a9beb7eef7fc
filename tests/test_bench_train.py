"""scripts/bench_train.py: how a variant's words are read."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def load_bench_train():
    path = Path(__file__).resolve().parent.parent / "scripts" / "bench_train.py"
    spec = importlib.util.spec_from_file_location("bench_train", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_leading_assignments_are_the_variants_environment():
    split_env = load_bench_train().split_env
    env, words = split_env(["NCCL_MAX_CTAS=16", "TORCHINDUCTOR_X=a=b", "--fp8.recipe", "tensorwise"])
    assert env == {"NCCL_MAX_CTAS": "16", "TORCHINDUCTOR_X": "a=b"}
    assert words == ["--fp8.recipe", "tensorwise"]
    # Only leading words, and only names in capitals: an override's own `=` is left alone.
    env, words = split_env(["--fp8.filter_fqns=output", "A=1"])
    assert env == {} and words == ["--fp8.filter_fqns=output", "A=1"]
    assert split_env(["--data.seq_len", "4096"]) == ({}, ["--data.seq_len", "4096"])
