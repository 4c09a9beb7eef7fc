"""Validation loss against tokens trained, for runs of different lengths: one table, and a plot if asked.

    python scripts/tokens_to_loss.py adamw=/tmp/ttl_adamw muon=/tmp/ttl_muon/metrics.jsonl [--plot out.png]

Each run's validation losses (metrics.jsonl, `kind` val) are put at the tokens the run had trained on at
that step (the `tokens_seen` of its train records, tokens a step being the same all along). The table
gives every run's loss at each shared step that is a multiple of `--every`, then each run's last
validation loss and its tokens, and, for every run, the fewest tokens at which it had reached the lowest
last loss of the others (its first validation at or below it; "not reached" otherwise). `--plot` draws
the curves against tokens (matplotlib: pip install 'titanlike[plot]').
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import NoReturn


def fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def curve(run: Path) -> list[tuple[int, int, float]]:
    """(step, tokens, validation loss) of one run (its dump folder or its metrics .jsonl), in step order."""
    path = run if run.is_file() else run / "metrics.jsonl"
    try:
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except OSError as e:
        fail(f"{path}: {e.strerror}")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        fail(f"{path}: {e}")
    per_step = {r["step"]: r["tokens_seen"] / r["step"] for r in records
                if r.get("kind") == "train" and r.get("tokens_seen") and r.get("step")}
    if not per_step:
        fail(f"{path} has no train record with tokens_seen")
    tokens = next(iter(per_step.values()))
    if any(abs(t - tokens) > 0.5 for t in per_step.values()):
        fail(f"{path}: the tokens a step changed during the run; this table assumes they do not")
    vals = sorted((r["step"], round(r["step"] * tokens), r["loss"]) for r in records if r.get("kind") == "val")
    if not vals:
        fail(f"{path} has no validation record")
    return vals


def first_at_or_below(points: list[tuple[int, int, float]], target: float) -> int | None:
    """The tokens of the first validation at or below `target`."""
    return next((tokens for _, tokens, loss in points if loss <= target), None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="name=dump_folder (or name=its metrics .jsonl)")
    parser.add_argument("--every", type=int, default=200, help="show the shared steps that are multiples of this")
    parser.add_argument("--plot", default="", help="also draw the curves into this PNG")
    args = parser.parse_args(argv)
    runs = {name: curve(Path(path)) for name, _, path in (r.partition("=") for r in args.runs)}
    width = max(12, *(len(n) for n in runs))
    losses = {name: {step: loss for step, _, loss in points} for name, points in runs.items()}
    print(f"{'step':>6} " + " ".join(f"{name:>{width}}" for name in runs))
    for step in sorted(set().union(*(set(v) for v in losses.values()))):
        if step % args.every == 0:
            print(f"{step:>6} " + " ".join(f"{losses[n][step]:>{width}.4f}" if step in losses[n] else f"{'-':>{width}}"
                                           for n in runs))
    last = {name: points[-1] for name, points in runs.items()}
    for name, (step, tokens, loss) in last.items():
        print(f"{name}: last validation {loss:.4f} at step {step}, {tokens / 1e6:,.1f}M tokens")
    for name, points in runs.items():
        others = [(loss, other) for other, (_, _, loss) in last.items() if other != name]
        if not others:
            continue
        target, other = min(others)
        reached = first_at_or_below(points, target)
        where = "not reached"
        if reached:
            where = f"at {reached / 1e6:,.1f}M tokens ({reached / last[other][1]:.2f}x {other}'s)"
        print(f"{name} reaches {other}'s last {target:.4f}: {where}")
    if args.plot:
        draw(runs, args.plot)


def draw(runs: dict[str, list[tuple[int, int, float]]], out: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        fail("--plot needs matplotlib: pip install 'titanlike[plot]'")
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, points in runs.items():
        ax.plot([t / 1e6 for _, t, _ in points], [loss for _, _, loss in points], label=name, marker=".")
    floor = min(loss for points in runs.values() for _, _, loss in points)
    ax.set_ylim(floor * 0.97, floor * 1.6)
    ax.set_xlabel("tokens trained (millions)")
    ax.set_ylabel("validation loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"plot: {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
