"""Compare training losses of runs, step by step: one table, from each run's metrics.jsonl.

    python scripts/compare_losses.py bf16=/tmp/b/bf16 delayed=/tmp/b/delayed [--every 50] [--last 10]

Prints each run's loss at every `--every`-th logged step they share, then the mean over their last
`--last` shared logged steps and its difference from the first run's. Losses of one step are the
same batch in every run (the data order depends only on the seed), so differences are the runs'.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def train_losses(folder: Path) -> dict[int, float]:
    records = (json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip())
    return {r["step"]: r["loss"] for r in records if r.get("kind") == "train" and "loss" in r}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="name=dump_folder")
    parser.add_argument("--every", type=int, default=50, help="show every this-many-th shared step")
    parser.add_argument("--last", type=int, default=10, help="average over this many last shared logged steps")
    args = parser.parse_args(argv)
    runs = {name: train_losses(Path(path)) for name, _, path in (r.partition("=") for r in args.runs)}
    steps = sorted(set.intersection(*(set(losses) for losses in runs.values())))
    if not steps:
        raise SystemExit("compare_losses: the runs share no logged step")
    print(f"{'step':>6} " + " ".join(f"{name:>12}" for name in runs))
    for step in steps:
        if step % args.every == 0 or step == steps[-1]:
            print(f"{step:>6} " + " ".join(f"{losses[step]:>12.4f}" for losses in runs.values()))
    tail = steps[-args.last:]
    means = {name: sum(losses[s] for s in tail) / len(tail) for name, losses in runs.items()}
    first = next(iter(means.values()))
    print(f"mean over steps {tail[0]}-{tail[-1]} ({len(tail)} logged): " +
          ", ".join(f"{name} {m:.4f} ({m - first:+.4f})" for name, m in means.items()))


if __name__ == "__main__":
    main()
