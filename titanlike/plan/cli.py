"""`titanlike-plan --job.config_file F --world N [--section.key value ...]`: the per-GPU memory of a run by
category, the cards it fits on, and for those it does not, the levers that would make it fit, cheapest
first. No torch: it answers in about a second on any machine."""

from __future__ import annotations

import dataclasses
import sys

from titanlike.config import JobConfig, load_config
from titanlike.config.dims import parallel_dims
from titanlike.config.resolve import resolve_model
from titanlike.errors import UserError, error_exit
from titanlike.model.shape import count_params
from titanlike.plan.estimate import CONTEXT_GIB, NCCL_GIB, estimate_run
from titanlike.plan.fit import AUTO_MARGIN, card_target, fit, fit_to_target, kept_words, usable_gib

USAGE = ("usage: titanlike-plan --job.config_file FILE --world N [--section.key value ...]\n"
         "  the per-GPU memory of that run at N GPUs, the cards it fits, and the levers that would make it fit")

# Cards by the memory torch sees on them (GiB): RTX 4090, RTX 5090, H100 80GB, H200.
CARDS = ((24, "24 GB (RTX 4090)", 23.99), (32, "32 GB (RTX 5090)", 31.84), (80, "80 GB (H100)", 79.65),
         (141, "141 GB (H200)", 140.4))


def split_world(argv: list[str]) -> tuple[int, list[str]]:
    """--world N (or --world=N) out of the arguments; the rest are the run's options."""
    world, rest, i = 1, [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--world" or arg.startswith("--world="):
            text = arg.partition("=")[2] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 1 if "=" in arg else 2
            if not (text.isdigit() and 1 <= int(text) <= 2**24):
                raise UserError(f"--world {text!r}: the number of GPUs must be a whole number >= 1")
            world = int(text)
            continue
        rest.append(arg)
        i += 1
    return world, rest


def report(argv: list[str]) -> str:
    from titanlike import overrides

    world, rest = split_world(argv)
    cfg = on_gpus(load_config(rest, world))
    overrides.chosen_names(cfg.parallel.overrides)  # the names training would refuse, refused here too
    args = resolve_model(cfg).args
    dims = parallel_dims(cfg, world)
    biggest = estimate_run(cfg, world, CARDS[-1][2])
    t = cfg.training
    lines = [f"{cfg.model.flavor}: {count_params(args)[0] / 1e9:.2f}B parameters, {world} GPU(s) "
             f"(dp_shard {dims.dp_shard}), micro-batch {t.local_batch_size} × {cfg.data.seq_len} tokens × "
             f"{dims.accum_steps} per step, float8 {cfg.fp8.recipe}, compile {'on' if cfg.compile.enable else 'off'}",
             "", f"per GPU, at the peak of a step (GiB; FSDP settings as on a {CARDS[-1][1]} card):"]
    width = max(len(n) for n, _ in biggest.rows)
    lines += [f"  {name:<{width}}  {gib:7.2f}" for name, gib in biggest.rows]
    lines += [f"  {'peak reserved (estimate, ±10 %)':<{width}}  {biggest.reserved_gib:7.2f}"]
    lines += [f"  ({note})" for note in biggest.notes]
    lines += ["", f"fits on (what torch can allocate: the card less {CONTEXT_GIB:g} GiB for the CUDA context"
              + (f" and {NCCL_GIB:g} for NCCL" if world > 1 else "") + f"; with room: the estimate at most "
              f"{1 - AUTO_MARGIN:.0%} of that, as --training.fit_gib auto leaves it):"]
    for _, name, card in CARDS:
        lines.append(f"  {name}: {card_line(cfg, rest, world, card)}")
    if t.fit_gib and t.fit_gib != "auto":  # auto: the card lines above
        try:
            lines += ["", fit_to_target(cfg, rest, world)[1] or ""]
        except UserError as e:
            lines += ["", str(e)]
    lines += ["", "levers: --training.fit_gib G (or auto: the card) picks the fastest that fit; docs/memory.md lists "
              "each with its cost"]
    return "\n".join(lines)


def on_gpus(cfg: JobConfig) -> JobConfig:
    """The run as it would train on the cards this plans for, whatever machine asks (one without a GPU
    would train on its CPU, where some levers do not apply)."""
    return dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, device="cuda"))


def card_line(cfg: JobConfig, argv: list[str], world: int, card_gib: float) -> str:
    """What a card takes: the run as it is (with room, tight, or not at all), and what `--training.fit_gib auto`
    chooses there where it would change the run."""
    usable = usable_gib(card_gib, world)
    target = card_target(usable, "")
    best, every, given = fit(cfg, argv, world, target, card_gib=card_gib)
    now = every[0].reserved_gib
    if now <= target.gib:
        return f"fits, with room ({now:.1f} of {usable:.1f} GiB)"
    verdict = (f"fits by the estimate, closer than its error ({now:.1f} of {usable:.1f} GiB)" if now <= usable else
               f"does not fit ({now:.1f} GiB; {usable:.1f} usable)")
    if best is None:
        smallest = min(every, key=lambda f: f.reserved_gib)
        return (f"{verdict}; no lever is enough (at best {smallest.reserved_gib:.1f} GiB with "
                f"{' '.join(smallest.flags) or 'none of them'}; {kept_words(given)})")
    return (f"{verdict}; --training.fit_gib auto chooses {' '.join(best.flags)} → {best.reserved_gib:.1f} GiB, "
            f"about {best.speed:.0%} of the speed ({kept_words(given)})")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    try:
        print(report(argv))
    except UserError as e:
        return error_exit(e)
    return 0


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()
