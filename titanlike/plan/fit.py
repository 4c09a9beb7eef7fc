"""The fastest combination of levers whose estimate fits a memory target: `--training.fit_gib`, the
card lines of titanlike-plan and scripts/what_fits.py, one answer from one function (`fit`).

A target is a number of GiB a GPU (`--training.fit_gib 70`), or a card (`--training.fit_gib auto`: the GPU
the run is on, or each card titanlike-plan names): what torch can allocate there less AUTO_MARGIN.

Every combination of one value (or none) per lever key is estimated (a few hundred at most, plain
arithmetic), each at every training stage; the fastest that fits wins, the smaller estimate breaking ties.
Keys the command line sets are never changed, nor keys a TOML file sets where the lever would change what
is trained (the moments' dtype); the TOML file's other keys (recompute, loss chunks, micro-batch, resharding,
offload) only trade speed for memory, and a fit may move them further that way.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from titanlike.config import loader, validate
from titanlike.config.dims import parallel_dims
from titanlike.config.schema import JobConfig
from titanlike.errors import UserError
from titanlike.plan.estimate import CONTEXT_GIB, NCCL_GIB, Estimate, estimate_run
from titanlike.plan.levers import AC_ORDER, CHOICES, Choice, ac_value, apply, flags, micro_batch_choices


@dataclass(frozen=True)
class Fit:
    cfg: JobConfig
    """The config with the chosen levers applied."""
    choices: tuple[Choice, ...]
    """The levers chosen, cheapest first."""
    speed: float
    """The share of the run's tokens/s left after their costs."""
    estimate: Estimate
    flags: tuple[str, ...]

    @property
    def reserved_gib(self) -> float:
        return self.estimate.reserved_gib


# The estimate is within 10 % of every measured peak it is tested against (tests/test_plan.py): a run beyond
# that over what a GPU can allocate, with every lever, is refused (out_of_reach).
MARGIN = 0.10
# What `fit_gib = auto` leaves of a card for the estimate's error: most recorded peaks are within 5 % of it,
# and the ones it underestimates by more are long windows with full recompute under cp (docs/memory.md).
AUTO_MARGIN = 0.05


@dataclass(frozen=True)
class Target:
    gib: float
    """The most the estimate may be, per GPU."""
    words: str
    """How a line names it."""


def gib(x: float) -> str:
    """GiB as a line says them: three figures, and whole GiB with thousands separated from 1,000 up (not 1.81e+03)."""
    return f"{x:,.0f}" if x >= 999.5 else f"{x:.3g}"


def usable_gib(card_gib: float, world: int) -> float:
    """What torch can allocate on a card: its memory less the CUDA context and workspaces, and NCCL's
    buffers with more than one GPU."""
    return card_gib - CONTEXT_GIB - (NCCL_GIB if world > 1 else 0.0)


def card_target(usable: float, where: str) -> Target:
    """`fit_gib = auto` on a GPU that can allocate `usable` GiB (`where` names it)."""
    return Target(usable * (1 - AUTO_MARGIN), f"training.fit_gib = auto ({where}: {gib(usable)} GiB usable, less "
                                              f"{AUTO_MARGIN:.0%} for the estimate's error)")


def run_target(cfg: JobConfig, world: int, card: tuple[str, float] | None) -> Target | None:
    """training.fit_gib's target for this run on `card` ((name, GiB) of its GPU, None where unknown), or None:
    fit_gib off; `auto` on the CPU, which has no GPU to fit; `auto` where the card is unknown (the launcher
    without nvidia-smi: the trainer, which asks torch, fits then). UserError (one line) for a number of GiB on
    the CPU (the levers and the estimate are a GPU's)."""
    from titanlike.config.host import runs_on_cpu

    value = cfg.training.fit_gib
    if not value or (value == "auto" and runs_on_cpu(cfg.training.device)):
        return None
    if runs_on_cpu(cfg.training.device):
        raise UserError(f"training.fit_gib = {value:g} fits a run into GPU memory, and this run trains on the CPU (no "
                        f"GPU is visible, or training.device = cpu): run it where its GPUs are, or leave fit_gib 0")
    if value != "auto":
        return Target(float(value), f"training.fit_gib = {value:g}")
    cap = cfg.training.gpu_memory_limit_gib
    if cap:
        return card_target(cap, f"training.gpu_memory_limit_gib = {cap:g}")
    if card is None:
        return None
    name, card_gib = card
    return card_target(usable_gib(card_gib, world), f"this host's {name}")


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


def kept_keys(argv: list[str], keep: tuple[str, ...] = ()) -> set[str]:
    """The lever keys a fit leaves as they are: the command line's, the TOML file's that change what is trained,
    and `keep`."""
    exact = {c.key for c in CHOICES if c.exact} | {"training.local_batch_size", "training.global_batch_size"}
    exact |= {f"activation_checkpoint.{k}" for k in ("selective_ac_option", "selective_ac_blocks", "memory_budget")}
    return given_keys(argv, with_file=False) | (given_keys(argv) - exact) | set(keep)


def candidates(cfg: JobConfig, given: set[str]) -> list[list[Choice | None]]:
    """For each lever key the user left to us, the values that would lower memory (None: leave it)."""
    by_key: dict[str, list[Choice | None]] = {}
    ac_now = ac_value(cfg)
    for c in (*CHOICES, *micro_batch_choices(cfg.training.local_batch_size)):
        if c.key in given or not c.usable(cfg):
            continue
        if c.key == "activation_checkpoint.mode":
            if ({"activation_checkpoint.selective_ac_option", "activation_checkpoint.selective_ac_blocks",
                 "activation_checkpoint.memory_budget"} & given
                    or ac_now not in AC_ORDER or AC_ORDER.index(str(c.value)) <= AC_ORDER.index(ac_now)):
                continue
        elif c.key == "training.loss_chunk_tokens":
            now = cfg.training.loss_chunk_tokens
            if now and int(str(c.value)) >= now:  # only smaller chunks than the run's
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
    chunk_cost_now = next((c.cost_at(world) for c in CHOICES if c.key == "training.loss_chunk_tokens"
                           and c.value == cfg.training.loss_chunk_tokens), 0.0)
    out = []
    for combo in itertools.product(*candidates(cfg, given)):
        chosen = tuple(sorted((c for c in combo if c is not None), key=lambda c: c.cost_at(world)))
        new: JobConfig | None = cfg
        speed = 1.0
        for c in chosen:
            new = apply(new, c, global_batch) if new is not None else None
            # A mode or chunk size replaces the run's own: only what it costs beyond that one counts.
            now = (ac_cost_now if c.key == "activation_checkpoint.mode" else
                   chunk_cost_now if c.key == "training.loss_chunk_tokens" else 0.0)
            speed *= 1 - max(0.0, c.cost_at(world) - now)
        if new is None:
            continue
        out.append(Fit(new, chosen, speed, estimate_run(new, world, card_gib), tuple(flags(cfg, chosen, global_batch))))
    return out


def best_fit(cfg: JobConfig, world: int, target: Target, given: set[str],
             card_gib: float | None = None) -> tuple[Fit | None, list[Fit]]:
    """The fastest combination whose estimate is at most the target (None if none is), and all of them."""
    every = combinations(cfg, world, given, card_gib or target.gib)
    if every[0].reserved_gib <= target.gib:  # the run as configured fits: change nothing
        return every[0], every
    fitting = [f for f in every if f.reserved_gib <= target.gib]
    # Fastest first; at the same speed the smallest estimate (a free lever buys room for the estimate's error).
    best = min(fitting, key=lambda f: (-round(f.speed, 6), f.reserved_gib, len(f.choices)), default=None)
    return best, every


def fit(cfg: JobConfig, argv: list[str], world: int, target: Target, keep: tuple[str, ...] = (),
        card_gib: float | None = None) -> tuple[Fit | None, list[Fit], set[str]]:
    """What a fit to `target` chooses for the run of `argv` (parsed: `cfg`): (the fit or None, every
    combination, the lever keys kept)."""
    given = kept_keys(argv, keep)
    best, every = best_fit(cfg, world, target, given, card_gib)
    return best, every, given


def _in_stage(estimate: Estimate) -> str:
    return f" ({estimate.stage})" if estimate.stage else ""


def kept_words(given: set[str]) -> str:
    kept = sorted(given & ({c.key for c in CHOICES} | {"training.local_batch_size"}))
    return f"levers you set are kept: {', '.join(kept) or 'none'}"


def fit_to_target(cfg: JobConfig, argv: list[str], world: int,
                  card: tuple[str, float] | None = None) -> tuple[JobConfig, str | None]:
    """training.fit_gib: the config with the fastest levers whose estimate fits, and the line that says what
    was chosen and why (None when there is no fit: run_target). UserError (one line) when no combination fits."""
    target = run_target(cfg, world, card)
    if target is None:
        return cfg, None
    best, every, given = fit(cfg, argv, world, target)
    now = every[0].estimate
    if best is None:
        smallest = min(every, key=lambda f: f.reserved_gib)
        singles = [f for f in every if len(f.choices) == 1]
        closest = min(singles, key=lambda f: f.reserved_gib, default=None)
        lever = (f"; the lever that comes closest alone is {' '.join(closest.flags)} ({gib(closest.reserved_gib)} GiB)"
                 if closest else "")
        raise UserError(f"{target.words}: no combination of levers fits {gib(target.gib)} GiB; the smallest estimate "
                        f"is {gib(smallest.reserved_gib)} GiB per GPU{_in_stage(smallest.estimate)} (with "
                        f"{' '.join(smallest.flags) or 'none'}){lever} ({kept_words(given)})")
    if not best.choices:
        return cfg, (f"{target.words}: the run as configured fits (estimate {gib(now.reserved_gib)} GiB per GPU"
                     f"{_in_stage(now)}); no lever needed")
    validate(best.cfg)  # each lever is a valid setting; the combination must be one too
    return best.cfg, (f"{target.words}: the run as configured needs about {gib(now.reserved_gib)} GiB per GPU"
                      f"{_in_stage(now)}; chose {' '.join(best.flags)} (estimate {gib(best.reserved_gib)} GiB, "
                      f"about {best.speed:.0%} of the speed): the fastest levers that fit (titanlike-plan shows the "
                      f"rest)")


def fitted(cfg: JobConfig, argv: list[str], world: int, say=None, card: tuple[str, float] | None = None) -> JobConfig:
    """fit_to_target for the trainer and the preflight: the fitted config, its line passed to `say`."""
    cfg, line = fit_to_target(cfg, argv, world, card)
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
            f"{gib(smallest.reserved_gib)} GiB per GPU{_in_stage(smallest.estimate)} (with "
            f"{' '.join(smallest.flags) or 'every lever as set'}), more than {MARGIN:.0%} over the {gib(usable)} GiB "
            f"torch can allocate there: shorten data.seq_len, raise parallel.cp or add GPUs (titanlike-plan shows "
            f"where the memory goes)")
