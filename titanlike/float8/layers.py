"""Which Linears become float8 and why, the conversion itself, and whether this device can run it.

The rules, in order: a name in fp8.filter_fqns stays; a shape that is not a multiple of 16 stays
(float8 matmuls need it); with fp8.auto_filter a shape too small to pay stays (the size rule), or,
with auto_filter = measure, the layers that the whole-block timings on this GPU chose to keep
(measure.py).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from titanlike.errors import UserError
from titanlike.float8.measure import Float8Plan
from titanlike.float8.options import Float8Options

logger = logging.getLogger("titanlike")

# Smallest Linear (in_features × out_features) that converts under the size rule. In isolation a
# tensorwise 2048×2048 matmul runs slower than bf16 on an H100, but inside the compiled model its
# casts fuse with the neighbouring norm and RoPE kernels: the whole 1b model trains fastest with
# every layer but the output in float8 (docs/benchmarks/2026-11-22-stacked-qkv-gqa.md). Rowwise
# pays on the wide layers only: in the 1b model converting w1/w2/w3 is as fast as converting every
# layer but the output (docs/benchmarks/2026-11-22-rowwise-tiling-four-h200.md), so the smaller ones
# stay in bf16 and keep their precision. A consumer GPU can differ: fp8.auto_filter = measure
# decides from its own timings.
MIN_FEATURES_PRODUCT = {"tensorwise": 2048 * 2048, "rowwise": 4096 * 4096, "rowwise_with_gw_hp": 4096 * 4096}
MIN_FEATURES = 1024


@dataclass
class Float8Report:
    """What conversion did: the layers converted, those kept in high precision and why, and what
    fp8.auto_filter = measure timed and chose (None when it timed nothing)."""

    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    plan: Float8Plan | None = None
    matmul_share: float = 0.0
    """Share of the model's training matmul FLOPs that run in float8."""


def skip_reason(fqn: str, linear: nn.Linear, options: Float8Options, plan: Float8Plan | None = None) -> str | None:
    """Why this Linear stays in high precision, or None to convert it. `plan`: what
    auto_filter = measure chose on this GPU; without one, auto_filter falls back to the size rule."""
    for f in options.filter_fqns:
        if f and f in fqn:
            return f"name matches fp8.filter_fqns entry {f!r}"
    k, n = linear.in_features, linear.out_features
    if k % 16 or n % 16:
        return f"{k}×{n} is not a multiple of 16 (float8 matmuls need it)"
    if options.auto_filter == "measure" and plan is not None:
        return plan.reason(fqn)
    if options.auto_filter:
        if min(k, n) < MIN_FEATURES or k * n < MIN_FEATURES_PRODUCT[options.recipe]:
            return f"{k}×{n} is too small for float8 to pay (fp8.auto_filter)"
    return None


def convert(model: nn.Module, options: Float8Options, plan: Float8Plan | None = None) -> Float8Report:
    """Swap the chosen Linears for torchao's Float8Linear in place; report what converted and why not."""
    report = Float8Report(plan=plan)
    if not options.enabled:
        return report
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.float8 import convert_to_float8_training

    def want(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        reason = skip_reason(fqn, module, options, plan)
        if reason:
            report.skipped[fqn] = reason
        else:
            report.converted.append(fqn)
        return reason is None

    convert_to_float8_training(model, config=options.torchao_config(), module_filter_fn=want)
    return report


def float8_matmul_share(model: nn.Module, flops_per_token: int) -> float:
    """Share of the model's training matmul FLOPs that run in float8 (6 FLOPs per weight per token)."""
    try:
        from torchao.float8.float8_linear import Float8Linear
    except ImportError:
        return 0.0
    fp8 = sum(6 * m.in_features * m.out_features for m in model.modules() if isinstance(m, Float8Linear))
    return fp8 / flops_per_token


def log_report(options: Float8Options, report: Float8Report) -> None:
    """The start-up lines: recipe, how many layers converted, and why the others did not."""
    if not options.enabled:
        return
    delayed = (f", delayed scaling (amax history {options.amax_history}, measured every {options.amax_every} step(s))"
               if options.scaling == "delayed" else "")
    logger.info(
        f"float8 {options.recipe}{' (emulated)' if options.emulate else ''}{delayed}: "
        f"{len(report.converted)} Linears converted, {len(report.skipped)} kept in high precision; "
        f"{report.matmul_share:.0%} of matmul FLOPs in float8; "
        f"float8 all-gather {'on' if options.fsdp_float8_all_gather else 'off'}"
    )
    reasons: dict[str, list[str]] = {}
    for fqn, why in report.skipped.items():
        reasons.setdefault(why, []).append(fqn)
    for why, names in reasons.items():
        shown = ", ".join(names[:4]) + (f", … ({len(names)} in all)" if len(names) > 4 else "")
        logger.info(f"  kept high precision: {shown}: {why}")


# ---- can this device run it? --------------------------------------------------------------------


def check_device(options: Float8Options, device: torch.device) -> None:
    """Run one tiny float8 Linear forward and backward on the device; stop with one line if it fails."""
    if not options.enabled or options.emulate:
        return
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            raise UserError(
                f"fp8.recipe = {options.recipe}: {name} (compute capability {cap[0]}.{cap[1]}) has no float8 "
                f"tensor cores (they start at 8.9: Ada, Hopper, Blackwell); use --fp8.recipe none"
            )
    try:
        _run_probe(options.recipe, device)
    except Exception as e:  # the kernel's own error is the evidence; we say what to do instead
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise UserError(
            f"fp8.recipe = {options.recipe} cannot run on {name} with torch {torch.__version__} ({first}); "
            f"{what_to_do(options.recipe, device)}"
        ) from None


def _run_probe(recipe: str, device: torch.device) -> None:
    """One tiny float8 Linear forward and backward on the device; raises what the kernel raises."""
    probe = nn.Sequential(nn.Linear(32, 32, bias=False)).to(device)
    convert(probe, Float8Options(recipe=recipe))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(16, 32, device=device, dtype=dtype, requires_grad=True)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        probe(x).sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def what_to_do(recipe: str, device: torch.device) -> str:
    """The end of the probe's error line: what the user can run instead."""
    other = "tensorwise" if recipe != "tensorwise" else "none"
    if device.type == "cpu":
        return f"use --fp8.recipe {other} or --fp8.emulate (slow, for testing)"
    if recipe.startswith("rowwise") and torch.cuda.get_device_capability(device)[0] == 12:
        # RTX 50xx (sm_120). torch has a rowwise kernel for it, but whether it runs depends on the
        # torch build: field reports differ (CUBLAS_STATUS_NOT_SUPPORTED on some, working on
        # others). We have measured none, so we name no version as working.
        return ("torch's rowwise float8 matmul for sm_120 (RTX 50xx) is reported to work on some torch versions "
                "(field reports differ; docs/float8.md): try another torch version, or use --fp8.recipe tensorwise")
    return f"use --fp8.recipe {other}"
