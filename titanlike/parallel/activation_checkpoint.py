"""Activation checkpointing: what each block keeps for backward and what it recomputes
(activation_checkpoint.mode: none, full, selective by op or every N blocks, or a memory budget)."""

from __future__ import annotations

from functools import partial

import torch

from titanlike.model.decoder import Transformer


def _save_matmuls_policy():
    """Op-level selective AC: keep matmul, attention and float8 amax outputs; recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    save = {aten.mm.default, aten._scaled_mm.default, aten.max.default, aten.amax.default,
            aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_efficient_attention.default}
    if hasattr(aten, "_scaled_dot_product_cudnn_attention"):
        save.add(aten._scaled_dot_product_cudnn_attention.default)
    if hasattr(torch.ops.higher_order, "flex_attention"):  # model.attn_mask = block_causal
        save.add(torch.ops.higher_order.flex_attention)
    # Context parallelism (parallel/context.py): the bottom-right causal kernel, and the gathered keys
    # and values, so that backward does not gather them again.
    save.add(aten._efficient_attention_forward.default)
    for namespace in ("_c10d_functional", "_c10d_functional_autograd"):
        ops = getattr(torch.ops, namespace, None)
        if ops is not None and hasattr(ops, "all_gather_into_tensor"):
            save.add(ops.all_gather_into_tensor.default)

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _checkpointed(body, *args, context_fn=None):
    from torch.utils.checkpoint import checkpoint

    if context_fn is None:
        return checkpoint(body, *args, use_reentrant=False)
    return checkpoint(body, *args, use_reentrant=False, context_fn=context_fn)


def apply_activation_checkpointing(model: Transformer, mode: str, option: str, budget: float = 1.0) -> None:
    if mode == "none":
        return
    if mode == "budget":
        # No checkpoint wrapper: compile's min-cut partitioner decides what each graph saves, held
        # to `budget` of the bytes it would save unbudgeted. A process-wide setting, so it applies
        # to every graph compiled here (the blocks and the loss), read when each is compiled.
        import torch._functorch.config as functorch_config

        functorch_config.activation_memory_budget = budget
        return
    if mode == "selective" and option == "op":
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        policy = _save_matmuls_policy()
        runner = partial(_checkpointed, context_fn=partial(create_selective_checkpoint_contexts, policy))
        for block in model.blocks():
            block.checkpoint_fn = runner
        return
    every = 1 if mode == "full" else int(option)
    for i, block in enumerate(model.blocks()):
        if i % every == 0:
            block.checkpoint_fn = _checkpointed
