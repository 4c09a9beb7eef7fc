"""The fastest combination of levers whose estimate fits a memory target: `--training.fit_gib`, the
"fits with" lines of titanlike-plan and scripts/what_fits.py, one answer from one function (`fit`).

For a card, the target is what torch can allocate there less the estimate's error (MARGIN):
`card_fit_gib` is the `--training.fit_gib` a card calls for, and titanlike-plan's line for the card is
what that fit_gib chooses.

Every combination of one value (or none) per lever key is estimated (a few hundred at most, plain
arithmetic); the fastest that fits wins, the smaller estimate breaking ties. Keys the user set, in the
TOML file or on the command line, are never changed, but for a micro-batch the TOML file sets (more
micro-batches of the same global batch train the same).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from titanlike.config import loader, validate
from titanlike.config.dims import parallel_dims
from titanlike.config.schema import JobConfig
from titanlike.errors import UserError
from titanlike.plan.estimate import CONTEXT_GIB, NCCL_GIB, estimate_run
from titanlike.plan.levers import AC_ORDER, CHOICES, Choice, ac_value, apply, flags


@dataclass(frozen=True)
class Fit:
    cfg: JobConfig
    """The config with the chosen levers applied."""
    choices: tuple[Choice, ...]
    """The levers chosen, cheapest first."""
    speed: float
    """The share of the run's tokens/s left after their costs."""
    reserved_gib: float
    flags: tuple[str, ...]


# The estimate is within about 10 % of the measured peaks it is tested against (tests/test_plan.py): a
# budget leaves that much room (docs/memory.md).
MARGIN = 0.10


def gib(x: float) -> str:
    """GiB as a line says them: three figures, and whole GiB with thousands separated from 1,000 up (not 1.81e+03)."""
    return f"{x:,.0f}" if x >= 999.5 else f"{x:.3g}"


def usable_gib(card_gib: float, world: int) -> float:
    """What torch can allocate on a card: its memory less the CUDA context and workspaces, and NCCL's
    buffers with more than one GPU."""
    return card_gib - CONTEXT_GIB - (NCCL_GIB if world > 1 else 0.0)


def card_fit_gib(card_gib: float, world: int) -> int:
    """The --training.fit_gib for a card: what torch can allocate there less MARGIN, in whole GiB."""
    return int(usable_gib(card_gib, world) * (1 - MARGIN))


def given_keys(argv: list[str], with_file: bool = True) -> set[str]:
    """The `section.key`s a command line sets, itself or (`with_file`) in the TOML file its
    --job.config_file names."""
    overrides = loader.parse_cli(argv)
    keys = {f"{s}.{k}" for s, k, _ in overrides}
    files = [str(v) for s, k, v in overrides if (s, k) == ("job", "config_file") and v]
    if files and with_file:
        for section, table in loader.read_toml(files[-1]).items():
            if isinstance(table, dict):
                keys |= {f"{section}.{k}" for k in table}
    return keys


def candidates(cfg: JobConfig, given: set[str]) -> list[list[Choice | None]]:
    """For each lever key the user left to us, the values that would lower memory (None: leave it)."""
    by_key: dict[str, list[Choice | None]] = {}
    ac_now = ac_value(cfg)
    for c in CHOICES:
        if c.key in given or not c.usable(cfg):
            continue
        if c.key == "activation_checkpoint.mode":
            if ({"activation_checkpoint.selective_ac_option", "activation_checkpoint.selective_ac_blocks",
                 "activation_checkpoint.memory_budget"} & given
                    or ac_now not in AC_ORDER or AC_ORDER.index(str(c.value)) <= AC_ORDER.index(ac_now)):
                continue
        elif c.key == "training.loss_chunk_tokens" and cfg.training.loss_chunk_tokens:
            continue
        elif getattr(getattr(cfg, c.key.split(".")[0]), c.key.split(".")[1]) == c.value:
            continue
        by_key.setdefault(c.key, [None]).append(c)
    return list(by_key.values())


def combinations(cfg: JobConfig, world: int, given: set[str], card_gib: float | None) -> list[Fit]:
    """Every combination of the levers left to us, estimated; the run as configured first."""
    global_batch = parallel_dims(cfg, world).global_batch
    ac_cost_now = next((c.cost for c in CHOICES if c.key == "activation_checkpoint.mode"
                        and c.value == ac_value(cfg)), 0.0)
    out = []
    for combo in itertools.product(*candidates(cfg, given)):
        chosen = tuple(sorted((c for c in combo if c is not None), key=lambda c: c.cost_at(world)))
        new: JobConfig | None = cfg
        speed = 1.0
        for c in chosen:
            new = apply(new, c, global_batch) if new is not None else None
            speed *= 1 - (c.cost - ac_cost_now if c.key == "activation_checkpoint.mode" else c.cost_at(world))
        if new is None:
            continue
        reserved = estimate_run(new, world, card_gib).reserved_gib
        out.append(Fit(new, chosen, speed, reserved, tuple(flags(cfg, chosen, global_batch))))
    return out


def best_fit(cfg: JobConfig, world: int, target_gib: float, given: set[str],
             card_gib: float | None = None) -> tuple[Fit | None, list[Fit]]:
    """The fastest combination whose estimate is at most `target_gib` (None if none is), and all of them."""
    every = combinations(cfg, world, given, card_gib or target_gib)
    fitting = [f for f in every if f.reserved_gib <= target_gib]
    if every[0].reserved_gib <= target_gib:  # the run as configured fits: change nothing
        return every[0], every
    # Fastest first; at the same speed the smallest estimate (a free lever buys room for the estimate's error).
    best = min(fitting, key=lambda f: (-round(f.speed, 6), f.reserved_gib, len(f.choices)), default=None)
    return best, every


def fit(cfg: JobConfig, argv: list[str], world: int, target: float, keep: tuple[str, ...] = ()
        ) -> tuple[Fit | None, list[Fit], set[str]]:
    """What `--training.fit_gib target` chooses for the run of `argv` (parsed: `cfg`): (the fit or None,
    every combination, the lever keys kept). Keys the user set stay, and those of `keep`."""
    # The micro-batch a TOML file sets is how its global batch is computed, not what is trained (more
    # micro-batches accumulate the same gradient): fit may change it unless the command line sets it.
    given = given_keys(argv, with_file=False) | (given_keys(argv) - {"training.local_batch_size"}) | set(keep)
    best, every = best_fit(cfg, world, target, given)
    return best, every, given


def fit_to_target(cfg: JobConfig, argv: list[str], world: int) -> tuple[JobConfig, str | None]:
    """training.fit_gib: the config with the fastest levers whose estimate fits, and the line that says what
    was chosen and why (None when fit_gib is off). UserError (one line) when no combination fits."""
    target = cfg.training.fit_gib
    if not target:
        return cfg, None
    best, every, given = fit(cfg, argv, world, target)
    now = every[0].reserved_gib
    if best is None:
        smallest = min(every, key=lambda f: f.reserved_gib)
        singles = [f for f in every if len(f.choices) == 1]
        closest = min(singles, key=lambda f: f.reserved_gib, default=None)
        lever = (f"; the lever that comes closest alone is {' '.join(closest.flags)} ({gib(closest.reserved_gib)} GiB)"
                 if closest else "")
        raise UserError(f"training.fit_gib = {target:g}: no combination of levers fits; the smallest estimate is "
                        f"{gib(smallest.reserved_gib)} GiB per GPU (with {' '.join(smallest.flags) or 'none'}){lever}"
                        f" (levers you set are kept: {', '.join(sorted(given & {c.key for c in CHOICES})) or 'none'})")
    if not best.choices:
        return cfg, (f"training.fit_gib = {target:g}: the run as configured fits (estimate {gib(now)} GiB per GPU); "
                     f"no lever needed")
    validate(best.cfg)  # each lever is a valid setting; the combination must be one too
    return best.cfg, (f"training.fit_gib = {target:g}: the run as configured needs about {gib(now)} GiB per GPU; "
                      f"chose {' '.join(best.flags)} (estimate {gib(best.reserved_gib)} GiB, about "
                      f"{best.speed:.0%} of the speed): the fastest levers that fit (titanlike-plan shows the rest)")


def fitted(cfg: JobConfig, argv: list[str], world: int, say=None) -> JobConfig:
    """fit_to_target for the trainer and the preflight: the fitted config, its line passed to `say`."""
    cfg, line = fit_to_target(cfg, argv, world)
    if line and say is not None:
        say(line)
    return cfg


def out_of_reach(cfg: JobConfig, world: int, usable: float, where: str) -> str | None:
    """The one line that refuses a run no combination of levers fits in `usable` GiB a GPU (what torch can
    allocate: a cap, or a card less its context; `where` names it), or None. Every lever counts here, those
    the user set too, and the estimate may be high by MARGIN: only a run beyond that is refused."""
    every = combinations(cfg, world, set(), usable)
    smallest = min(every, key=lambda f: f.reserved_gib)
    if smallest.reserved_gib * (1 - MARGIN) <= usable:
        return None
    return (f"this run does not fit {where} with any combination of levers: the smallest estimate is "
            f"{gib(smallest.reserved_gib)} GiB per GPU (with {' '.join(smallest.flags) or 'every lever as set'}), "
            f"more than {MARGIN:.0%} over the {gib(usable)} GiB torch can allocate there: shorten data.seq_len, raise "
            f"parallel.cp or add GPUs (titanlike-plan shows where the memory goes)")
