"""The [fp8] section, and what the rest of the run knows of each float8 recipe without torch.

`fp8.recipe` picks one recipe of RECIPES; titanlike/float8/ converts the model's Linears to it (torchao).
RECIPES holds, one entry a recipe, every fact that the config's rules, the memory plan, the out-of-memory
advice and float8/ itself read instead of comparing recipe names: whether its weights can be all-gathered
in float8 (and so are by default), the dtype of each of a Linear's three matmuls, what its Linears keep
for backward, the GPUs it needs and what to run where it cannot. Plain Python, in config/ rather than in
float8/: config/ and plan/ run before any worker imports torch (the preflight, titanlike-plan) and import
nothing of float8/, whose package imports torch and torchao (tests/test_layout.py). A new recipe is one
entry here and its name among fp8.recipe's choices; float8/ needs code only where torchao's own recipe
name does not build it (docs/architecture.md, "How to add a converter")."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from titanlike.config.loader import need

# fp8.amax_history: each converted Linear keeps 3 × this many floats, rolled every step; 10^18 overflowed
# the storage at the first step while the config check passed it.
MAX_AMAX_HISTORY = 1024


@dataclass
class Fp8:
    recipe: Literal["none", "tensorwise", "rowwise", "rowwise_with_gw_hp"] = "none"
    """torchao float8 training recipe for the Linear layers (none = bf16)."""
    enable_fsdp_float8_all_gather: bool | None = None
    """All-gather weights in float8 (tensorwise only); unset = on when tensorwise and dp_shard > 1."""
    precompute_float8_dynamic_scale_for_fsdp: bool | None = None
    """One all-reduce after each optimizer step computes every weight's scale; unset = on with float8 all-gather."""
    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    """Linear layers whose name contains one of these stay in high precision."""
    auto_filter: Literal["true", "false", "measure"] = "true"
    """Which Linears convert: true = those large enough to pay (by a size rule); measure = at start-up
    on this GPU, time one whole compiled block forward + backward at the run's micro-batch with no,
    the feed-forward's or every Linear in float8 and convert what was fastest (within 2 %, the more
    precise choice if it keeps no more memory for backward; cached; the size rule without a GPU; the
    output layer stays high precision); false = all (dimensions not multiples of 16 always stay high
    precision)."""
    scaling: Literal["dynamic", "delayed"] = "dynamic"
    """How tensorwise scales each Linear's input, weight and output gradient: dynamic = from the
    tensor's own amax (a read of the whole tensor before the cast); delayed = from the amaxes of the
    last amax_history measurements, taken during the casts: faster (titanlike/float8/delayed.py).
    Weights that FSDP all-gathers in float8 keep their precomputed dynamic scales either way.
    Ignored with recipe = none; rowwise recipes need dynamic."""
    amax_history: int = 16
    """Measurements of the largest magnitudes that delayed scaling takes the maximum of; at most 1024
    (TransformerEngine's default length: amaxes from further back would only make the scale lag)."""
    amax_every: int = 1
    """Delayed scaling measures the largest magnitudes on every this-many-th step only (1 = every
    step): the steps between skip the measuring and run faster; a value that grew since the last
    measurement saturates until the next."""
    emulate: bool = False
    """Emulate float8 matmuls in high precision (CPU tests, GPUs without float8)."""
    health_log_freq: int = 10
    """Log float8 weight health at every this-many-th log step (every metrics.log_freq × health_log_freq steps;
    0 = off): per converted Linear, the weight amax and the shares of values that would saturate or flush to
    zero when cast to float8; per layer in TensorBoard (fp8/<layer>/...), the worst layer in metrics.jsonl."""

    def validate(self) -> None:
        facts = RECIPES[self.recipe]
        need(
            not (self.enable_fsdp_float8_all_gather and not facts.all_gather),
            f"fp8.enable_fsdp_float8_all_gather needs fp8.recipe = {' or '.join(with_fact('all_gather'))} "
            f"(got {self.recipe!r}): a weight is gathered in float8 once for all its uses only with one scale per "
            f"weight, and rowwise scales are per row of each matmul input",
        )
        # With float8 off the scaling means nothing: `--fp8.recipe none` turns off a config that
        # sets delayed scaling (train_configs/rtx5090_124m.toml) without a second flag.
        need(
            self.scaling == "dynamic" or not facts.float8 or facts.delayed_scaling,
            f"fp8.scaling = delayed needs fp8.recipe = {' or '.join(with_fact('delayed_scaling'))} (got "
            f"{self.recipe!r}): rowwise scales are per row of each tensor, which changes from step to step",
        )
        need(1 <= self.amax_history <= MAX_AMAX_HISTORY,
             f"fp8.amax_history = {self.amax_history} must be in [1, {MAX_AMAX_HISTORY}] (default 16)")
        need(self.amax_every >= 1, f"fp8.amax_every = {self.amax_every} must be >= 1")
        need(
            not (self.precompute_float8_dynamic_scale_for_fsdp and self.enable_fsdp_float8_all_gather is False),
            "fp8.precompute_float8_dynamic_scale_for_fsdp needs fp8.enable_fsdp_float8_all_gather",
        )
        need(self.health_log_freq >= 0, f"fp8.health_log_freq = {self.health_log_freq} must be >= 0 (0 = off)")


# ---- each recipe's facts ----------------------------------------------------------------------------------

# What a float8 Linear keeps for backward, calibrated on tensorwise (plan/estimate.py's tests hold the
# measurements; rowwise has no recorded peak of its own and is taken to keep the same):
# - without recompute its inputs in float8 (1 byte) rather than bf16: a block keeps this share of its bf16
#   bytes (1b on one H100: 46.3 GiB tensorwise against 56.9 in bf16);
FLOAT8_NONE_SHARE = 0.63
# - with selective `op` the kept matmul outputs are bf16 either way, and float8 adds its amax reductions and
#   a few casts kept beside them: bytes per token per block, per unit of model width (8b on two H200s: 104.1
#   GiB tensorwise against 103.5 in bf16, with float8 all-gather saving 0.4 GiB of gathered weights).
FLOAT8_OP_EXTRA_PER_DIM = 0.5

# The GPUs with float8 tensor cores: Ada, Hopper, Blackwell (compute capability 8.9 and up).
FLOAT8_CAPABILITY = (8, 9)

# The size rule (fp8.auto_filter = true): the smallest in × out features a Linear converts at. In isolation a
# tensorwise 2048×2048 matmul runs slower than bf16 on an H100, but inside the compiled model its casts fuse
# with the neighbouring norm and RoPE kernels: the whole 1b model trains fastest with every layer but the
# output in float8 (docs/benchmarks/2026-11-22-stacked-qkv-gqa.md). Rowwise pays on the wide layers only: in
# the 1b model converting w1/w2/w3 is as fast as converting every layer but the output
# (docs/benchmarks/2026-11-22-rowwise-tiling-four-h200.md), so the smaller ones stay in bf16.
TENSORWISE_MIN_FEATURES = 2048 * 2048
ROWWISE_MIN_FEATURES = 4096 * 4096


@dataclass(frozen=True)
class Recipe:
    """What the config's rules, the memory plan, the out-of-memory advice and float8/ know of one recipe."""

    float8: bool
    """Its Linears compute in float8 (none: they stay bf16, and nothing converts)."""
    matmuls: tuple[str, str, str]
    """The dtype of each of a converted Linear's three training matmuls: its output (forward), its input's
    gradient and its weight's gradient ("float8", or "bf16" for high precision). The share of the model's
    matmul FLOPs in float8 counts the float8 ones."""
    all_gather: bool = False
    """One scale per weight: FSDP can all-gather the converted weights in float8 (a weight is cast once for
    all its uses), and does by default with more than one shard (fp8.enable_fsdp_float8_all_gather unset)."""
    delayed_scaling: bool = False
    """fp8.scaling = delayed applies: its scales are per tensor, so they can come from an amax history."""
    min_features: int = 0
    """The size rule (fp8.auto_filter = true): the smallest in × out features a Linear converts at."""
    kept_share: float = 1.0
    """What a block keeps for backward without recompute, as a share of its bf16 bytes (the memory plan)."""
    op_extra_per_dim: float = 0.0
    """What float8 adds to selective `op`'s kept bytes, per token per block per unit of model width (the plan)."""
    inductor_options: bool = False
    """Compiled, its layers take inductor's rowwise settings (overrides/compile.py rowwise_inductor_options)."""
    capability: tuple[int, int] = FLOAT8_CAPABILITY
    """The lowest CUDA compute capability that runs it (float8 tensor cores)."""
    instead: str = "none"
    """What the device probe's error line proposes where this GPU or CPU cannot run it."""
    device_notes: Mapping[int, str] = field(default_factory=lambda: MappingProxyType({}))
    """By a GPU's compute capability major: what the probe's error line says there instead of `instead`."""
    leaner: str = ""
    """The recipe the out-of-memory line proposes for less memory ("": none leaner)."""
    saves: tuple[str, str] = ("", "")
    """Why it uses less memory than a recipe that names it `leaner`: (under FSDP, compiled on one GPU), as the
    out-of-memory line says it."""


# RTX 50xx (sm_120). torch has a rowwise kernel for it, but whether it runs depends on the torch build: field
# reports differ (CUBLAS_STATUS_NOT_SUPPORTED on some, working on others). We have measured none, so we name
# no version as working.
ROWWISE_ON_SM120 = MappingProxyType({12: "torch's rowwise float8 matmul for sm_120 (RTX 50xx) is reported to work on "
                                         "some torch versions (field reports differ; docs/float8.md): try another "
                                         "torch version, or use --fp8.recipe tensorwise"})

RECIPES: dict[str, Recipe] = {
    "none": Recipe(float8=False, matmuls=("bf16", "bf16", "bf16"), leaner="tensorwise"),
    "tensorwise": Recipe(
        float8=True, matmuls=("float8", "float8", "float8"), all_gather=True, delayed_scaling=True,
        min_features=TENSORWISE_MIN_FEATURES, kept_share=FLOAT8_NONE_SHARE, op_extra_per_dim=FLOAT8_OP_EXTRA_PER_DIM,
        # Measured, not derived: 1b, seq 4096, batch 6 on one H100 (docs/benchmarks/2026-11-22-stacked-qkv-gqa.md).
        saves=("FSDP then gathers weights in float8",
               "compiled, it lowered the 1b preset's peak from 64 to 53 GiB on one GPU")),
    "rowwise": Recipe(
        float8=True, matmuls=("float8", "float8", "float8"), min_features=ROWWISE_MIN_FEATURES,
        kept_share=FLOAT8_NONE_SHARE, op_extra_per_dim=FLOAT8_OP_EXTRA_PER_DIM, inductor_options=True,
        instead="tensorwise", device_notes=ROWWISE_ON_SM120, leaner="tensorwise"),
    "rowwise_with_gw_hp": Recipe(
        # The weight's gradient in high precision (torchao's recipe of that name): two of three matmuls in float8.
        float8=True, matmuls=("float8", "float8", "bf16"), min_features=ROWWISE_MIN_FEATURES,
        kept_share=FLOAT8_NONE_SHARE, op_extra_per_dim=FLOAT8_OP_EXTRA_PER_DIM, inductor_options=True,
        instead="tensorwise", device_notes=ROWWISE_ON_SM120, leaner="tensorwise"),
}
"""Each fp8.recipe's facts (its choices are these names: tests/test_config.py checks they agree)."""


def with_fact(name: str) -> list[str]:
    """The recipes whose fact `name` (a bool field of Recipe) holds, in RECIPES' order: what a rule names."""
    return [recipe for recipe, facts in RECIPES.items() if getattr(facts, name)]


def float8_all_gather(fp8: Fp8, shards: int) -> bool:
    """Whether FSDP all-gathers the converted weights in float8 over `shards` ranks (dp_shard × cp): as
    fp8.enable_fsdp_float8_all_gather says, unset = where the recipe can; never with one shard (nothing to
    gather)."""
    wanted = fp8.enable_fsdp_float8_all_gather
    return shards > 1 and RECIPES[fp8.recipe].all_gather and wanted is not False
