"""Float8 training through torchao: which Linears convert and why, the recipes, FSDP float8 all-gather.

The component has three moments in a run:
  resolve()      decide the effective options from the config and the data-parallel degree;
  check_device() before any real work, run one tiny float8 matmul on the actual device, so a GPU
                 that cannot run the recipe stops the run with one line instead of a kernel error;
  convert()      swap the chosen nn.Linear modules for torchao Float8Linear (on the meta model,
                 before activation checkpointing, compile and FSDP);
and after every optimizer step, post_optimizer_step() precomputes the float8 weight scales for
the next all-gather (one all-reduce for all layers) when float8 all-gather is on; with those scales
and compile on, each shard's cast for the all-gather runs as one compiled kernel
(configure_compile -> fuse_all_gather_cast). With fp8.scaling = delayed (float8_delayed.py),
convert() goes on to DelayedFloat8Linear and record_step() keeps its amax history after each step.
"""

from __future__ import annotations

import functools
import logging
import math
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from titanlike.errors import UserError

logger = logging.getLogger("titanlike")


@dataclass
class Float8Plan:
    recipe: str
    emulate: bool
    fsdp_float8_all_gather: bool
    precompute_scales: bool
    filter_fqns: list[str]
    auto_filter: bool | str  # True: by size; False: off; "measure": by timing each shape on this GPU
    scaling: str = "dynamic"  # tensorwise scales: "dynamic" or "delayed" (float8_delayed.py)
    amax_history: int = 16
    amax_every: int = 1
    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    measured: dict[tuple[int, int], float] = field(default_factory=dict)  # (in, out) -> float8 speed-up

    @property
    def enabled(self) -> bool:
        return self.recipe != "none"


def resolve(fp8_cfg, dp_shard: int) -> Float8Plan:
    """Effective float8 options: all-gather in float8 by default when tensorwise shards weights."""
    tensorwise = fp8_cfg.recipe == "tensorwise"
    all_gather = fp8_cfg.enable_fsdp_float8_all_gather
    if all_gather is None:
        all_gather = tensorwise and dp_shard > 1
    precompute = fp8_cfg.precompute_float8_dynamic_scale_for_fsdp
    if precompute is None:
        precompute = all_gather
    auto_filter = {"true": True, "false": False}.get(fp8_cfg.auto_filter, fp8_cfg.auto_filter)
    return Float8Plan(fp8_cfg.recipe, fp8_cfg.emulate, bool(all_gather and dp_shard > 1),
                      bool(precompute and all_gather and dp_shard > 1), list(fp8_cfg.filter_fqns), auto_filter,
                      scaling=fp8_cfg.scaling, amax_history=fp8_cfg.amax_history, amax_every=fp8_cfg.amax_every)


def _torchao_config(plan: Float8Plan):
    from torchao.float8 import Float8LinearConfig

    if plan.recipe == "tensorwise":
        return Float8LinearConfig(enable_fsdp_float8_all_gather=plan.fsdp_float8_all_gather, emulate=plan.emulate)
    config = Float8LinearConfig.from_recipe_name(plan.recipe)
    if plan.emulate:
        # The recipe configs are frozen dataclasses; copy with emulation switched on.
        import dataclasses

        config = dataclasses.replace(config, emulate=True)
    return config


# ---- which layers --------------------------------------------------------------------------

# Smallest Linear (in_features × out_features) that converts under the size rule. In isolation a
# tensorwise 2048×2048 matmul runs at 0.86× bf16 on an H100, but inside the compiled model its casts
# fuse with the neighbouring norm and RoPE kernels: the whole 1b model (2048×2048 wo, 2048×4096
# wqkv) trains fastest with every layer but the output in float8 (72.3k vs 70.5k tok/s with the
# former 2048×8192 bound). Rowwise pays on the wide layers: in the 1b model, converting w1/w2/w3 gives
# 1.06× bf16 and converting every layer but the output no more (66.4k vs 66.5k tok/s on an H100,
# with inductor_options' 2-D tiling), so the smaller ones stay in bf16 and keep their precision.
# A consumer GPU can differ: fp8.auto_filter = measure decides from its own timings.
MIN_FEATURES_PRODUCT = {"tensorwise": 2048 * 2048, "rowwise": 4096 * 4096, "rowwise_with_gw_hp": 4096 * 4096}
MIN_FEATURES = 1024
# With fp8.auto_filter = measure: convert a shape only if its compiled forward + backward ran at
# least this much faster in float8 than in bf16 (a margin for timing noise and for the casts of
# activations that the isolated timing shares with neighbouring layers).
MEASURED_MIN_SPEEDUP = 1.03


def skip_reason(fqn: str, linear: nn.Linear, plan: Float8Plan) -> str | None:
    """Why this Linear stays in high precision, or None to convert it."""
    for f in plan.filter_fqns:
        if f and f in fqn:
            return f"name matches fp8.filter_fqns entry {f!r}"
    k, n = linear.in_features, linear.out_features
    if k % 16 or n % 16:
        return f"{k}×{n} is not a multiple of 16 (float8 matmuls need it)"
    if plan.auto_filter == "measure" and (k, n) in plan.measured:
        speedup = plan.measured[(k, n)]
        if speedup < MEASURED_MIN_SPEEDUP:
            return f"{k}×{n}: float8 measured {speedup:.2f}× bf16 on this GPU (fp8.auto_filter = measure)"
    elif plan.auto_filter:
        if min(k, n) < MIN_FEATURES or k * n < MIN_FEATURES_PRODUCT[plan.recipe]:
            return f"{k}×{n} is too small for float8 to pay (fp8.auto_filter)"
    return None


def measure(model: nn.Module, plan: Float8Plan, tokens: int, device: torch.device) -> None:
    """For auto_filter = measure: time every candidate Linear shape on this GPU (rank 0's
    timings go to every rank, so all ranks convert the same layers)."""
    if not plan.enabled or plan.auto_filter != "measure":
        return
    if device.type != "cuda" or plan.emulate:
        logger.info("fp8.auto_filter = measure needs a GPU running real float8: choosing layers by size instead")
        plan.auto_filter = True
        return
    probe = Float8Plan(plan.recipe, False, False, False, plan.filter_fqns, False)
    shapes = [(m.in_features, m.out_features) for fqn, m in model.named_modules()
              if isinstance(m, nn.Linear) and skip_reason(fqn, m, probe) is None]
    import torch.distributed as dist

    from titanlike.float8_bench import measure_shapes

    result = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        result = [measure_shapes(shapes, tokens, plan.recipe, device)]
    if dist.is_initialized():
        dist.broadcast_object_list(result, src=0)
    plan.measured = result[0]
    for (k, n), speedup in sorted(plan.measured.items()):
        logger.info(f"  float8 {plan.recipe} {tokens}×{k}×{n}: {speedup:.2f}× bf16 -> "
                    f"{'float8' if speedup >= MEASURED_MIN_SPEEDUP else 'bf16'}")


def convert(model: nn.Module, plan: Float8Plan) -> None:
    """Swap the chosen Linears for Float8Linear in place; record what was converted and why not."""
    if not plan.enabled:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.float8 import convert_to_float8_training

    def want(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        reason = skip_reason(fqn, module, plan)
        if reason:
            plan.skipped[fqn] = reason
        else:
            plan.converted.append(fqn)
        return reason is None

    convert_to_float8_training(model, config=_torchao_config(plan), module_filter_fn=want)
    if delayed := _delayed(plan):
        delayed.convert(model, plan.amax_history)


def log_plan(plan: Float8Plan, share: float) -> None:
    if not plan.enabled:
        return
    delayed = (f", delayed scaling (amax history {plan.amax_history}, measured every {plan.amax_every} step(s))"
               if plan.scaling == "delayed" else "")
    logger.info(
        f"float8 {plan.recipe}{' (emulated)' if plan.emulate else ''}{delayed}: {len(plan.converted)} Linears converted, "
        f"{len(plan.skipped)} kept in high precision; {share:.0%} of matmul FLOPs in float8; "
        f"float8 all-gather {'on' if plan.fsdp_float8_all_gather else 'off'}"
    )
    reasons: dict[str, list[str]] = {}
    for fqn, why in plan.skipped.items():
        reasons.setdefault(why, []).append(fqn)
    for why, names in reasons.items():
        shown = ", ".join(names[:4]) + (f", … ({len(names)} in all)" if len(names) > 4 else "")
        logger.info(f"  kept high precision: {shown}: {why}")


def float8_matmul_share(model: nn.Module, flops_per_token: int) -> float:
    """Share of the model's training matmul FLOPs that run in float8 (6 FLOPs per weight per token)."""
    try:
        from torchao.float8.float8_linear import Float8Linear
    except ImportError:
        return 0.0
    fp8 = sum(6 * m.in_features * m.out_features for m in model.modules() if isinstance(m, Float8Linear))
    return fp8 / flops_per_token


# ---- can this device run it? --------------------------------------------------------------------


def check_device(plan: Float8Plan, device: torch.device) -> None:
    """Run one tiny float8 Linear forward and backward on the device; stop with one line if it fails."""
    if not plan.enabled or plan.emulate:
        return
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            raise UserError(
                f"fp8.recipe = {plan.recipe}: {name} (compute capability {cap[0]}.{cap[1]}) has no float8 "
                f"tensor cores (they start at 8.9: Ada, Hopper, Blackwell); use --fp8.recipe none"
            )
    probe = nn.Sequential(nn.Linear(32, 32, bias=False)).to(device)
    probe_plan = Float8Plan(plan.recipe, False, False, False, [], False)
    try:
        convert(probe, probe_plan)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        x = torch.randn(16, 32, device=device, dtype=dtype, requires_grad=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            probe(x).sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as e:  # the kernel's own error is the evidence; we say what to do instead
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        other = "tensorwise" if plan.recipe != "tensorwise" else "none"
        raise UserError(
            f"fp8.recipe = {plan.recipe} cannot run on {name} with torch {torch.__version__} ({first}); "
            f"use --fp8.recipe {other}{' or --fp8.emulate (slow, for testing)' if device.type == 'cpu' else ''}"
        ) from None


def inductor_options(recipe: str) -> dict[str, object]:
    """Inductor settings for compiling layers converted to `recipe` (torch.compile's `options`)."""
    if not recipe.startswith("rowwise"):
        return {}
    import torch._inductor.config as inductor_config

    options = {
        # Without emulated precision casts, inductor may fuse away the rounding of the rowwise
        # recipes' intermediate casts, a known source of NaNs (pytorch#150859).
        "emulate_precision_casts": True,
        # Rowwise casts each weight-gradient operand with one scale per column and writes it
        # transposed, in kernels of their own (the scales need the whole column first). Tiled in
        # one dimension those kernels spent 37 ms of a 390 ms 1b step on an H100; tiled in two,
        # the step runs 1.07x faster (66.4k vs 62.2k tok/s; rowwise_with_gw_hp 68.2k vs 67.5k;
        # tensorwise, which gets no options, 74.2k either way).
        "triton.prefer_nd_tiling": True,
    }
    # Both exist in torch 2.11-2.14; a later torch without one loses the speed-up, not the run.
    known = inductor_config.get_config_copy()
    return {k: v for k, v in options.items() if k in known}


def configure_compile(plan: Float8Plan) -> dict[str, object]:
    """What float8 needs from torch.compile, when compile.enable is on (and only then: a run without
    compile may be one where inductor cannot run): installs the fused all-gather cast and returns
    the inductor options for compiling the converted blocks."""
    if plan.fsdp_float8_all_gather:
        fuse_all_gather_cast()
    return inductor_options(plan.recipe) if plan.enabled else {}


def _delayed(plan: Float8Plan):
    """The float8_delayed module when fp8.scaling = delayed, else None (imported only then: it
    imports torchao)."""
    if plan.scaling != "delayed":
        return None
    from titanlike import float8_delayed

    return float8_delayed


def after_materialize(model: nn.Module, plan: Float8Plan) -> None:
    """Once the model has memory (to_empty): delayed scaling starts without history."""
    if delayed := _delayed(plan):
        delayed.reset(model)


def before_step(model: nn.Module, plan: Float8Plan, step: int) -> None:
    """Before training step `step`: whether delayed scaling measures amaxes in it (fp8.amax_every)."""
    if delayed := _delayed(plan):
        delayed.set_recording(model, step, plan.amax_every)


def record_step(model: nn.Module, plan: Float8Plan) -> None:
    """After each training step's update: its amaxes into the delayed scales' history (one
    all-reduce for all layers). Only after a step: a load or rollback has none."""
    if delayed := _delayed(plan):
        delayed.update_scales(model)


def scaling_state(model: nn.Module, plan: Float8Plan) -> dict[str, torch.Tensor]:
    """What float8 adds to a checkpoint: delayed scaling's amax history (nothing otherwise)."""
    delayed = _delayed(plan)
    return delayed.checkpoint_state(model) if delayed else {}


def load_scaling_state(model: nn.Module, plan: Float8Plan, state: dict[str, torch.Tensor]) -> None:
    if delayed := _delayed(plan):
        delayed.load_checkpoint_state(model, state)


def post_optimizer_step(model: nn.Module, plan: Float8Plan) -> None:
    """After the optimizer step: all weights' float8 scales in one all-reduce, for the next all-gather."""
    if plan.precompute_scales:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)


# ---- float8 all-gather: casting each weight shard ------------------------------------------------

# Devices on which the all-gather's weight cast runs as one compiled kernel (see below); elsewhere
# torchao's own eager cast runs. Tests add "cpu" to check the two give the same bytes.
FUSED_CAST_DEVICES = {"cuda"}
_fused_cast_installed = False


def _cast_shard(shard: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, fmax: float) -> torch.Tensor:
    # The same operations, in the same order, as torchao's cast (fp32, scale, saturate, convert).
    return (shard.to(torch.float32) * scale).clamp(-fmax, fmax).to(dtype)


def fuse_all_gather_cast() -> None:
    """Before each float8 all-gather FSDP asks every weight shard for its float8 bytes. With the
    scale precomputed (post_optimizer_step), torchao casts the fp32 shard in three eager kernels
    (multiply, clamp, convert), moving about 21 bytes per weight where one fused kernel moves 5:
    4.2 ms of a 344 ms step for 1b on two H200s, twice per step where weights are resharded after
    forward. Route that case through one compiled kernel computing the same bytes (tested equal):
    tensorwise tokens/s per GPU on two H200s 74.2k -> 74.8k (1b), 13.1k -> 13.6k (8b). Without a
    precomputed scale torchao's own path runs unchanged. Idempotent."""
    global _fused_cast_installed
    if _fused_cast_installed:
        return
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    original = WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather
    cast = torch.compile(_cast_shard, dynamic=True)

    # functools.wraps keeps the original signature visible (FSDP inspects it to decide what to
    # pass) and the original itself as __wrapped__.
    @functools.wraps(original)
    def fsdp_pre_all_gather(self, *args, **kwargs):
        # Read once: the next precompute may replace it. getattr: a torchao that renamed these
        # private fields still works, through its own cast.
        scale = getattr(self, "_precomputed_scale", None)
        shard = getattr(self, "_tensor", None)
        if scale is None or shard is None or shard.device.type not in FUSED_CAST_DEVICES:
            return original(self, *args, **kwargs)
        return (cast(shard, scale, self._dtype, torch.finfo(self._dtype).max),), (scale,)

    WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather = fsdp_pre_all_gather
    _fused_cast_installed = True


# ---- health of the weight casts -------------------------------------------------------------------


@torch.no_grad()
def weight_health(model: nn.Module) -> dict[str, dict[str, float]]:
    """Per float8 Linear: its weight's amax, and the shares of its values that would saturate
    (|w·scale| beyond the float8 maximum, 448 for e4m3, by more than rounding would take back) or
    flush to zero (non-zero, but zero once cast).

    The scale is torchao's, for the forward cast of the weight: one per tensor (tensorwise; the
    precomputed one when float8 all-gather precomputes it) or one per output row (rowwise), rounded
    down to a power of two where the recipe says so. Dynamic scaling derives the scale from the amax,
    so saturation stays 0 unless a scale is stale; underflow is the number to watch: a few outliers
    set the scale, and weights below about amax / 460,000 (e4m3) are lost in the cast.
    Measured on the fp32 master weights (the forward casts their bf16 copy under FSDP mixed precision).
    With FSDP each rank measures its shard and two all-reduces finish the job: every rank calls this.
    """
    from torch.distributed.tensor import DTensor
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_utils import amax_to_scale

    layers = []
    sharded = False
    for name, m in model.named_modules():
        if isinstance(m, Float8Linear):
            w = m.weight
            if isinstance(w, DTensor):
                sharded, w = True, w._local_tensor
            precomputed = getattr(w, "_precomputed_scale", None)
            w = getattr(w, "_tensor", w)  # float8 all-gather wraps the shard in a tensor subclass
            layers.append((name, m.config, w.detach().float(), precomputed))
    if not layers:
        return {}
    zero = torch.zeros((), device=layers[0][2].device)
    amax = torch.stack([w.abs().max() if w.numel() else zero for _, _, w, _ in layers])
    if sharded:
        torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX)
    counts = []
    for (_, config, w, precomputed), tensor_amax in zip(layers, amax):
        cast = config.cast_config_weight
        fmax = torch.finfo(cast.target_dtype).max
        # Up to half a float8 step above the maximum a value rounds to the maximum anyway (464 for e4m3).
        limit = fmax + 2.0 ** math.floor(math.log2(fmax)) * torch.finfo(cast.target_dtype).eps / 2
        if cast.scaling_granularity is ScalingGranularity.AXISWISE:  # rows are whole on each FSDP shard
            scale = amax_to_scale(w.abs().amax(dim=-1, keepdim=True), cast.target_dtype, config.round_scales_to_power_of_2)
        elif precomputed is not None:
            scale = precomputed.float()
        else:
            scale = amax_to_scale(tensor_amax, cast.target_dtype, config.round_scales_to_power_of_2)
        scaled = w * scale
        saturated = (scaled.abs() > limit).sum()
        flushed = ((scaled.clamp(-fmax, fmax).to(cast.target_dtype).float() == 0) & (w != 0)).sum()
        counts.append(torch.stack([saturated, flushed, torch.tensor(w.numel(), device=w.device)]))
    totals = torch.stack(counts).double()
    if sharded:  # (HSDP replicas count their copy too: numerators and denominators alike)
        torch.distributed.all_reduce(totals)
    out = {}
    for (name, *_), a, (sat, flush, n) in zip(layers, amax.tolist(), totals.tolist()):
        out[name] = {"amax": a, "saturated": sat / max(n, 1), "underflow": flush / max(n, 1)}
    return out


def health_summary(health: dict[str, dict[str, float]]) -> dict:
    """The worst layer of each measure, for one metrics.jsonl record."""
    if not health:
        return {}
    worst = max(health, key=lambda name: health[name]["underflow"])
    return {
        "fp8_weight_amax_max": max(h["amax"] for h in health.values()),
        "fp8_saturated_max": max(h["saturated"] for h in health.values()),
        "fp8_underflow_max": health[worst]["underflow"],
        "fp8_underflow_worst_layer": worst,
    }
