"""Time one Linear layer's forward + backward, compiled, in bf16 and in a float8 recipe.

Used by `fp8.auto_filter = measure` (convert only the layer shapes where float8 wins on this
GPU) and by scripts/bench_linear.py. Measured plans are cached per GPU, torch and torchao
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
from torch import nn

logger = logging.getLogger("titanlike")

CACHE = Path(os.environ.get("TITANLIKE_CACHE", Path.home() / ".cache" / "titanlike")) / "float8_plans.json"


def time_linear_ms(tokens: int, in_features: int, out_features: int, recipe: str, device: torch.device,
                   iters: int = 20, warmup: int = 5) -> float:
    """Median ms of forward + backward of one compiled Linear on `tokens` bf16 rows."""
    from titanlike.float8 import Float8Plan, convert, inductor_options

    torch._dynamo.reset()  # a fresh compile per shape, never the recompile limit's eager fallback
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(in_features, out_features, bias=False)).to(device)
    if recipe != "none":
        convert(model, Float8Plan(recipe, False, False, False, [], False))
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

    return f"{torch.cuda.get_device_name(device)}|torch {torch.__version__}|torchao {torchao.__version__}|{recipe}|{tokens}x{k}x{n}"


def measure_shapes(shapes: list[tuple[int, int]], tokens: int, recipe: str, device: torch.device) -> dict[tuple[int, int], float]:
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
