"""The config sections of how a step runs fast: sharding (parallel), torch.compile (compile) and
recomputation (activation_checkpoint); float8's [fp8] lives beside its recipes' facts (fp8.py). Part of
the schema (schema.py): the same dataclass-and-docstring form, the same `need` rules, checked by the
same config meta-test."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from titanlike.config.loader import need
from titanlike.model.shape import BLOCK_MATMULS

# `reshard_after_forward = default` keeps the gathered weights from forward to backward (so backward
# all-gathers nothing) when all of them, in bf16, take at most this share of a GPU's memory: 1b on
# two H200s trains faster that way, for a little more memory
# (docs/benchmarks/2026-11-22-bf16-residual-fused-clip.md). An 8b (16 GB) stays resharded.
KEEP_GATHERED_MAX_SHARE = 1 / 16


def resolve_reshard(reshard: str, gathered_bytes: int, memory_bytes: int | None) -> str:
    """parallel.reshard_after_forward as apply_fsdp takes it: `default` becomes `never` for a model
    whose gathered weights are small next to the GPU's memory; anything else is left as it is."""
    if reshard == "default" and memory_bytes and gathered_bytes <= KEEP_GATHERED_MAX_SHARE * memory_bytes:
        return "never"
    return reshard


@dataclass
class Parallel:
    dp_shard: int = -1
    """FSDP degree (shards within a replica); -1 = all ranks not used by dp_replicate and cp."""
    dp_replicate: int = 1
    """Replicas of the sharded model (HSDP); ranks = dp_replicate × dp_shard × cp; -1 = ranks / (dp_shard × cp)."""
    cp: int = 1
    """Context parallelism: ranks that split each sample's sequence between them (1 = off). Each holds
    2 of 2·cp equal chunks of every window (load-balanced for causal attention) and all-gathers keys and
    values in each attention layer; FSDP shards the weights over dp_shard × cp ranks. data.seq_len must
    be a multiple of 2·cp (of 256·cp with model.attn_mask = block_causal on a GPU). For sequences whose
    activations do not fit one GPU (docs/parallelism.md)."""
    reshard_after_forward: Literal["default", "always", "never"] = "default"
    """Free gathered parameters after forward: default = yes except for the root module and the
    output layer, and for none of them when all weights in bf16 take at most 1/16 of a GPU's memory."""
    backend_timeout_s: int = 600
    """Seconds a collective may wait for another rank before the run fails with its name."""
    cpu_offload: bool = False
    """Keep the sharded weights, gradients and AdamW state in (pinned) host memory and run the
    optimizer step on the CPU (FSDP2's CPU offload): the GPU holds only the gathered weights and the
    activations, for a model that does not fit otherwise, at a cost in speed. Needs host memory of
    16 bytes a parameter (fp32 weights, gradients, two moments) over dp_shard per rank, checked at
    start; works on one GPU too (FSDP over one rank). Not with float8 all-gather, HSDP or a CPU run."""
    gradient_sync: Literal["micro_batch", "step"] = "micro_batch"
    """With several micro-batches a step (gradient accumulation under FSDP), when the ranks sum the gradients:
    micro_batch = after each micro-batch's backward, each rank keeping only its shard of the sums (the least
    memory); step = once, after the last: until then each rank adds its micro-batches' gradients up unsharded
    (the whole model's, 4 bytes a parameter; 2, and added up in bf16, with training.mixed_precision_reduce
    bf16) and keeps the gathered weights from one micro-batch's backward to the next's forward, so a step runs
    one reduce-scatter, and gathers the weights for forward once, instead of once a micro-batch. The same
    gradients up to rounding. Nothing changes with one micro-batch or one rank. Not with cpu_offload."""
    overrides: str = "on"
    """titanlike's overrides of torch and torchao internals, each for a measured gain (docs/overrides.md):
    on = every one whose start-up probe passes on this torch and torchao; off = stock torch and torchao
    only (FSDP's own buffers, torch's own attention ops, no class patches: to rule them out, or on a
    library they were not checked against); or a comma-separated list of the ones to keep on. The start
    line says which run and which fell back, and why."""

    def validate(self) -> None:
        """Checks without a world size; those with one are parallel.resolve_dims and train.preflight."""
        need(self.dp_shard == -1 or self.dp_shard >= 1,
             f"parallel.dp_shard = {self.dp_shard} must be -1 (all ranks) or >= 1")
        need(self.dp_replicate == -1 or self.dp_replicate >= 1,
             f"parallel.dp_replicate = {self.dp_replicate} must be -1 (the rest) or >= 1")
        need(1 <= self.cp <= 2**16, f"parallel.cp = {self.cp} must be >= 1 (1 = no context parallelism)")
        need(1 <= self.backend_timeout_s <= 10**6,
             f"parallel.backend_timeout_s = {self.backend_timeout_s} must be in [1, 1000000] (about 11 days)")


# Flex attention's tile (model/masks.py BLOCK_SIZE): with block_causal on a GPU, each of a rank's
# two chunks must be whole tiles, so that its query tiles are tiles of the whole window.
FLEX_BLOCK = 128


def validate_context_parallel(cp: int, seq_len: int, attn_mask: str, device: str, where: str = "data.seq_len") -> None:
    """parallel.cp against a window (`where`: the option that sets its seq_len): 2·cp equal chunks, and
    for flex attention whole tiles each."""
    if cp == 1:
        return
    need(seq_len % (2 * cp) == 0,
         f"{where} = {seq_len} must be a multiple of 2 × parallel.cp = {2 * cp}: each of the cp ranks "
         f"holds 2 of 2·cp equal chunks of every window")
    need(attn_mask != "block_causal" or device == "cpu" or seq_len % (2 * cp * FLEX_BLOCK) == 0,
         f"model.attn_mask = block_causal with parallel.cp = {cp} runs flex attention on a GPU, which can split "
         f"a window only into chunks of whole {FLEX_BLOCK}-token tiles: {where} = {seq_len} must be a "
         f"multiple of {2 * cp * FLEX_BLOCK} (2 × cp × {FLEX_BLOCK}; with --training.device cpu, of {2 * cp})")


@dataclass
class Compile:
    enable: bool = False
    """torch.compile each transformer block and the loss."""

    def validate(self) -> None:
        pass  # a boolean: every value is valid


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective", "budget"] = "none"
    """Recompute activations in backward: none, full (every block), selective (see option), or
    budget (compiled blocks keep memory_budget of their activations; needs compile.enable)."""
    selective_ac_option: str = "op"
    """With mode = selective: "op" saves every matmul's output, attention's and the float8 amax
    reductions and recomputes the rest; "op:NAMES" saves only the named Linears' outputs (of wqkv,
    wo, w1, w3, w2; e.g. op:wqkv,wo,w1 or op:wqkv,w1: less memory, more recomputation); an integer
    k checkpoints every k-th block fully."""
    selective_ac_blocks: int = 0
    """With selective_ac_option = op:NAMES: how many blocks, spread evenly over the model, follow it; the
    others keep every matmul's output, as "op" does (0 = every block). A step between "op" and op:NAMES
    of one block at a time: each such block keeps less (8b at 16,384 tokens a GPU: 0.44 GiB for w3's output)
    and recomputes it in backward."""
    memory_budget: float = 0.5
    """With mode = budget: the share (0, 1] of its activations each compiled graph keeps for
    backward; compile's partitioner recomputes the rest, cheapest to recompute first (elementwise
    ops before matmuls). 1 keeps what compile keeps anyway, as mode = none."""

    def validate(self) -> None:
        need(0 < self.memory_budget <= 1,
             f"activation_checkpoint.memory_budget = {self.memory_budget} must be in (0, 1]")
        option = self.selective_ac_option
        if self.mode == "selective":  # the option means nothing in the other modes
            need(
                option.startswith("op") or (option.isascii() and option.isdigit() and int(option) >= 1),
                f"activation_checkpoint.selective_ac_option = {option!r} must be 'op', 'op:' and Linears' names "
                f"or a positive integer",
            )
            if option.startswith("op"):
                names = _op_names(option)
                need(option == "op" or (option.startswith("op:") and bool(names)
                                        and all(n in BLOCK_MATMULS for n in names) and len(set(names)) == len(names)),
                     f"activation_checkpoint.selective_ac_option = {option!r}: after 'op:' name the Linears whose "
                     f"outputs to keep, each once, of {', '.join(BLOCK_MATMULS)} (e.g. op:wqkv,wo,w1)")
        need(self.selective_ac_blocks >= 0,
             f"activation_checkpoint.selective_ac_blocks = {self.selective_ac_blocks} must be >= 0 (0 = every block)")
        need(self.selective_ac_blocks == 0 or (self.mode == "selective" and option.startswith("op:")),
             f"activation_checkpoint.selective_ac_blocks = {self.selective_ac_blocks} chooses the blocks that follow "
             f"an op:NAMES option: it needs --activation_checkpoint.mode selective and "
             f"--activation_checkpoint.selective_ac_option op:NAMES (got mode {self.mode!r}, option {option!r})")


def _op_names(option: str) -> list[str]:
    return [n.strip() for n in option[3:].split(",") if n.strip()] if option.startswith("op:") else []


def named_blocks(n_layers: int, blocks: int) -> frozenset[int]:
    """The blocks that follow an op:NAMES option when selective_ac_blocks = `blocks` (0: all), spread
    evenly: 4 of 32 are blocks 0, 8, 16 and 24."""
    if blocks == 0 or blocks >= n_layers:
        return frozenset(range(n_layers))
    return frozenset(i * n_layers // blocks for i in range(blocks))


def matmul_outputs_kept(option: str) -> tuple[str, ...] | None:
    """The Linears whose outputs selective_ac_option keeps (in BLOCK_MATMULS order): all of them for
    "op", the named ones for "op:NAMES", None for an every-k-th-block option."""
    if option == "op":
        return BLOCK_MATMULS
    if option.startswith("op:"):
        names = set(_op_names(option))
        return tuple(n for n in BLOCK_MATMULS if n in names)
    return None
