"""scripts/tokens_to_loss.py: validation loss against tokens for runs of different lengths."""

from __future__ import annotations

import json

from conftest import run_python

SCRIPT = "scripts/tokens_to_loss.py"


def write_run(path, tokens_per_step: int, vals: dict[int, float]) -> None:
    rows = [{"kind": "train", "step": s, "loss": 1.0, "tokens_seen": s * tokens_per_step} for s in sorted(vals)]
    rows += [{"kind": "val", "step": s, "loss": loss} for s, loss in vals.items()]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_each_run_is_placed_at_its_tokens_and_the_first_to_reach_is_named(tmp_path):
    long, short = tmp_path / "long.jsonl", tmp_path / "short"
    write_run(long, 1000, {100: 3.0, 200: 2.0, 300: 1.5, 400: 1.2})
    short.mkdir()
    write_run(short / "metrics.jsonl", 1000, {100: 2.5, 200: 1.4, 300: 1.1})
    proc = run_python(SCRIPT, f"long={long}", f"short={short}", "--every", "100")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[4].split() == ["400", "1.2000", "-"]
    assert "long: last validation 1.2000 at step 400, 0.4M tokens" in lines
    assert "short: last validation 1.1000 at step 300, 0.3M tokens" in lines
    # short reaches long's last 1.2 at its step 300 (the first validation at or below it): 0.75x the tokens.
    assert "short reaches long's last 1.2000: at 0.3M tokens (0.75x long's)" in lines
    assert "long reaches short's last 1.1000: not reached" in lines


def test_a_run_without_validation_is_one_error_line(tmp_path):
    bare = tmp_path / "bare.jsonl"
    bare.write_text(json.dumps({"kind": "train", "step": 1, "loss": 1.0, "tokens_seen": 10}) + "\n")
    proc = run_python(SCRIPT, f"a={bare}")
    assert proc.returncode == 2 and proc.stderr == f"error: {bare} has no validation record\n"
    proc = run_python(SCRIPT, f"a={tmp_path / 'missing'}")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ")
