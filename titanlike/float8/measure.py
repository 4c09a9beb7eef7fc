"""fp8.auto_filter = measure: time each candidate Linear shape, compiled, in bf16 and in float8 on
this GPU, and convert only the shapes where float8 wins.

The timing (time_linear_ms, median_cuda_ms) also serves scripts/bench_linear.py and
scripts/bench_attention.py. Measured plans are cached per GPU, torch and torchao
version, recipe and shape in ~/.cache/titanlike/float8_plans.json, since compiling every
shape twice costs tens of seconds.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from titanlike.float8.layers import MEASURED_MIN_SPEEDUP, convert, skip_reason
from titanlike.float8.options import Float8Options, inductor_options

logger = logging.getLogger("titanlike")

CACHE = Path(os.environ.get("TITANLIKE_CACHE", Path.home() / ".cache" / "titanlike")) / "float8_plans.json"


def time_linear_ms(tokens: int, in_features: int, out_features: int, recipe: str, device: torch.device,
                   iters: int = 20, warmup: int = 5) -> float:
    """Median ms of forward + backward of one compiled Linear on `tokens` bf16 rows."""
    torch._dynamo.reset()  # a fresh compile per shape, never the recompile limit's eager fallback
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(in_features, out_features, bias=False)).to(device)
    if recipe != "none":
        convert(model, Float8Options(recipe=recipe))
    # The trainer's settings for this recipe's compiled blocks, so that the timing is the trainer's.
    model = torch.compile(model, options=inductor_options(recipe) or None)
    x = torch.randn(tokens, in_features, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(tokens, out_features, device=device, dtype=torch.bfloat16)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = model(x)
        out.backward(grad)

    return median_cuda_ms(step, iters, warmup)


def median_cuda_ms(fn, iters: int = 20, warmup: int = 5) -> float:
    """Median GPU time of `fn()` in ms over `iters` runs after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _key(device: torch.device, recipe: str, tokens: int, k: int, n: int) -> str:
    import torchao

    versions = f"torch {torch.__version__}|torchao {torchao.__version__}"
    return f"{torch.cuda.get_device_name(device)}|{versions}|{recipe}|{tokens}x{k}x{n}"


def measure_shapes(shapes: list[tuple[int, int]], tokens: int, recipe: str,
                   device: torch.device) -> dict[tuple[int, int], float]:
    """float8 speed-up over bf16 (bf16 ms / float8 ms) of each (in, out) shape; cached on disk."""
    cache = json.loads(CACHE.read_text()) if CACHE.exists() else {}
    out = {}
    for k, n in sorted(set(shapes)):
        key = _key(device, recipe, tokens, k, n)
        if key not in cache:
            bf16 = time_linear_ms(tokens, k, n, "none", device)
            fp8 = time_linear_ms(tokens, k, n, recipe, device)
            cache[key] = bf16 / fp8
        out[(k, n)] = cache[key]
    CACHE.parent.mkdir(parents=True, exist_ok=True)
    tmp = CACHE.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(cache, indent=1))
    os.replace(tmp, CACHE)
    return out


def measure(model: nn.Module, options: Float8Options, tokens: int,
            device: torch.device) -> dict[tuple[int, int], float]:
    """For auto_filter = measure: the float8 speed-up of every candidate Linear shape on this GPU
    (rank 0's timings go to every rank, so all ranks convert the same layers). Empty where nothing
    is timed: the layers are then chosen by size."""
    if not options.enabled or options.auto_filter != "measure":
        return {}
    if device.type != "cuda" or options.emulate:
        logger.info("fp8.auto_filter = measure needs a GPU running real float8: choosing layers by size instead")
        return {}
    candidates = Float8Options(recipe=options.recipe, filter_fqns=options.filter_fqns)
    shapes = [(m.in_features, m.out_features) for fqn, m in model.named_modules()
              if isinstance(m, nn.Linear) and skip_reason(fqn, m, candidates) is None]
    result = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        result = [measure_shapes(shapes, tokens, options.recipe, device)]
    if dist.is_initialized():
        dist.broadcast_object_list(result, src=0)
    measured = result[0]
    for (k, n), speedup in sorted(measured.items()):
        logger.info(f"  float8 {options.recipe} {tokens}×{k}×{n}: {speedup:.2f}× bf16 -> "
                    f"{'float8' if speedup >= MEASURED_MIN_SPEEDUP else 'bf16'}")
    return measured
