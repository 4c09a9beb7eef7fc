"""scripts/bench_data.py: its variants, its table, and a smoke run on a CPU."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from conftest import run_python

ROOT = Path(__file__).resolve().parent.parent


def load_bench_data():
    spec = importlib.util.spec_from_file_location("bench_data", ROOT / "scripts" / "bench_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_variants_and_table():
    bench = load_bench_data()
    runs = bench.variants({"all": "/d/all", "a": "/d/a", "b": "/d/b", "c": "/d/c"})
    assert runs == {"one source": ["--data.path", "/d/all/train"],
                    "3 sources": ["--data.mix", "a=/d/a:0.5,b=/d/b:0.3,c=/d/c:0.2"],
                    "block_causal": ["--data.path", "/d/all/train", "--model.attn_mask", "block_causal"]}
    table = bench.table([{"model": "1b", "variant": "one source", "tps": 1000.0, "loss": 3.0},
                         {"model": "1b", "variant": "3 sources", "tps": 990.0, "loss": 3.1},
                         {"model": "1b", "variant": "block_causal", "error": "boom"}]).splitlines()
    assert table[2] == "| 1b | one source | causal | 1,000 | 1.000× | 3.000 |"
    assert table[3] == "| 1b | 3 sources (0.5/0.3/0.2) | causal | 990 | 0.990× | 3.100 |"
    assert table[4].startswith("| 1b | one source | block_causal | failed: boom")
    # Repeated one-source runs: the ratio is against their mean.
    table = bench.table([{"model": "1b", "variant": "one source", "tps": 1000.0, "loss": 3.0},
                         {"model": "1b", "variant": "block_causal", "tps": 1010.0, "loss": 3.0},
                         {"model": "1b", "variant": "one source", "tps": 1020.0, "loss": 3.0}]).splitlines()
    assert [line.split(" | ")[4] for line in table[2:]] == ["0.990×", "1.000×", "1.010×"]
    assert run_python("scripts/bench_data.py", "--help").returncode == 0
    wrong = run_python("scripts/bench_data.py", "--variants", "one source,blockcausal")
    assert wrong.returncode == 2 and "--variants blockcausal: not one of" in wrong.stderr


@pytest.mark.slow
def test_cpu_smoke_run(tmp_path):
    # One variant, the mixture (the most of the data path); the table itself is tested above.
    proc = run_python("scripts/bench_data.py", "--device", "cpu", "--models", "debug", "--steps", "3",
                      "--variants", "3 sources", "--workdir", str(tmp_path), "--out", str(tmp_path / "out.json"),
                      timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "out.json").read_text())["results"]
    assert [r["variant"] for r in results] == ["3 sources"]
    assert all(r["tps"] > 0 for r in results)
    lines = proc.stdout.strip().splitlines()
    assert lines[-3].startswith("| model | data | attention |") and "| debug | 3 sources" in lines[-1]
