"""scripts/plot_metrics.py: a run's metrics.jsonl drawn as one PNG."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from conftest import ROOT, run_python, train_here

pytest.importorskip("matplotlib")

SCRIPT = "scripts/plot_metrics.py"


def test_a_short_run_draws_a_png(tmp_path):
    dump = tmp_path / "run"
    train_here(dump, "--training.steps", "6", "--training.local_batch_size", "2", "--data.seq_len", "32",
               "--metrics.log_freq", "2", "--validation.freq", "3", "--validation.steps", "1")
    out = tmp_path / "picture.png"
    proc = run_python(SCRIPT, str(dump), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1500, 800) and len(data) > 20_000  # six panels with lines, not a blank image
    # Without --out, the picture goes into the run folder.
    assert run_python(SCRIPT, str(dump)).returncode == 0 and (dump / "metrics.png").is_file()


def test_a_folder_without_metrics_is_one_line(tmp_path):
    proc = run_python(SCRIPT, str(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr == f"error: {tmp_path} has no metrics.jsonl: give the job.dump_folder of a run that " \
                          f"logged at least one step\n"
    proc = run_python(SCRIPT, str(tmp_path / "missing"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "is not a folder" in proc.stderr


def test_without_matplotlib_one_line_names_the_extra(tmp_path, monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("plot_metrics", ROOT / SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 5.0}\n')
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # an import of it fails
    with pytest.raises(SystemExit) as e:
        script.main([str(tmp_path)])
    assert e.value.code == 2
    assert capsys.readouterr().err == "error: drawing needs matplotlib, which is not installed: " \
                                      "pip install 'titanlike[plot]'\n"


def load_script():
    spec = importlib.util.spec_from_file_location("plot_metrics", ROOT / SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_an_out_that_is_not_a_png_is_one_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 5.0}\n')
    proc = run_python(SCRIPT, str(tmp_path), "--out", str(tmp_path / "x.txt"))
    assert proc.returncode == 2 and not (tmp_path / "x.txt").exists()
    assert proc.stderr == f"error: --out {tmp_path / 'x.txt'}: the picture is a PNG; give a file name that ends " \
                          f"in .png\n"


def test_resumes_rollbacks_and_stage_switches_are_marked_and_the_first_loss_does_not_squash_the_axis():
    script = load_script()
    records = [{"kind": "train", "step": s, "loss": 10.0 if s == 1 else 3.0 - s / 100, "stage": 1 if s <= 20 else 2,
                "seq_len": 256 if s <= 20 else 512} for s in range(1, 41)]
    records[24]["resumed_from"] = 24
    records.append({"kind": "rollback", "step": 33, "to_step": 30})
    assert script.events(records) == [(20.5, "stage 2: seq_len 512"), (24.5, "resumed from step 24"),
                                      (32.5, "rolled back to step 30")]
    low, high = script.loss_limits([r["loss"] for r in records if "loss" in r])
    assert high < 3.1 and low < 2.6  # the first step's 10.0 is off the top; every later loss is inside
    assert script.loss_limits([3.0, 2.9, 2.8, 2.7, 2.6, 2.5]) is None  # nothing squashed: the axis fits all


def test_help_gives_the_whole_description(capsys):
    """--help cut its description after the docstring's first line, mid-sentence."""
    script = load_script()
    with pytest.raises(SystemExit) as e:
        script.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert script.__doc__.split("\n\n")[0] in out  # the first paragraph, line for line
    assert "pip install 'titanlike[plot]'" in out  # and the rest after the options
