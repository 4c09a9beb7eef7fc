"""Activation checkpointing: what each block keeps for backward and what it recomputes
(activation_checkpoint.mode: none, full, selective by op (every matmul's output or the ones named) or
every N blocks, or a memory budget)."""

from __future__ import annotations

from collections.abc import Callable

from titanlike.config.speed import ActivationCheckpoint, matmul_outputs_kept, named_blocks
from titanlike.model.decoder import Transformer
from titanlike.model.shape import BLOCK_MATMULS
from titanlike.overrides.attention import attention_ops, matmul_ops
from titanlike.overrides.compile import set_activation_memory_budget
from titanlike.parallel.chunk_attention import ATTENTION_OP as CP_CAUSAL_ATTENTION


def _save_policy_context(keep: frozenset[int] | None):
    """Op-level selective AC: keep attention and float8 amax outputs, and the outputs of the block's
    matmuls whose place in the block's forward is in `keep` (None: all of them); recompute the rest.

    Returns a `context_fn` for torch.utils.checkpoint. The policy sees aten ops, not modules, so it
    tells the block's Linears apart by their order: the k-th matmul (mm, or float8's _scaled_mm) of a
    block's forward is the k-th of BLOCK_MATMULS (model/shape.py; a test checks the decoder keeps that
    order). Each call of the block gets a fresh count, made when checkpoint() asks for its contexts,
    and the forward and a recomputation count apart (torch versions that ask the policy again while
    recomputing give it is_recompute = True). Compiled, the policy runs once, while the block is traced.
    """
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    # Attention's and float8's amax outputs (the op names are SDPA's private kernels: overrides/attention.py),
    # and context parallelism's causal attention (recomputed, its collectives would run again). The keys and
    # values it gathers are not among them: its backward gathers them again, so that what a rank keeps for
    # backward shrinks with cp (docs/parallelism.md).
    save = attention_ops() | {CP_CAUSAL_ATTENTION}
    matmuls = matmul_ops()

    def context():
        seen = {False: 0, True: 0}  # matmuls so far in this call's forward, and in its recomputation

        def policy(ctx, op, *args, **kwargs):
            if op in matmuls:
                index = seen[ctx.is_recompute]
                seen[ctx.is_recompute] += 1
                kept = keep is None or index in keep
                return CheckpointPolicy.MUST_SAVE if kept else CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return context


# Op-level policies by name ("op", "op:NAMES"): a block's hooks.recompute looks its policy up here by the
# block's hooks.policy. Compiled, that lookup is what makes dynamo guard on the name, so blocks under
# different policies get a graph each; a policy bound into hooks.recompute (a partial) is not guarded, and
# every block ran the first one's (tests/test_parallel.py).
_POLICIES: dict[str, Callable] = {}


def _checkpointed(body, *args, policy: str = ""):
    from torch.utils.checkpoint import checkpoint

    context_fn = _POLICIES[policy] if policy else None
    if context_fn is None:
        return checkpoint(body, *args, use_reentrant=False)
    return checkpoint(body, *args, use_reentrant=False, context_fn=context_fn)


def checkpointed_around_compiled(body, *args, policy: str = ""):
    """A whole block checkpointed around its compiled body (parallel/compile.py, under context parallelism).
    Its recompute runs the compiled graph whole: early stop, which raises out of the recompute once the
    tensors backward needs are back, failed inside the graph's autograd Function on torch 2.11 ("returned
    NULL without setting an exception", two H200s), and a compiled graph cannot stop part-way anyway."""
    from torch.utils.checkpoint import checkpoint

    return checkpoint(body, *args, use_reentrant=False, early_stop=False)


def apply_activation_checkpointing(model: Transformer, ac: ActivationCheckpoint) -> None:
    """What each block of `model` keeps for backward, as the [activation_checkpoint] section says: its mode,
    selective_ac_option, memory_budget and selective_ac_blocks (with an op:NAMES option, how many blocks
    follow it; the others follow "op")."""
    mode, option = ac.mode, ac.selective_ac_option
    if mode == "none":
        return
    if mode == "budget":
        # No checkpoint wrapper: compile's min-cut partitioner decides what each graph saves, held
        # to `budget` of the bytes it would save unbudgeted. A process-wide setting, so it applies
        # to every graph compiled here (the blocks and the loss), read when each is compiled.
        set_activation_memory_budget(ac.memory_budget)
        return
    kept = matmul_outputs_kept(option) if mode == "selective" else None
    if kept is not None:
        keep = None if kept == BLOCK_MATMULS else frozenset(BLOCK_MATMULS.index(name) for name in kept)
        _POLICIES[option] = _save_policy_context(keep)
        _POLICIES["op"] = _save_policy_context(None)
        blocks = list(model.blocks())
        named = named_blocks(len(blocks), ac.selective_ac_blocks)
        for i, block in enumerate(blocks):
            block.hooks.recompute, block.hooks.policy = _checkpointed, option if i in named else "op"
        return
    every = 1 if mode == "full" else int(option)
    for i, block in enumerate(model.blocks()):
        if i % every == 0:
            block.hooks.recompute = _checkpointed
