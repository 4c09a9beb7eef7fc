"""fp8.auto_filter = measure: decide which Linears become float8 from what a training step sees.

Timing one Linear alone misleads: in the compiled model float8's casts fuse with the norms, RoPE and
SwiGLU around them (an isolated w2 of `1b` timed 0.51× bf16 while whole runs with it in float8 were
as fast or faster). So this times what a step runs, at the run's own micro-batch (batch × seq):

one whole transformer block, compiled as the trainer compiles it, forward + backward, for each
block choice in BLOCK_CHOICES (all bf16, only the feed-forward in float8, every Linear in float8).

The output layer is no candidate: measure keeps it in high precision. Timed alone (compiled with the
loss) it looked faster in float8 on `124m`, but while the trainer ran it outside the compiled blocks
whole runs with it in float8 were far slower than bf16
(docs/benchmarks/2026-11-23-one-gpu-124m-float8-choices.md). Since one process compiles the final
norm, the output layer and the loss as one graph (titanlike/model/loss.py) a float8 output layer no longer
loses, but gains within noise (+0.9 %) for 8 GiB more memory on `124m`
(docs/benchmarks/2026-11-23-one-gpu-124m-compiled-head-1b-32gb.md): not worth a default. To force
it into float8: fp8.auto_filter = false with fp8.filter_fqns = [].

Each candidate is also weighed by the activation memory its forward keeps for backward. Within
noise of the fastest the more precise choice wins, but only if it keeps no more than the fastest:
two choices that run at the same speed are not the same choice for a run tuned to its memory. On
`1b` capped at 31 GiB (8-bit moments, micro-batch 3) the feed-forward-only choice timed within
noise of every Linear in float8, was taken for its precision, and its bf16 attention activations
put the run out of memory (docs/benchmarks/2026-11-23-one-gpu-fused-chunked-loss-1b-32gb.md).

`decide` (pure: timings and bytes in, choice out) picks; `Float8Plan.reason` then says,
per Linear, why it stays in high precision. Rank 0 times, every rank gets its plan, so all ranks
convert the same layers. Timings are cached per GPU, torch and torchao version, recipe, scaling,
model shape and micro-batch in ~/.cache/titanlike/float8_plans.json (compiling every candidate
costs tens of seconds). `time_linear_ms` and `median_cuda_ms` also serve scripts/bench_linear.py
and scripts/bench_attention.py.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from titanlike.cache import cache_dir
from titanlike.float8.options import Float8Options, inductor_options

logger = logging.getLogger("titanlike")

PLANS = "float8_plans.json"  # in the per-machine cache (titanlike/cache.py)

# The block choices, from the most precise to the least: name -> the parts of a block (substrings
# of a Linear's name inside the block) that run in float8. A choice in between, the feed-forward
# and the qkv projection, ran 3.7-3.9 % slower than the feed-forward alone on `124m` and as slow as
# 'all' (docs/benchmarks/2026-11-24-124m-inductor-switches.md): not worth its compile at start-up.
BLOCK_CHOICES: dict[str, tuple[str, ...]] = {
    "bf16": (),
    "feed-forward": ("feed_forward.",),
    "all": ("attention.", "feed_forward."),
}
# A less precise choice must beat a more precise one by more than this share to be picked: below
# it, two timings of the same code differ by noise, and the more precise choice keeps precision.
NOISE = 0.02


@dataclass(frozen=True)
class Float8Plan:
    """What measure decided: the block choice (a key of BLOCK_CHOICES), and the timings in ms and the
    bytes kept for backward per block it was decided from."""

    block: str
    block_ms: dict[str, float] = field(default_factory=dict)
    block_bytes: dict[str, int] = field(default_factory=dict)

    def reason(self, fqn: str) -> str | None:
        """Why the Linear `fqn` stays in high precision under this plan, or None to convert it."""
        times = ", ".join(f"{k} {v:.2f} ms" for k, v in self.block_ms.items())
        if fqn == "output" or fqn.endswith(".output"):
            return "fp8.auto_filter = measure keeps the output layer in high precision (see float8/measure.py)"
        if any(part in fqn for part in BLOCK_CHOICES[self.block]):
            return None
        return f"measured block choice is {self.block!r} ({times} per block; fp8.auto_filter = measure)"


def fastest(times: dict[str, float], order: list[str], kept: dict[str, int] | None = None) -> str:
    """The fastest of `times`, except that a choice earlier in `order` (more precise) wins when it
    is within NOISE of the fastest and, where `kept` gives each choice's bytes kept for backward,
    keeps no more than the fastest."""
    quickest = min(times, key=lambda name: times[name])
    return next(name for name in order if name in times and times[name] <= times[quickest] * (1 + NOISE)
                and (not kept or kept[name] <= kept[quickest]))


def decide(block_ms: dict[str, float], block_bytes: dict[str, int] | None = None) -> Float8Plan:
    """The plan from the timings and memory: the fastest block choice (within noise, the more precise
    one that keeps no more memory)."""
    return Float8Plan(fastest(block_ms, list(BLOCK_CHOICES), block_bytes), dict(block_ms), dict(block_bytes or {}))


# ---- timing on the GPU ---------------------------------------------------------------------------


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


def _float8(module: nn.Module, options: Float8Options, parts: tuple[str, ...]) -> nn.Module:
    """`module` with the Linears whose name contains one of `parts` in float8 (dimensions not
    multiples of 16 excepted), with the run's scaling."""
    from torchao.float8 import convert_to_float8_training

    def want(m: nn.Module, fqn: str) -> bool:
        return (isinstance(m, nn.Linear) and any(p in fqn for p in parts)
                and not (m.in_features % 16 or m.out_features % 16))

    if parts:
        convert_to_float8_training(module, config=options.torchao_config(), module_filter_fn=want)
        if options.delayed:
            from titanlike.float8 import delayed

            delayed.convert(module, options.amax_history)
    return module


def allocated_bytes(device: torch.device) -> int:
    """Bytes the caching allocator holds in tensors on `device` now."""
    return torch.cuda.memory_allocated(device)


def time_block(block_sample, batch: int, seq: int, options: Float8Options, choice: str,
               device: torch.device) -> tuple[float, int]:
    """Forward + backward of one compiled transformer block (`block_sample(batch, seq, device)`: a
    fresh block and its forward's arguments, bf16 activations) with `choice`'s Linears in float8: the
    median ms, and the bytes its forward keeps allocated for backward (the block's output included,
    the same for every choice)."""
    torch.compiler.reset()  # a fresh compile per candidate, never the recompile limit's eager fallback
    torch.manual_seed(0)
    block, args = block_sample(batch, seq, device)
    block = _float8(block, options, BLOCK_CHOICES[choice])
    # The trainer compiles every block with the recipe's options, whichever Linears converted.
    block.compile(fullgraph=True, options=inductor_options(options.recipe) or None)
    grad = torch.randn_like(args[0])

    def forward() -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return block(*args)

    def step() -> None:
        forward().backward(grad)

    # One step first: it compiles and, with delayed scaling, fills the history; steps then measure
    # amaxes as often as the run will (fp8.amax_every).
    step()
    if options.delayed:
        from titanlike.float8 import delayed

        delayed.update_scales(block)
        delayed.set_recording(block, 2, options.amax_every)
    ms = median_cuda_ms(step)
    before = allocated_bytes(device)
    out = forward()
    kept = allocated_bytes(device) - before
    out.backward(grad)
    return ms, kept


def time_linear_ms(tokens: int, in_features: int, out_features: int, recipe: str, device: torch.device,
                   iters: int = 20, warmup: int = 5) -> float:
    """Median ms of forward + backward of one compiled Linear on `tokens` bf16 rows (benchmarks only:
    measure times whole blocks, not Linears alone)."""
    torch.compiler.reset()
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(in_features, out_features, bias=False)).to(device)
    options = Float8Options(recipe=recipe)
    model = _float8(model, options, ("0",) if options.enabled else ())
    compiled = torch.compile(model, options=inductor_options(recipe) or None)
    x = torch.randn(tokens, in_features, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(tokens, out_features, device=device, dtype=torch.bfloat16)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = compiled(x)
        out.backward(grad)

    return median_cuda_ms(step, iters, warmup)


def _cache_key(device: torch.device, options: Float8Options, shape, batch: int, seq: int, candidate: str) -> str:
    import torchao

    scaling = f"delayed every {options.amax_every}" if options.delayed else "dynamic"
    return (f"{torch.cuda.get_device_name(device)}|torch {torch.__version__}|torchao {torchao.__version__}|"
            f"{options.recipe} {scaling}|{shape}|{batch}x{seq}|{candidate}")


def time_candidates(shape, batch: int, seq: int, options: Float8Options, device: torch.device,
                    block_sample) -> tuple[dict[str, float], dict[str, int]]:
    """ms and bytes kept for backward per block choice; cached on disk, keyed by `shape` (the model's
    ModelArgs) among others."""
    plans = cache_dir() / PLANS
    cache = json.loads(plans.read_text()) if plans.exists() else {}
    block_ms, block_bytes = {}, {}
    timed = False
    for choice in BLOCK_CHOICES:
        key = _cache_key(device, options, shape, batch, seq, f"block {choice}")
        # A plan cached before the bytes were measured is timed again.
        if key not in cache or key + " kept bytes" not in cache:
            cache[key], cache[key + " kept bytes"] = time_block(block_sample, batch, seq, options, choice, device)
            timed = True
        block_ms[choice], block_bytes[choice] = cache[key], cache[key + " kept bytes"]
    if not timed:  # every choice came from the cache: nothing was compiled, nothing to write
        return block_ms, block_bytes
    torch.compiler.reset()  # the run compiles its own blocks afresh
    plans.parent.mkdir(parents=True, exist_ok=True)
    tmp = plans.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(cache, indent=1))
    os.replace(tmp, plans)
    return block_ms, block_bytes


def measure(model: nn.Module, options: Float8Options, batch: int, seq: int, device: torch.device,
            block_sample=None) -> Float8Plan | None:
    """For auto_filter = measure: time the candidates on this GPU at the run's micro-batch (`batch`
    sequences of `seq`) with blocks from `block_sample`, and decide. None where nothing is timed: the
    layers are then chosen by size."""
    if not options.enabled or options.auto_filter != "measure":
        return None
    if device.type != "cuda" or options.emulate or block_sample is None:
        logger.info("fp8.auto_filter = measure needs a GPU running real float8: choosing layers by size instead")
        return None
    result: list = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        result = [time_candidates(getattr(model, "args", None), batch, seq, options, device, block_sample)]
    if dist.is_initialized():
        dist.broadcast_object_list(result, src=0)
    block_ms, block_bytes = result[0]
    plan = decide(block_ms, block_bytes)
    for choice, ms in block_ms.items():
        logger.info(f"  fp8.auto_filter = measure: one block, float8 on {choice!r}: {ms:.2f} ms, "
                    f"{block_bytes[choice] / 2**20:,.0f} MiB kept for backward"
                    f"{' <- chosen' if choice == plan.block else ''}")
    return plan
