"""Draw a run's metrics.jsonl as one PNG: loss (train and validation), per-source loss, gradient norm,
learning rate, tokens/s and GPU memory (a GPU run's), against the step; resumes, rollbacks and the
switch to a long-context stage are marked on every panel. The loss axis leaves out the first logged
steps' loss when it would squash the rest (the line runs off the top).

    python scripts/plot_metrics.py RUN_FOLDER [--out FILE.png]     (default RUN_FOLDER/metrics.png)

For people who would rather look at a run than read its records. It uses matplotlib, an optional extra
(`pip install 'titanlike[plot]'`): axes, ticks, legends and PNG encoding by hand would be far more code
than the drawing itself.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import NoReturn

EXTRA = "pip install 'titanlike[plot]'"


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        fail(f"{message} (see {self.prog} --help)")


def fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def read_records(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    if not folder.is_dir():
        fail(f"{folder} is not a folder: give a run's job.dump_folder")
    if not path.is_file():
        fail(f"{folder} has no metrics.jsonl: give the job.dump_folder of a run that logged at least one step")
    records = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue  # a torn last line of a run that was stopped mid-write
        if isinstance(r, dict) and isinstance(r.get("step"), int):
            records.append(r)
    if not records:
        fail(f"{path} holds no records yet")
    return records


def series(records: list[dict], kind: str, key: str, source: str | None = None) -> tuple[list[int], list[float]]:
    """(steps, values) of one numeric key of one kind of record (of one source's records, if given)."""
    points = [(r["step"], r[key]) for r in records
              if r.get("kind") == kind and r.get("source") == source and isinstance(r.get(key), (int, float))
              and math.isfinite(r[key])]
    return [s for s, _ in points], [v for _, v in points]


def by_source(records: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
    """Per-source loss lines: each source's validation loss (`"source": NAME` records) and any train-record
    dict of losses by source name (a key starting with `loss`)."""
    lines: dict[str, tuple[list[int], list[float]]] = {}
    for name in sorted({r["source"] for r in records if r.get("kind") == "val" and isinstance(r.get("source"), str)}):
        lines[f"val {name}"] = series(records, "val", "loss", name)
    for r in records:
        if r.get("kind") != "train":
            continue
        for key, values in r.items():
            if key.startswith("loss") and isinstance(values, dict):
                for name, x in values.items():
                    if isinstance(x, (int, float)) and math.isfinite(x):
                        steps, ys = lines.setdefault(f"train {name}", ([], []))
                        steps.append(r["step"])
                        ys.append(x)
    return lines


def events(records: list[dict]) -> list[tuple[float, str]]:
    """(step, what) of each mark: a resume (the first record of a resumed process says `resumed_from`),
    a rollback (its own record) and a stage switch (a train record's `stage` changing); at the step the
    change happened after."""
    found: list[tuple[float, str]] = []
    stage = None
    for r in records:
        if r.get("kind") == "train" and isinstance(r.get("resumed_from"), int):
            found.append((r["resumed_from"] + 0.5, f"resumed from step {r['resumed_from']}"))
        if r.get("kind") == "rollback" and isinstance(r.get("to_step"), int):
            found.append((r["step"] - 0.5, f"rolled back to step {r['to_step']}"))
        if r.get("kind") == "train" and r.get("stage") is not None:
            if stage is not None and r["stage"] != stage:
                found.append((r["step"] - 0.5, f"stage {r['stage']}: seq_len {r.get('seq_len', '?')}"))
            stage = r["stage"]
    return found


def loss_limits(ys: list[float]) -> tuple[float, float] | None:
    """The loss axis's range when the first logged losses (a fresh model's, several times the rest) would
    squash the rest: up to the largest after the first tenth of the points; None to let the axis fit all."""
    later = ys[max(1, len(ys) // 10):]
    if len(ys) < 5 or max(ys) <= 1.5 * max(later):
        return None
    low, high = min(ys), max(later)
    margin = 0.05 * (high - low or high or 1.0)
    return low - margin, high + margin


def draw(records: list[dict], title: str, out: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        fail(f"drawing needs matplotlib, which is not installed: {EXTRA}")
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8), constrained_layout=True)
    fig.suptitle(title)
    panels = [
        ("loss", [("train", series(records, "train", "loss")), ("val", series(records, "val", "loss"))]),
        ("loss by source", list(by_source(records).items())),
        ("gradient norm (before clipping)", [("train", series(records, "train", "grad_norm"))]),
        ("learning rate", [("lr", series(records, "train", "lr"))]),
        ("tokens/s per device", [("tokens/s", series(records, "train", "tps"))]),
        ("GPU memory peak (GiB)", [("reserved", series(records, "train", "mem_reserved_gib")),
                                   ("active", series(records, "train", "mem_active_gib"))]),
    ]
    empty = {"loss by source": "one data source\n(no data.mix)",
             "tokens/s per device": "not yet measured\n(from the second log step)"}
    if not any(xy[0] for _, xy in panels[-1][1]):
        panels.pop()  # a CPU run records no GPU memory: no panel for it
        axes.flat[-1].set_visible(False)
    marks = events(records)
    for ax, (name, lines) in zip(axes.flat, panels):
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        drawn = [(label, xy) for label, xy in lines if xy[0]]
        colors: dict[str, str] = {}
        for label, (steps, ys) in drawn:
            # Per source: one colour for a source's train and val lines, val dashed.
            color = colors.setdefault(label.split(" ", 1)[-1], f"C{len(colors)}") if name == "loss by source" else None
            ax.plot(steps, ys, label=label, color=color, linestyle="--" if label.startswith("val") else "-",
                    marker="o" if len(steps) < 20 else None, markersize=3)
        if not drawn:
            ax.text(0.5, 0.5, empty.get(name, "not recorded"), ha="center", va="center", transform=ax.transAxes,
                    color="gray")
            ax.set(xticks=[], yticks=[], xlabel="")
            continue
        for step, what in marks:
            ax.axvline(step, color="gray", linestyle=":", linewidth=1, label=what if name == "loss" else None)
        if name == "loss" and (limits := loss_limits(series(records, "train", "loss")[1])):
            ax.set_ylim(*limits)
        if name.startswith(("tokens/s", "GPU memory")):
            ax.set_ylim(bottom=0)  # a rate or an amount: from zero, so noise does not look like a trend
        if len(drawn) > 1 or (name == "loss" and marks):
            ax.legend(fontsize="small")
        if name == "learning rate":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    try:
        fig.savefig(out, dpi=100)
    except OSError as e:
        fail(f"cannot write {out}: {e.strerror or e}")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    # The first paragraph whole (its first line alone stopped mid-sentence), the rest after the options.
    first, _, rest = __doc__.partition("\n\n")
    parser = ArgumentParser(description=first, epilog=rest,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="a run's job.dump_folder (holding metrics.jsonl)")
    parser.add_argument("--out", type=Path, help="the PNG to write (default RUN/metrics.png)")
    args = parser.parse_args(argv)
    out = args.out or args.run / "metrics.png"
    if out.suffix.lower() != ".png":
        fail(f"--out {out}: the picture is a PNG; give a file name that ends in .png")
    records = read_records(args.run)
    draw(records, f"{args.run.resolve().name}: {len(records)} records, to step {records[-1]['step']}", out)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
