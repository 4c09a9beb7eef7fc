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

from titanlike.config.fp8 import RECIPES
from titanlike.errors import UserError
from titanlike.float8.measure import Float8Plan
from titanlike.float8.options import Float8Options

logger = logging.getLogger("titanlike")

# Smallest side of a Linear that converts under the size rule; the smallest in × out features is each
# recipe's (config/fp8.py RECIPES, min_features, with why). A consumer GPU can differ: fp8.auto_filter =
# measure decides from its own timings.
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
        if min(k, n) < MIN_FEATURES or k * n < RECIPES[options.recipe].min_features:
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


def float8_matmul_share(model: nn.Module, flops_per_token: int, recipe: str) -> float:
    """Share of the model's training matmul FLOPs that run in float8: 2 FLOPs per weight per token for each of
    a converted Linear's three matmuls that `recipe` runs in float8 (config/fp8.py RECIPES, matmuls)."""
    try:
        from torchao.float8.float8_linear import Float8Linear
    except ImportError:
        return 0.0
    in_float8 = 2 * RECIPES[recipe].matmuls.count("float8")
    fp8 = sum(in_float8 * m.in_features * m.out_features for m in model.modules() if isinstance(m, Float8Linear))
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
        cap, need = torch.cuda.get_device_capability(device), RECIPES[options.recipe].capability
        if cap < need:
            raise UserError(
                f"fp8.recipe = {options.recipe}: {name} (compute capability {cap[0]}.{cap[1]}) has no float8 "
                f"tensor cores (they start at {need[0]}.{need[1]}: Ada, Hopper, Blackwell); use --fp8.recipe none"
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
    """The end of the probe's error line: what the user can run instead (config/fp8.py RECIPES: instead, and
    what it says on some GPUs)."""
    facts = RECIPES[recipe]
    if device.type == "cpu":
        return f"use --fp8.recipe {facts.instead} or --fp8.emulate (slow, for testing)"
    note = facts.device_notes.get(torch.cuda.get_device_capability(device)[0])
    return note or f"use --fp8.recipe {facts.instead}"
