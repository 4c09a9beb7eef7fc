"""Every reach of titanlike into torch's and torchao's internals, in one home.

titanlike builds on the libraries' public APIs. Where a measured gain needs a private name, the
code that uses it lives in this package and nowhere else, in two kinds:

- Overrides (OVERRIDES below): titanlike replaces what torch or torchao would do, for a gain that
  was measured. Each says what it replaces, the versions it was checked against and what it buys,
  with its record; a probe checks at start that what it relies on is there (names, signatures, and
  a torch within the checked versions, since a layout can change under an unchanged name). The
  option `parallel.overrides` chooses: on (each override whose probe passes), off (stock torch and
  torchao only), or a comma-separated list of the ones to keep. The start line says which are on,
  and which fell back to stock behaviour and why: a failed probe is never a traceback, never a
  silent wrong result.
- Private names that a feature needs where the library offers no public one (the CUDA allocator's
  history for profiling.memory_snapshot, the op names a selective-AC policy keys on, the parts of
  torchao's float8 weight wrapper, DTensor's constructor for host copies): here too, each with a
  probe and a test that fails when it moves. They are not switched: stock torch has nothing else.

docs/overrides.md is the table (what, why, versions, measured gain). This module imports no torch:
the preflight checks `parallel.overrides` with it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from titanlike.errors import UserError


@dataclass(frozen=True)
class Override:
    name: str
    """What `parallel.overrides` calls it."""
    module: str
    """The module of this package that holds it, and its probe (a function marked `@probe_for(name)`)."""
    replaces: str
    """The stock behaviour it replaces, and the private names it relies on."""
    checked: str
    """The versions it was checked against."""
    buys: str
    """What it was measured to buy, with the record."""


OVERRIDES = (
    Override(
        "gradients_in_compute_pool", "fsdp",
        "FSDP allocates the sharded gradients from its reduce-scatter stream's memory pool, which the memory "
        "backward frees on the compute stream cannot refill; through FSDP's experimental set_custom_reduce_scatter "
        "(a collective whose allocate FSDP calls for its buffers) they come from the compute stream's pool",
        "torch 2.11 (GPU runs), 2.13, 2.14 (FSDP's source read)",
        "8b on two H200s: 118.0 -> 103.5 GiB at the same speed; 1b: -2.9 GiB "
        "(docs/benchmarks/2026-11-26-8b-memory-breakdown.md)"),
    Override(
        "cp_attention_kernels", "attention",
        "context parallelism's causal attention as the window under one document's mask (flex attention on a GPU, "
        "SDPA on a CPU, over keys gathered by DTensor, which autograd keeps for backward); instead cuDNN's fused "
        "attention (GPU) or "
        "torch's fused CPU attention per chunk part, merged by log-sum-exp, in one custom op each way whose "
        "collectives run beside the parts that do not need them, the keys and values of other ranks gathered "
        "again in backward, not kept (aten._scaled_dot_product_cudnn_attention, "
        "_scaled_dot_product_flash_attention_for_cpu and their backwards, by keyword)",
        "torch 2.11 (GPU runs), 2.13, 2.14 (CPU runs)",
        "1b, cp 2 at 16,384 tokens: 0.81x one GPU's speed on cuDNN's parts; flex's causal kernel took 2.4x "
        "cuDNN's time (docs/benchmarks/2026-11-26-cp-kernels-fit-to-target.md); a rank keeps 1/cp of the "
        "window's keys and values for backward"),
    Override(
        "delayed_scaling", "float8",
        "fp8.scaling = delayed: torchao's tensorwise Float8Linear casting with scales from an amax history, built on "
        "torchao functions it calls non-public (matmul_with_hp_or_float8_args, hp_tensor_and_scale_to_float8, "
        "GemmInputRole, amax_to_scale); stock: dynamic scaling",
        "torchao 0.17, 0.18",
        "1b on one H100: 1.21-1.24x bf16 against dynamic scaling's 1.17x "
        "(docs/benchmarks/2026-11-22-delayed-scaling.md)"),
    Override(
        "fused_float8_weight_cast", "float8",
        "FSDP's float8 all-gather casts each weight shard with its precomputed scale in torchao's "
        "WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather, three eager kernels (scale in fp32, saturate, "
        "cast); instead one compiled kernel of the same bytes (a class patch of that method; GPU shards, with "
        "compile.enable)",
        "torchao 0.18 (GPU and CPU runs); the probe lets 0.17 run too, having compared the bytes with "
        "torchao's at start",
        "8b, one FSDP rank of two alone on one H200: 1.023x, the casts 49.8 -> 16.2 ms a step; 1b cp 2: no change "
        "(docs/benchmarks/2026-11-29-fused-float8-weight-cast.md); llama3_8b.toml on two H200s: 1.023x "
        "(docs/benchmarks/2026-11-29-two-h200s-cp2-bf16-sums-8b-fused-cast.md)"),
    Override(
        "autograd_cache_off_for_8bit_adamw", "compile",
        "torchao's compiled 8-bit AdamW update runs with torch._functorch.config.enable_autograd_cache off: "
        "taken from that on-disk cache it crashed (SIGSEGV)",
        "torch 2.13 (CPU, two FSDP ranks with float8 all-gather)",
        "no crash: a correctness workaround, not a speed-up"),
    Override(
        "rowwise_inductor_options", "compile",
        "compiling rowwise float8 layers with inductor's emulate_precision_casts (no NaNs from fused-away "
        "roundings, pytorch#150859) and triton.prefer_nd_tiling (torch._inductor.config's names)",
        "torch 2.11 (GPU runs), 2.13, 2.14",
        "rowwise faster with 2-D tiles (docs/benchmarks/2026-11-22-rowwise-tiling-four-h200.md)"),
    Override(
        "aligned_reduction_splits", "compile",
        "inductor cuts a reduction to one value (float8's amax of an activation) into parts of ceil(numel / parts) "
        "elements, unaligned where that is odd; instead the nearest count of equal parts of a multiple of 16 "
        "elements (an InductorChoices subclass: torch._inductor's choices handler and inductor_choices_class)",
        "torch 2.11 (GPU runs), 2.13, 2.14",
        "1b on one H200 at 16,384 tokens a step (2^27 values in float8's feed-forward amaxes): 1.019x at 4 x 4,096, "
        "1.011x at one 16,384-token window; the two amax kernels 4.45 ms a step faster "
        "(docs/benchmarks/2026-11-29-aligned-reduction-splits.md)"),
    Override(
        "activation_memory_budget", "compile",
        "activation_checkpoint.mode = budget sets torch._functorch.config.activation_memory_budget, the share of "
        "activations compile's partitioner keeps; stock torch has no other way to ask for it",
        "torch 2.11, 2.13, 2.14",
        "a memory lever of its own (docs/memory.md)"),
)
NAMES = tuple(o.name for o in OVERRIDES)
BY_NAME = {o.name: o for o in OVERRIDES}

_probes: dict[str, Callable[[], str | None]] = {}  # name -> its probe, as its module registered it
_chosen: set[str] | None = None  # None: not configured yet, every override whose probe passes is on
_verdicts: dict[str, str | None] = {}  # name -> None (the probe passed) or why it failed


def chosen_names(spec: str) -> set[str]:
    """The overrides `parallel.overrides = spec` asks for: on, off or names. Raises UserError naming
    the valid ones."""
    spec = spec.strip()
    if spec == "on":
        return set(NAMES)
    if spec == "off":
        return set()
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown or not names:
        raise UserError(f"parallel.overrides = {spec!r}: give on, off or a comma-separated list of {', '.join(NAMES)}"
                        + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
    return set(names)


def probe_for(name: str) -> Callable[[Callable[[], str | None]], Callable[[], str | None]]:
    """Marks the function it decorates as override `name`'s probe: why the override cannot run on this torch
    and torchao, or None. The override's module registers it when imported (the first `probe(name)` imports
    it: this module imports no torch); a name OVERRIDES lacks fails that import."""
    if name not in BY_NAME:
        raise ValueError(f"no override is called {name!r}: OVERRIDES has {', '.join(NAMES)}")

    def register(check: Callable[[], str | None]) -> Callable[[], str | None]:
        _probes[name] = check
        return check

    return register


def probe(name: str) -> str | None:
    """Why override `name` cannot run on this torch and torchao, or None: its probe, run once."""
    if name not in _verdicts:
        module = f"titanlike.overrides.{BY_NAME[name].module}"
        importlib.import_module(module)  # registers its probes
        assert name in _probes, f"{module} registers no probe for the override {name}"
        try:
            _verdicts[name] = _probes[name]()
        except Exception as e:  # a probe that breaks on a library it does not know: that is its answer
            _verdicts[name] = f"its probe failed ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
    return _verdicts[name]


def configure(spec: str) -> str:
    """Choose the overrides of this process (`parallel.overrides`); returns the one start line that
    says which are on and which are off, and why."""
    global _chosen
    _chosen = chosen_names(spec)
    on, off = [], []
    for name in NAMES:
        if name not in _chosen:
            off.append(f"{name} (parallel.overrides)")
        elif (why := probe(name)) is not None:
            off.append(f"{name} ({why})")
        else:
            on.append(name)
    line = f"overrides of torch/torchao internals: on: {', '.join(on) or 'none'}"
    return line + (f"; off, stock behaviour: {', '.join(off)}" if off else "")


def reset() -> None:
    """Back to not configured (every override whose probe passes is on): for a process that runs
    another run after this one (tests)."""
    global _chosen
    _chosen = None


def active(name: str) -> bool:
    """Whether override `name` runs in this process: chosen (every one until configure() chose) and its
    probe passed."""
    assert name in BY_NAME, name
    return (_chosen is None or name in _chosen) and probe(name) is None


def version_outside(installed: str, first: tuple[int, int], last: tuple[int, int], what: str = "torch") -> str | None:
    """Why `installed` (a version string) is outside the checked versions first..last (major, minor), or None."""
    try:
        major, minor = (int(part) for part in installed.split("+")[0].split(".")[:2])
    except ValueError:
        return f"{what} {installed} is not a version it knows"
    if first <= (major, minor) <= last:
        return None
    return f"{what} {installed} is outside the checked {first[0]}.{first[1]}-{last[0]}.{last[1]}"
