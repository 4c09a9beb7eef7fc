"""The levers that lower a run's memory, and what each costs in speed: data, one entry a lever value.

A lever is a config key and the values it may take to save memory, each with the share of tokens/s it
costs and where that figure comes from (a measurement in docs/benchmarks/, or an estimate, said so). A new
lever (a new `activation_checkpoint.selective_ac_option`, say) is one more entry. Costs of levers combined
multiply: a run with two levers keeps (1 − a)(1 − b) of its speed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from titanlike.config.fp8 import RECIPES
from titanlike.config.host import runs_on_cpu
from titanlike.config.optimizer import OPTIMIZERS
from titanlike.config.schema import JobConfig

B = "docs/benchmarks/"

# bf16 moments: `1b` on one H200, 77,328 tok/s against fp32's 77,380 and 77,802 (0.997×) for 5.7 GiB; on the
# 8b config they ran 1.046× the one-GPU fit with fp32 moments, which recomputes more.
BF16_MOMENTS_COST = 0.003
BF16_MOMENTS_SOURCE = f"{B}2026-12-02-one-gpu-8b-fits-bf16-moments.md: 1b on one H200 0.997× fp32 moments for 5.7 GiB"


@dataclass(frozen=True)
class Choice:
    key: str
    """The config key, as the flag names it (training.loss_chunk_tokens)."""
    value: object
    cost: float
    """Share of tokens/s this value costs against the run without the lever."""
    source: str
    """Where the cost comes from: a benchmark report, or `estimate: why`."""
    usable: Callable[[JobConfig], bool] = lambda cfg: True
    """Whether the lever exists for this config (a field another version may lack, compile needed, ...)."""
    cost_sharded: float | None = None
    """The cost under FSDP (more than one GPU), where it differs."""
    exact: bool = True
    """Whether the run trains what it trained without the lever (memory and speed change, not the update's
    arithmetic). Set in a TOML file, a lever that is not exact is kept by a fit; an exact one may be changed."""

    def cost_at(self, world: int) -> float:
        return self.cost if world == 1 or self.cost_sharded is None else self.cost_sharded

    @property
    def flag(self) -> str:
        return f"--{self.key} {self.value}"


def _takes(state_dtype: str) -> Callable[[JobConfig], bool]:
    """Whether the run's optimizer keeps its state in `state_dtype` (config/optimizer.py OPTIMIZERS)."""
    return lambda cfg: state_dtype in OPTIMIZERS[cfg.optimizer.name].state_dtypes


def _steps_on_host(cfg: JobConfig) -> bool:
    """Whether the run's optimizer can step on the CPU while the model computes on a GPU (offload)."""
    return not OPTIMIZERS[cfg.optimizer.name].host_step


# Not a lever: optimizer.name. Another optimizer has other state bytes (config/optimizer.py), but it changes
# the update itself, its speed cost is not measured, and a checkpoint resumes only with the optimizer that
# saved it: a fit that picked one at one world size and not at another would leave a run its own checkpoints
# refuse. The optimizer is the user's choice (docs/optimizers.md).


CHOICES: tuple[Choice, ...] = (
    Choice("training.loss_chunk_tokens", 4096, 0.0,
           f"{B}2026-11-23-one-gpu-fused-chunked-loss-1b-32gb.md: 124m fused chunks +0.3 % (noise), 3.8 GiB less; "
           f"on 8b over two GPUs 0.999× (bf16) and 0.995× (tensorwise) for 3.4-4.1 GiB less "
           f"({B}2026-11-26-memory-levers-and-estimator.md)", cost_sharded=0.005),
    Choice("training.loss_chunk_tokens", 1024, 0.01,
           f"{B}2026-11-26-8b-levers-chunked-loss-context-parallel.md: on 8b over two GPUs chunks of 1,024 run as "
           "fast as chunks of 4,096 (0.995×) at the same peak (99.3 GiB: the peak is not in the loss), while the "
           "estimate counts one chunk's logits; one GPU: estimate, more and smaller chunks", cost_sharded=0.005),
    Choice("parallel.reshard_after_forward", "always", 0.029,
           f"{B}2026-11-26-cp-long-windows-1b-levers.md: 1b over two H200s 0.971× for 1.4 GiB; keeping 1b's "
           f"gathered weights was worth 1.8-1.9 % before ({B}2026-11-22-bf16-residual-fused-clip.md)"),
    Choice("optimizer.state_dtype", "bf16", BF16_MOMENTS_COST, BF16_MOMENTS_SOURCE, exact=False, usable=_takes("bf16")),
    Choice("optimizer.state_dtype", "8bit", 0.046,
           f"{B}2026-11-23-one-gpu-fused-chunked-loss-1b-32gb.md: torchao's 8-bit step, 4.6 % of a 1b step; over "
           f"two H200s 1b ran 0.963× for 4.3 GiB ({B}2026-11-26-cp-long-windows-1b-levers.md), 8b 0.959× "
           f"for 22.3 GiB ({B}2026-11-26-8b-levers-chunked-loss-context-parallel.md)", cost_sharded=0.04, exact=False,
           usable=_takes("8bit")),
    Choice("activation_checkpoint.mode", "selective:op", 0.03,
           "estimate: op recomputes elementwise ops only (norms, RoPE, SwiGLU), no matmul; on 1b over two H200s "
           "op:wqkv,wo,w1, which recomputes more, cost 3.5 % from none "
           f"({B}2026-11-26-cp-long-windows-1b-levers.md)"),
    # w3's output recomputed in a share of the blocks (activation_checkpoint.selective_ac_blocks): steps of
    # one block's w3 output between `op` and op:wqkv,wo,w1, at that share of the recomputation.
    Choice("activation_checkpoint.mode", "selective:op:wqkv,wo,w1@1/8", 0.035,
           f"{B}2026-11-26-cp-long-windows-1b-levers.md: 8b over two H200s with loss chunks, w3's output recomputed "
           "in 4 of 32 blocks, 0.993× for 2.1 GiB; with `op`'s own cost (from none)"),
    Choice("activation_checkpoint.mode", "selective:op:wqkv,wo,w1@1/4", 0.04,
           "estimate: `op`'s cost and a quarter of op:wqkv,wo,w1's over `op` (below)"),
    Choice("activation_checkpoint.mode", "selective:op:wqkv,wo,w1@1/2", 0.05,
           "estimate: `op`'s cost and half of op:wqkv,wo,w1's over `op` (below)"),
    Choice("activation_checkpoint.mode", "selective:op:wqkv,wo,w1", 0.07,
           f"{B}2026-11-26-8b-levers-chunked-loss-context-parallel.md: 8b on two H200s, w3's output recomputed, "
           "0.96 of `op`'s speed for 14 GiB; with `op`'s own cost (from none). 1b on two H200s: 0.965× from none "
           f"for 8.7 GiB ({B}2026-11-26-cp-long-windows-1b-levers.md)"),
    Choice("activation_checkpoint.mode", "selective:op:wqkv,w1", 0.10,
           f"{B}2026-11-26-8b-memory-breakdown.md: 8b on two H200s, wo's and w3's outputs recomputed, 0.927 of "
           "`op`'s speed for 18 GiB; with `op`'s own cost (from none). 1b on two H200s: 0.961× from none for "
           f"10.2 GiB ({B}2026-11-26-cp-long-windows-1b-levers.md)"),
    # Not `activation_checkpoint.mode budget`: what a budget keeps is compile's partitioner's choice, and the
    # estimate of 1b at budget 0.5 with chunks of 1,024 was 30.9 GiB against 33.5 measured (one H200,
    # 2026-11-26-cp-kernels-fit-to-target.md), too far under to pick it for a target.
    Choice("activation_checkpoint.mode", "selective:2", 0.08,
           "estimate: about half of full recompute's cost (every 2nd block recomputed whole)"),
    Choice("activation_checkpoint.mode", "full", 0.15,
           f"{B}2026-11-26-cp-long-windows-1b-levers.md: 1b over two H200s 0.867× from none for 20.9 GiB; on one "
           f"GPU in 31 GiB full recompute ran 0.84 of the uncapped speed "
           f"({B}2026-11-23-one-gpu-fused-chunked-loss-1b-32gb.md)"),
    Choice("parallel.cpu_offload", True, 0.7,
           f"{B}2026-11-26-cp-kernels-fit-to-target.md: 8b over two H200s with weights, gradients and the optimizer's "
           "state in host memory and the optimizer step on the CPU ran 0.30× the speed; 1b 0.354× "
           f"({B}2026-11-26-cp-long-windows-1b-levers.md)",
           usable=lambda cfg: not runs_on_cpu(cfg.training.device) and _steps_on_host(cfg)),
)

MICRO_BATCH_SOURCE = ("estimate: 3 % a halving of the micro-batch, 7 % two, 12 % three (more micro-batches, the same "
                      "global batch: each pays fixed per-step work, the weight casts, gathers and gradient "
                      "accumulation)")


# The shares of a micro-batch a fit tries (those that divide it, and the micro-batch of one): a dozen at most,
# so that the combinations stay a few thousand whatever the micro-batch.
MICRO_BATCH_SHARES = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def micro_batch_choices(local_batch: int) -> tuple[Choice, ...]:
    """Smaller micro-batches of the same global batch (more gradient-accumulation micro-batches a step): each
    share of MICRO_BATCH_SHARES that divides the micro-batch `local_batch`, and a micro-batch of one (a
    micro-batch of 3 becomes 1), as "1/k"."""
    shares = sorted({k for k in MICRO_BATCH_SHARES if local_batch % k == 0} | ({local_batch} - {1}))
    out = []
    for k in shares:
        halvings = math.log2(k)
        out.append(Choice("training.local_batch_size", f"1/{k}",
                          round(0.03 * halvings + 0.005 * halvings * (halvings - 1), 4), MICRO_BATCH_SOURCE))
    return tuple(out)


# The AC modes, from the one that keeps most to the one that keeps least, as Choice values spell them.
AC_ORDER = ("none", "budget:0.5", "selective:op", "selective:op:wqkv,wo,w1@1/8", "selective:op:wqkv,wo,w1@1/4",
            "selective:op:wqkv,wo,w1@1/2", "selective:op:wqkv,wo,w1", "selective:op:wqkv,w1", "selective:2", "full")


def ac_value(cfg: JobConfig) -> str:
    ac = cfg.activation_checkpoint
    if ac.mode == "selective" and ac.selective_ac_blocks:  # a count of blocks: not one of AC_ORDER's shares
        return f"selective:{ac.selective_ac_option}@{ac.selective_ac_blocks}"
    if ac.mode == "selective":
        return f"selective:{ac.selective_ac_option}"
    return f"budget:{ac.memory_budget}" if ac.mode == "budget" else ac.mode


def _named_share(option: str, cfg: JobConfig) -> tuple[str, int]:
    """An AC option with a share of the blocks (op:NAMES@1/4) as selective_ac_option and selective_ac_blocks
    for this model (at least one block); without a share, the option and 0 (every block)."""
    option, _, share = option.partition("@")
    if not share:
        return option, 0
    from titanlike.config.resolve import resolve_model

    n_layers = resolve_model(cfg).args.n_layers
    num, den = (int(x) for x in share.split("/"))
    return option, max(1, n_layers * num // den)


def apply(cfg: JobConfig, choice: Choice, global_batch: int) -> JobConfig | None:
    """The config with one lever value applied; None where it does not apply (a micro-batch that does not
    divide the current one). `global_batch`: the run's, which a smaller micro-batch keeps."""
    section, key = choice.key.split(".")
    if choice.key == "activation_checkpoint.mode":
        mode, _, option = str(choice.value).partition(":")
        ac = cfg.activation_checkpoint
        changes: dict[str, object] = {"mode": mode}  # a Literal field: the values are AC_ORDER's, checked below
        if mode == "selective":
            changes["selective_ac_option"], changes["selective_ac_blocks"] = _named_share(option, cfg)
        elif mode == "budget":
            changes["memory_budget"] = float(option)
        new = dataclasses.replace(ac, **changes)  # type: ignore[arg-type]
        new.validate()
        return dataclasses.replace(cfg, activation_checkpoint=new)
    if choice.key == "training.local_batch_size":
        t = cfg.training
        divisor = int(str(choice.value).split("/")[1])
        if t.local_batch_size % divisor:
            return None
        # The global batch stays: the micro-batches grow in number (gradient accumulation).
        return dataclasses.replace(cfg, training=dataclasses.replace(
            t, local_batch_size=t.local_batch_size // divisor, global_batch_size=global_batch))
    if choice.key == "parallel.cpu_offload" and RECIPES[cfg.fp8.recipe].all_gather:
        # Offloaded weights are gathered from host fp32 shards: never in float8 (config/dims.check_offload).
        cfg = dataclasses.replace(cfg, fp8=dataclasses.replace(cfg.fp8, enable_fsdp_float8_all_gather=False))
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **{key: choice.value})})


def flags(cfg: JobConfig, choices: tuple[Choice, ...], global_batch: int) -> list[str]:
    """The command-line flags that set these choices on `cfg` (the micro-batch as a number, with the global
    batch it keeps)."""
    out = []
    for c in choices:
        if c.key == "training.local_batch_size":
            out.append(f"--training.local_batch_size {cfg.training.local_batch_size // int(str(c.value)[2:])} "
                       f"--training.global_batch_size {global_batch}")
        elif c.key == "activation_checkpoint.mode":
            mode, _, option = str(c.value).partition(":")
            out.append(f"--activation_checkpoint.mode {mode}")
            if mode == "selective":
                option, blocks = _named_share(option, cfg)
                out.append(f"--activation_checkpoint.selective_ac_option {option}")
                if blocks:
                    out.append(f"--activation_checkpoint.selective_ac_blocks {blocks}")
            elif mode == "budget":
                out.append(f"--activation_checkpoint.memory_budget {option}")
        else:
            value = str(c.value).lower() if isinstance(c.value, bool) else c.value
            out.append(f"--{c.key} {value}")
            if c.key == "parallel.cpu_offload" and RECIPES[cfg.fp8.recipe].all_gather:
                out.append("--fp8.enable_fsdp_float8_all_gather false")
    return out
