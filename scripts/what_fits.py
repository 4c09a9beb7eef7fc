"""What fits on 32 and 80 GB cards, by titanlike-plan's estimate: the largest preset each GPU count trains
(with the fastest memory levers that make it fit, CPU offload aside) and the longest window `1b` trains
with one window a GPU. Estimates (±10 %, tests/test_plan.py holds them to recorded peaks), not measurements; each row
prints the titanlike-plan command that shows its breakdown. The window column is the weakest: with full
recompute at long windows the estimate was half the measured peak (docs/memory.md).

    python scripts/what_fits.py            # the README's "what fits" table, as Markdown

No GPU and no torch: it answers in seconds.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from titanlike.config import load_config  # noqa: E402
from titanlike.plan.cli import CARDS as PLAN_CARDS  # noqa: E402
from titanlike.plan.fit import card_target, fit, usable_gib  # noqa: E402

# The cards titanlike-plan answers for, by the memory torch sees on them: the same budget for each.
CARDS = {name: gib for size, name, gib in PLAN_CARDS if size in (32, 80)}
GPUS = (1, 2, 8)
# Each preset in the config that trains it: its sequence length and batch.
PRESETS = [("70b", "train_configs/llama3_70b.toml", []),
           ("8b", "train_configs/llama3_8b.toml", []),
           ("3b", "train_configs/llama3_1b.toml", ["--model.flavor", "3b"]),
           ("1b", "train_configs/llama3_1b.toml", []),
           ("124m", "train_configs/llama3_1b.toml", ["--model.flavor", "124m"])]
ANY_WORLD = ["--parallel.dp_shard", "-1", "--parallel.dp_replicate", "1"]  # 70b's config fixes its degrees
SEQS = (8192, 16384, 32768, 65536, 131072, 262144)  # the longest tried: 262,144


def fits(argv: list[str], world: int, card_gib: float):
    """What `--training.fit_gib auto` chooses for `argv` on `world` cards of `card_gib` (None if no lever
    combination fits): titanlike-plan's answer for that card."""
    # CPU offload left out: what it needs is host memory (16 bytes a parameter), which this table does not know.
    cfg = load_config([*argv, "--training.device", "cuda"])  # the cards' run, on any machine
    best, _, _ = fit(cfg, argv, world, card_target(usable_gib(card_gib, world), ""), keep=("parallel.cpu_offload",),
                     card_gib=card_gib)
    return best


def command(argv: list[str], world: int) -> str:
    return "`titanlike-plan " + " ".join(argv) + f" --world {world}`"


def describe(best) -> str:
    levers = " ".join(best.flags) or "as configured"
    return f"{best.reserved_gib:.0f} GiB, {levers}, about {best.speed:.0%} of the speed"


def main() -> None:
    print("| card | GPUs | largest preset that fits (config's shape) | longest `1b` window, one a GPU | "
          "titanlike-plan command |")
    print("|---|---:|---|---|---|")
    for card, gib in CARDS.items():
        for world in GPUS:
            largest = "none"
            shown: list[str] = []
            for name, config, extra in PRESETS:
                argv = ["--job.config_file", config, *extra, *ANY_WORLD]
                best = fits(argv, world, gib)
                if best is not None:
                    largest, shown = f"`{name}`: {describe(best)}", argv
                    break
            longest = "none"
            for seq in SEQS:
                argv = ["--job.config_file", "train_configs/llama3_1b.toml", "--data.seq_len", str(seq),
                        "--model.max_seq_len", str(seq), "--training.local_batch_size", "1",
                        "--training.global_batch_size", str(world)]
                best = fits(argv, world, gib)
                if best is None:
                    break
                longest = f"{seq:,}: {describe(best)}"
            print(f"| {card} | {world} | {largest} | {longest} | {command(shown, world) if shown else ''} |")


if __name__ == "__main__":
    main()
