"""Per-GPU memory of a training run, estimated from its config and world size without torch.

The model is first principles (bytes per parameter, bytes per token per block) with a few constants
calibrated against the peaks that `metrics.jsonl` recorded on H100s and H200s (`mem_reserved_gib`, the
peak reserved since start); tests/test_plan.py holds those measurements and checks every estimate
against them. Where memory goes, by category:

- the fp32 weights, their fp32 gradients and the optimizer's state (config/optimizer.py OPTIMIZERS: its bytes
  for the model): sharded over dp_shard under FSDP, whole on one process;
- what each block keeps for backward, by activation-checkpointing mode (the matmul outputs selective
  `op` keeps were measured tensor by tensor on `8b`: docs/benchmarks/2026-11-26-8b-memory-breakdown.md);
- the output layer's logits and their gradient, or with training.loss_chunk_tokens one chunk's logits
  and the gradients the fused loss keeps (the output weight's, the hidden states');
- FSDP's gathered weights (blocks resharded after forward or kept), its all-gather stream's own pool;
- the caching allocator's slack between what is allocated and what it reserves.

The peak is the largest of the moments of a step: the start of backward (every block's activations and
the logits' gradient; gradients only when an earlier micro-batch left them), the end of backward
(gradients whole, activations gone), the first recomputed block of backward, and the optimizer step (its
transient buffers beside the state and the gradients: OPTIMIZERS' step_bytes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from titanlike.config.dims import ParallelDims
from titanlike.config.fp8 import RECIPES, Recipe, float8_all_gather
from titanlike.config.optimizer import DEFAULT, OPTIMIZERS
from titanlike.config.schema import JobConfig
from titanlike.config.speed import matmul_outputs_kept, named_blocks, resolve_reshard
from titanlike.config.stages import Stage
from titanlike.model.shape import BLOCK_MATMULS, ModelArgs, count_params

GIB = 2**30

# ---- constants calibrated against recorded measurements (tests/test_plan.py MEASURED) -------------------
# (What float8 Linears keep for backward is each recipe's: config/fp8.py RECIPES, kept_share and
# op_extra_per_dim.)
# Whole logits: bytes per logit held at the start of backward (bf16 logits and their gradient, less what
# compile's fused head frees early). One process, compiled head: 1b with full recompute and 8-bit moments
# (20.3 GiB), where the logits are most of the peak. Under FSDP the head is eager (its hooks gather the
# output weight) and only the cross-entropy is compiled.
HEAD_BYTES_ONE_PROCESS = 3.2
HEAD_BYTES_SHARDED = 4.5
HEAD_BYTES_EAGER = 10.0  # bf16 logits, the fp32 upcast and log-softmax kept, a gradient: estimated
# The chunked loss: bytes per element of one chunk's logits at once (bf16 logits, their bf16 gradient, and
# fp32 work of the softmax): 124m at chunks of 16,384 and 1b at 4,096 on one H100.
CHUNK_BYTES = 6.0
# What the caching allocator reserves beyond what is allocated (block rounding, fragmentation, the
# temporaries of compiled kernels): a share of the peak allocated.
ALLOCATOR_SLACK = 0.04
# Memory a card has that torch cannot allocate: the CUDA context, cuBLAS workspaces, NCCL's buffers with more
# than one process. Usable = the card's memory less this.
CONTEXT_GIB = 1.0
NCCL_GIB = 0.5

# A block recomputed whole holds, while its backward runs, its recomputed activations and their gradients
# at once: this many times what it holds in flight without recompute (`none`, and under cp one layer's
# gathered window: block_bytes), measured at the first block
# of backward on `1b` and `8b` at 65,536 tokens a GPU (cp 2, tensorwise float8; two H200s): 5.7 and 9.7 GiB
# against 3.7 and 6.1 (docs/benchmarks/2026-11-28-cp-long-window-memory.md).
RECOMPUTE_WORKING = 1.57


@dataclass(frozen=True)
class Estimate:
    """Bytes per GPU by category, at the peak of a step, and the reserved peak they add up to."""

    rows: tuple[tuple[str, float], ...]
    """(category, GiB) at the peak, in the order the report prints them; categories with nothing left out."""
    allocated_gib: float
    reserved_gib: float
    notes: tuple[str, ...] = ()
    exact_gib: float = 0.0
    """The part of reserved_gib counted exactly from the parameter count (weights, gradients, optimizer
    state): the estimate's error lies in the rest."""
    stage: str = ""
    """With several training stages, the one the peak belongs to ("the stage from step N: seq_len …")."""

    def row(self, name: str) -> float:
        return sum(g for n, g in self.rows if n.startswith(name))

    def with_error_gib(self, margin: float) -> float:
        """The most the run may need: what is counted exactly, and the rest `margin` higher (the estimate's
        error against recorded peaks, tests/test_plan.py)."""
        return self.exact_gib + (self.reserved_gib - self.exact_gib) * (1 + margin)


@dataclass(frozen=True)
class Shape:
    """What the estimate reads of a run: the model's shape, the degrees and the options that move memory."""

    args: ModelArgs
    dims: ParallelDims
    tokens: int  # per micro-batch on one rank
    ac_mode: str
    ac_option: str
    ac_budget: float
    fp8: Recipe  # fp8.recipe's facts: what its Linears keep for backward
    float8_all_gather: bool
    compile: bool
    chunk_tokens: int
    state_dtype: str
    reshard: str  # as resolved: never, default or always
    cpu_offload: bool = False
    document_masks: bool = False  # model.attn_mask = block_causal
    ac_blocks: int = 0  # activation_checkpoint.selective_ac_blocks: blocks that follow op:NAMES (0: all)
    cp_kernels: bool = True  # causal attention under cp on the override cp_attention_kernels (parallel.overrides)
    reduce_bytes: int = 4  # bytes a gradient value takes in FSDP's reduce-scatter (training.mixed_precision_reduce)
    grads_in_compute_pool: bool = True  # the override gradients_in_compute_pool (parallel.overrides)
    sync_once_a_step: bool = False  # parallel.gradient_sync = step: micro-batches add gradients up unsharded
    optimizer: str = DEFAULT  # optimizer.name: its state and its step's buffers (config/optimizer.py OPTIMIZERS)


def shape_of(cfg: JobConfig, args: ModelArgs, dims: ParallelDims, card_gib: float | None,
             stage: Stage | None = None) -> Shape:
    """The run's memory-relevant options in `stage` (its window and micro-batch; None: the config's own, the
    first stage's), with `parallel.reshard_after_forward = default` resolved as FSDP resolves it on a card of
    `card_gib` (parallel/fsdp.py resolve_reshard)."""
    t, ac, fp8 = cfg.training, cfg.activation_checkpoint, cfg.fp8
    gathered = 2 * count_params(args)[0]
    reshard = resolve_reshard(cfg.parallel.reshard_after_forward, gathered, int(card_gib * GIB) if card_gib else None)
    # With context parallelism each rank holds 1/cp of every window's tokens (and FSDP shards over dp × cp).
    window, micro_batch = (stage.seq_len, stage.local_batch) if stage else (cfg.data.seq_len, t.local_batch_size)
    return Shape(args, dims, micro_batch * window // dims.cp, ac.mode, ac.selective_ac_option,
                 ac.memory_budget, RECIPES[fp8.recipe], float8_all_gather(fp8, dims.fsdp_shard),
                 cfg.compile.enable, t.loss_chunk_tokens,
                 cfg.optimizer.state_dtype, reshard, cfg.parallel.cpu_offload,
                 cfg.model.attn_mask == "block_causal", ac.selective_ac_blocks,
                 override_chosen(cfg.parallel.overrides, "cp_attention_kernels"),
                 2 if t.mixed_precision_reduce == "bf16" and dims.dp_replicate * dims.fsdp_shard > 1 else 4,
                 override_chosen(cfg.parallel.overrides, "gradients_in_compute_pool"),
                 cfg.parallel.gradient_sync == "step", cfg.optimizer.name)


def override_chosen(overrides: str, name: str) -> bool:
    """Whether parallel.overrides keeps the override `name` (its probe assumed to pass: the plan runs
    where the run will not)."""
    names = {n.strip() for n in overrides.split(",")}
    return "off" not in names and ("on" in names or name in names)


# ---- activations ------------------------------------------------------------------------------------


def op_bytes_per_token(a: ModelArgs) -> float:
    """Selective `op`, bf16: the stacked q/k/v output, the attention output and its fp32 log-sum-exp, the
    two residual-stream tensors the norms' backward reads, the two SwiGLU inputs (w1's and w3's outputs).
    Measured on 8b: 1.443 GiB a block at 16,384 tokens, this formula's 1.440 plus the embedding's share."""
    kv = a.n_kv_heads * a.head_dim
    return 2 * (a.dim + 2 * kv) + 2 * a.dim + 4 * a.n_heads + 4 * a.dim + 4 * a.ffn_dim


def op_kept_bytes_per_token(a: ModelArgs, option: str) -> float:
    """Selective `op:NAMES`: `op`'s tensors less the outputs of the Linears it does not keep (recomputed
    in backward; without wo's, the residual stream after attention too). w2's is never kept. Measured on
    8b: op:wqkv,wo,w1 keeps 0.4375 GiB a block less at 16,384 tokens (w3's), op:wqkv,w1 0.5625 (w3's
    and wo's), docs/benchmarks/2026-11-26-8b-memory-breakdown.md."""
    kept = matmul_outputs_kept(option) or BLOCK_MATMULS
    width = {"wqkv": a.dim + 2 * a.n_kv_heads * a.head_dim, "wo": a.dim, "w1": a.ffn_dim, "w3": a.ffn_dim, "w2": 0}
    return op_bytes_per_token(a) - sum(2 * width[name] for name in BLOCK_MATMULS if name not in kept)


def none_bytes_per_token(a: ModelArgs) -> float:
    """No recompute, compiled: `op`'s tensors, w2's input (SwiGLU's product) and the rotated q and k that
    attention's backward reads, which `op` recomputes; with QK-norm also the normalised q and k."""
    qk = 2 * (a.dim + a.n_kv_heads * a.head_dim)
    return op_bytes_per_token(a) + 2 * a.ffn_dim + qk * (2 if a.qk_norm else 1)


def eager_extra_per_token(a: ModelArgs) -> float:
    """Eager blocks keep what compile's partitioner would recompute: two norm outputs, SiLU's output,
    the rotated q and k. Estimated: no eager run of a large model is recorded."""
    return 4 * a.dim + 2 * a.ffn_dim + 2 * (a.dim + a.n_kv_heads * a.head_dim)


def block_bytes(s: Shape) -> tuple[float, float]:
    """(bytes all blocks keep for backward, bytes one block recomputing in backward holds at once)."""
    a, n, layers = s.args, s.tokens, s.args.n_layers
    none = none_bytes_per_token(a) + (0 if s.compile else eager_extra_per_token(a))
    op = op_bytes_per_token(a)
    if s.ac_option.startswith("op"):  # op:NAMES in the blocks that follow it, op in the others
        named = len(named_blocks(layers, s.ac_blocks))
        op = (named * op_kept_bytes_per_token(a, s.ac_option) + (layers - named) * op) / layers
    if s.fp8.float8:
        none *= s.fp8.kept_share
        op += s.fp8.op_extra_per_dim * a.dim
    block_input = 2 * a.dim  # a fully recomputed block keeps its input only
    if s.dims.cp > 1:
        # Context parallelism (parallel/context.py): attention's backward reads the keys and values of the
        # whole window (kv heads), cp window tokens' worth per local token. Causal attention on the cp kernels
        # (the override cp_attention_kernels) keeps only the rank's own and gathers the window again in
        # backward; flex under document masks, and causal on stock torch, keep the gathered window.
        window = 2 * 2 * a.n_kv_heads * a.head_dim * s.dims.cp
        keeps_window = s.document_masks or not s.cp_kernels
        # Causal on the kernels: parallel/chunk_attention.py keeps its merged output for backward, beside the
        # copy the output projection reads (bf16, the query heads' width), and the rank's keys and values as it
        # stacked them for its gather, in place of the rotated keys. With no recompute nothing then holds the
        # stacked q/k/v projection's output (the values were a view of it): 2·(dim + kv width) bytes a token
        # less, 1.5 GiB of 1b at 32,768 tokens with cp 2, where 2.1 was measured
        # (docs/benchmarks/2026-11-28-cp-attention-as-one-op.md).
        merged = 0 if keeps_window else 2 * a.n_heads * a.head_dim
        own_kv = 2 * 2 * a.n_kv_heads * a.head_dim
        unpinned = 0 if keeps_window else 2 * (a.dim + a.n_kv_heads * a.head_dim)
        # A block being recomputed and differentiated holds the gathered window whichever way (forward's
        # gather, then backward's): what it holds in flight counts it. Not less the projection's output: with
        # full recompute `1b` at 262,144 tokens reserved 0.8 GiB less as one op, while in_flight is scaled up
        # (RECOMPUTE_WORKING) from the same count, which it would have lowered by 1.2.
        in_flight = none + window + merged
        none += (window if keeps_window else 0) + merged - unpinned
        # Selective `op` keeps the projection's output anyway; the op's stacked keys and values come on top.
        op += (window if keeps_window else own_kv + merged)
    else:
        in_flight = none
    if s.ac_mode == "none":
        return layers * none * n, 0.0
    if s.ac_mode == "budget":
        return layers * none * n * s.ac_budget, 0.0
    if s.ac_mode == "selective" and s.ac_option.startswith("op"):
        return layers * op * n, 0.0
    every = 1 if s.ac_mode == "full" else int(s.ac_option)
    recomputed = math.ceil(layers / every)
    kept = (layers - recomputed) * none + recomputed * block_input
    return kept * n, in_flight * n


def block_bytes_recomputed_whole(s: Shape) -> int:
    """Blocks that full or every-N selective recompute whole (they keep only their input)."""
    if s.ac_mode == "full":
        return s.args.n_layers
    if s.ac_mode == "selective" and not s.ac_option.startswith("op"):
        return math.ceil(s.args.n_layers / int(s.ac_option))
    return 0


# ---- the estimate -----------------------------------------------------------------------------------------


def estimate(s: Shape) -> Estimate:
    a, dims = s.args, s.dims
    total, embed = count_params(a)
    shard = dims.fsdp_shard if dims.sharded else 1
    sharded = dims.sharded or s.cpu_offload  # offload runs FSDP even on one GPU
    on_gpu = 0.0 if s.cpu_offload else 1.0  # FSDP's CPU offload keeps these three in host memory
    weights = on_gpu * 4 * total / shard
    grads = on_gpu * 4 * total / shard
    optimizer = OPTIMIZERS[s.optimizer]
    moments = on_gpu * optimizer.state_bytes(a, s.state_dtype) / shard
    # FSDP's own reduce-scatter buffers (HSDP, where the override gradients_in_compute_pool does not act, or
    # that override off) put the gradients in that stream's pool, which the activations freed in backward
    # never refill (8b on two GPUs before they moved: +14.96 GiB, measured). Gradients summed in bf16 land
    # there too: FSDP casts each summed bf16 shard to the fp32 gradient on that stream (1b with cp 2: 2.6 GiB
    # more, docs/benchmarks/2026-11-29-bf16-gradient-sums-one-rank.md).
    own_buffers = dims.dp_replicate > 1 or (dims.sharded and not s.grads_in_compute_pool)
    rs_pool = grads if own_buffers or (s.reduce_bytes == 2 and sharded) else 0.0
    grads -= rs_pool

    kept, recompute = block_bytes(s)
    embedding_out = s.tokens * a.dim * 2
    final_norm = s.tokens * a.dim * 2
    vocab_dim = a.vocab_size * a.dim
    if s.chunk_tokens:
        # Fused: one chunk's logits, their bf16 gradient and the softmax's fp32 work at a time, the output
        # weight's gradient in the compute dtype and the hidden states' gradient kept until backward, the bf16
        # copy of the weight.
        chunk = min(s.chunk_tokens, s.tokens)
        weight_copy = 0 if sharded else 2 * vocab_dim  # FSDP's gathered bf16 weight is that copy already
        head = CHUNK_BYTES * chunk * a.vocab_size + 2 * vocab_dim + 2 * s.tokens * a.dim + weight_copy
    else:
        per_logit = (HEAD_BYTES_EAGER if not s.compile else HEAD_BYTES_SHARDED if sharded else HEAD_BYTES_ONE_PROCESS)
        head = per_logit * s.tokens * a.vocab_size

    block_params = (total - embed - (0 if a.tie_embeddings else vocab_dim) - a.dim) / a.n_layers
    # Backward reads each Linear's weight in the compute dtype: on one process autocast's bf16 copy (float8:
    # the weight cast to float8 and its transpose), kept by every block that is not recomputed whole. Under
    # FSDP the gathered bf16 weights are that copy already; float8 still keeps its casts.
    # Selective `op` and full recompute redo the casts in backward instead.
    selective_op = s.ac_mode == "selective" and s.ac_option.startswith("op")
    copy_bytes = 2.0 if (s.fp8.float8 or not sharded) and not selective_op else 0.0
    kept += copy_bytes * block_params * (a.n_layers - block_bytes_recomputed_whole(s))
    # Offloaded over more than one rank (parallel/fsdp.py keeps torch's reduce-scatter buffers then): each
    # block's reduce-scatter input and output come from the reduce-scatter stream's own pool before
    # the gradients leave for the host; 8b over two GPUs reserved 10.2 GiB against 8.8 on one.
    offload_rs_pool = s.reduce_bytes * block_params * (1 + 1 / shard) if s.cpu_offload and shard > 1 else 0.0
    gathered, ag_pool = 0.0, 0.0
    if sharded:
        block_gathered = block_params * (1 if s.float8_all_gather else 2)
        output_gathered = 0.0 if a.tie_embeddings else 2 * vocab_dim
        if s.reshard == "never":
            # Every weight stays gathered from forward to backward, in the all-gather stream's pool.
            gathered = a.n_layers * block_gathered + 2 * embed + output_gathered
        else:
            # The output layer is kept gathered (backward starts there) unless the fused chunked loss frees
            # it after forward; the blocks are gathered one or two at a time into the all-gather stream's
            # own pool. The embedding's and output layer's gathers pass through that pool as well, but
            # left out here on GPUs: an override once gathered them on the compute stream, and dropping
            # it with another FSDP override cost `8b` on two H200s 0.9 GiB (docs/overrides.md), not
            # their 2 GiB. Offloaded, or tied (the root group), they are counted.
            kept_output = s.reshard == "default" and not s.chunk_tokens
            gathered = output_gathered if kept_output else 0.0
            ag_pool = 2 * block_gathered
            if s.cpu_offload or a.tie_embeddings:
                ag_pool += 2 * embed + (0.0 if kept_output else output_gathered)
    # The start of backward: every block's activations and the loss's; gradients exist only from an earlier
    # micro-batch: sharded, or (parallel.gradient_sync = step) the whole model's, unsharded, in the reduce dtype.
    unsharded_sums = s.sync_once_a_step and sharded and dims.accum_steps > 1
    held_grads = (s.reduce_bytes * total if unsharded_sums else grads) if dims.accum_steps > 1 else 0.0
    start = weights + moments + held_grads + kept + embedding_out + final_norm + head + gathered
    # The end of backward: gradients whole, the last recomputed block and one block's unsharded gradient
    # (bf16, and the reduce-scatter's copy of it under FSDP) at once.
    unsharded_grad = (2 + s.reduce_bytes) * block_params if sharded else 0.0
    end = weights + moments + grads + recompute + unsharded_grad + gathered
    # The first block of backward, recomputed whole: every block's input still kept, the block's recomputed
    # activations and their gradients, the hidden states' gradient, and under FSDP the output layer's fp32
    # gradient and its shard, whose reduce-scatter is still in flight (what the 65,536-token runs measured).
    working = RECOMPUTE_WORKING * recompute + 2 * s.tokens * a.dim
    output_grad = s.reduce_bytes * vocab_dim * (1 + 1 / shard) if sharded and not a.tie_embeddings and on_gpu else 0.0
    first = 0.0
    if s.ac_mode == "full":
        first = weights + moments + held_grads + kept + embedding_out + working + output_grad + gathered
    # The optimizer step: the gradients whole, the gathered weights and activations gone, its own buffers.
    step_buffers = on_gpu * optimizer.step_bytes(a, shard)
    step = weights + moments + grads + step_buffers
    allocated = max(start, end, first, step)
    reserved = allocated * (1 + ALLOCATOR_SLACK) + ag_pool + rs_pool + offload_rs_pool
    at_start = start >= max(end, first, step)
    at_first = not at_start and first > max(end, step)
    at_step = not (at_start or at_first) and step > end
    where = ("start of backward" if at_start else "first recomputed block" if at_first else
             "optimizer step" if at_step else "end of backward")
    in_backward = 0.0 if at_step else 1.0  # what only backward holds
    rows = [
        ("parameters (fp32" + (f", 1/{shard} each" if sharded else "") + ")", weights),
        ("gradients (" + ("the micro-batches' unsharded sums" if unsharded_sums and (at_start or at_first)
                          else "fp32") + ")",
         held_grads if at_start or at_first else grads),
        (f"optimizer state ({optimizer.describe(s.state_dtype)})", moments),
        ("the optimizer step's buffers (counted from its code)", step_buffers if at_step else 0.0),
        ("activations kept for backward" + ac_words(s),
         kept + embedding_out if at_start or at_first else recompute * in_backward),
        ("the recomputed block's activations and gradients, and the hidden states' gradient",
         working if at_first else 0.0),
        ("FSDP: the output layer's gradient, being reduce-scattered", output_grad if at_first else 0.0),
        ("logits and their gradient" + (f" (chunks of {s.chunk_tokens} tokens)" if s.chunk_tokens else " (whole)"),
         head + final_norm if at_start else 0.0),
        ("FSDP gathered weights" + (" (all, kept from forward to backward)" if s.reshard == "never" else
                                    " (the output layer, kept)"), gathered * in_backward),
        ("FSDP one block's unsharded gradient", unsharded_grad * in_backward if not (at_start or at_first) else 0.0),
        ("allocator slack (reserved beyond allocated)", allocated * ALLOCATOR_SLACK),
        ("FSDP all-gather stream's pool (weights being gathered)", ag_pool),
        ("gradients in the reduce-scatter stream's pool (HSDP, bf16 sums, FSDP's own buffers)", rs_pool),
        ("FSDP reduce-scatter stream's pool (offload)", offload_rs_pool),
    ]
    notes = [f"the peak comes at the {where}"]
    if s.cpu_offload:
        host = (8 * total + optimizer.state_bytes(a, s.state_dtype)) / shard
        notes.append("parallel.cpu_offload: weights, gradients and the optimizer's state live in host memory "
                     f"({host / GIB:.1f} GiB of it a rank; {optimizer.describe(s.state_dtype)})")
    exact = weights + moments + (held_grads if at_start or at_first else grads) + rs_pool
    return Estimate(tuple((n, b / GIB) for n, b in rows if b), allocated / GIB, reserved / GIB, tuple(notes),
                    exact / GIB)


def ac_words(s: Shape) -> str:
    if s.ac_mode == "selective":
        what = (f"selective, {s.ac_option}" if s.ac_option.startswith("op")
                else f"selective, every {s.ac_option}th block recomputed")
        if s.ac_option.startswith("op:") and len(named_blocks(s.args.n_layers, s.ac_blocks)) < s.args.n_layers:
            what += f" in {s.ac_blocks} of {s.args.n_layers} blocks, op in the rest"
    elif s.ac_mode == "budget":
        what = f"budget {s.ac_budget}"
    else:
        what = s.ac_mode
    return f" ({what}, {s.tokens:,} tokens{', float8' if s.fp8.float8 else ''}{'' if s.compile else ', eager'})"


def estimate_run(cfg: JobConfig, world: int, card_gib: float | None = None, args: ModelArgs | None = None) -> Estimate:
    """The estimate for a validated config at `world` ranks, with parallel.reshard_after_forward = default
    resolved for a card of `card_gib` (or training.gpu_memory_limit_gib when set, as the trainer does);
    `args`: the model's shape, where the run is resolved already (else resolved here). Every training stage
    is estimated (its window, micro-batch and micro-batches a step): the largest is the run's, and says which
    stage it is. ConfigError (one line) for a world size or batch that does not work, as the preflight says it."""
    import dataclasses

    from titanlike.config.dims import parallel_dims
    from titanlike.config.resolve import resolve_model
    from titanlike.config.sources import schedule_of
    from titanlike.config.stages import resolve_stages

    dims = parallel_dims(cfg, world)
    cap = cfg.training.gpu_memory_limit_gib
    card = min(cap, card_gib) if cap and card_gib else cap or card_gib
    schedule = schedule_of(cfg.data)
    args = args if args is not None else resolve_model(cfg, schedule).args
    stages = resolve_stages(cfg, args, dims.dp, schedule)
    each = [estimate(shape_of(cfg, args, dataclasses.replace(dims, global_batch=st.global_batch,
                                                              accum_steps=st.accum_steps), card, st))
            for st in stages.stages]
    peak = max(range(len(each)), key=lambda i: each[i].reserved_gib)
    if len(each) == 1:
        return each[0]
    st = stages[peak]
    where = "the first stage" if peak == 0 else f"the stage from step {st.start_step}"
    others = ", ".join(f"{e.reserved_gib:.1f}" for i, e in enumerate(each) if i != peak)
    note = (f"{where} (seq_len {st.seq_len}, micro-batch {st.local_batch}) needs the most of the "
            f"{len(each)} stages; the others {others} GiB")
    return dataclasses.replace(each[peak], notes=(*each[peak].notes, note),
                               stage=f"{where}: seq_len {st.seq_len}, micro-batch {st.local_batch}")


def cpu_host_problem(cfg: JobConfig, world: int, local_processes: int, args: ModelArgs) -> str | None:
    """For a run on the CPU (no GPU visible, or training.device = cpu) of the model shape `args`: why this
    host cannot hold it, or None. Each process holds what a GPU would (titanlike-plan's estimate, a floor:
    on a CPU the activations are fp32), and all `local_processes` of this host hold theirs at once."""
    from titanlike.config.host import host_available_bytes

    per_process = estimate_run(cfg, world, args=args).reserved_gib
    need, have = per_process * local_processes, host_available_bytes() / 2**30
    if need <= have:
        return None
    each = (f"each of the {local_processes} processes of this host needs at least {per_process:.1f} GiB of memory "
            f"(titanlike-plan's estimate), {need:.1f} GiB in all" if local_processes > 1 else
            f"it needs at least {need:.1f} GiB of memory (titanlike-plan's estimate)")
    # Advice that fits the run: GPUs for a GPU config that found none (the debug model is the CPU's own, and
    # training.device = cpu was asked for), a smaller model where there is one, fewer processes, fewer tokens.
    m, debug = cfg.model, cfg.model.flavor == "debug"
    resized = [f"{key} {getattr(m, key)}" for key in ("dim", "n_layers", "ffn_dim", "vocab_size") if getattr(m, key)]
    smaller = (["a smaller model (--model.flavor debug)"] if not debug else
               [f"smaller --model.* sizes (now {', '.join(resized)})"] if resized else [])
    if local_processes > 1:
        smaller.append(f"fewer processes on this host (now {local_processes}: NGPU)")
    smaller.append(f"fewer tokens a step (now --training.local_batch_size {cfg.training.local_batch_size} of "
                   f"--data.seq_len {cfg.data.seq_len})")
    gpus = "run it where its GPUs are, or " if not debug and cfg.training.device != "cpu" else ""
    return (f"this run trains on the CPU (no GPU is visible, or training.device = cpu), where {each}, and this "
            f"host has {have:.1f} GiB available; {gpus}choose {' or '.join(smaller)}")
