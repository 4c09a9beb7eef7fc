"""scripts/bench_train.py: how a variant's words are read."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest


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


def test_levers_are_valid_overrides_of_the_default_config():
    """Every lever of --levers is a set of options the trainer accepts (checked as the preflight does)."""
    import shlex

    from titanlike.config import load_config

    bench = load_bench_train()
    assert bench.LEVERS[0] == ("default", "")
    config = str(bench.ROOT / "train_configs" / "llama3_8b.toml")
    for _, overrides in bench.LEVERS:
        load_config(["--job.config_file", config, *shlex.split(overrides)])


def test_table_says_what_each_variant_saves_against_the_first():
    bench = load_bench_train()
    row = {"tps": 100.0, "mfu": None, "tflops": 1.0, "float8_share": None, "first_step_s": 1.0, "loss": 2.0}
    text = bench.table([{"variant": "default", "mem_gib": 50.0, **row},
                        {"variant": "ac_full", "mem_gib": 30.5, **row, "tps": 80.0}])
    lines = text.splitlines()
    assert "GiB saved" in lines[0]
    assert lines[3].split()[:3] == ["ac_full", "80", "0.80x"] and lines[3].split()[6:8] == ["30.5", "19.5"]


def test_levers_by_name_and_a_wrong_name_in_one_line(monkeypatch, tmp_path, capsys):
    """--levers NAME,NAME runs those levers in that order; a name that is no lever stops argparse's way."""
    bench = load_bench_train()
    ran = []
    monkeypatch.setattr(bench, "run_variant", lambda name, words, *a: ran.append((name, words)) or
                        {"variant": name, "rc": 1, "error": "not run"})
    argv = ["bench_train.py", "--workdir", str(tmp_path), "--levers", "default,ac_op_wqkv_w1"]
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()
    assert ran == [("default", []), ("ac_op_wqkv_w1", ["--activation_checkpoint.mode", "selective",
                                                         "--activation_checkpoint.selective_ac_option", "op:wqkv,w1"])]
    monkeypatch.setattr(sys, "argv", ["bench_train.py", "--levers", "default,ac_light"])
    with pytest.raises(SystemExit):
        bench.main()
    assert "--levers: no lever ac_light; the levers are default, loss_chunk_4096" in capsys.readouterr().err
