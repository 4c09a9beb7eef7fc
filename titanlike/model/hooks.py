"""Every way code outside the model changes how it runs, declared in one place: the model's hooks.

decoder.py is the plain model: causal (or document-masked) attention on one rank, every activation kept for
backward, eager. The transforms of parallel/ change parts of that through these fields, beside torch's own
APIs (nn.Module.compile, FSDP's fully_shard), and set no other attribute of a model
(tests/test_parallel.py checks it). `print(model.hooks)` shows what a model runs with.

    model.hooks                 ModelHooks: the whole model's
    model.hooks.blocks[i]       BlockHooks: block i's, the same object as model.layers[i].hooks

Why an object of fields rather than wrapper modules (TorchTitan wraps each block for activation
checkpointing and swaps in an inner attention module): a wrapper puts its own name into every parameter's
(`layers.0._checkpoint_wrapped_module.attention.wqkv.weight`), and those names are the checkpoint's keys,
the Hugging Face export's and FSDP's units; and compiled blocks share one graph only where what they read
is equal, which dynamo checks by value here (two blocks with equal hooks: one graph; tests/test_parallel.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class BlockHooks:
    """How one block runs where a transform changes it. Each block holds its own (`block.hooks`)."""

    attend: Callable[..., torch.Tensor] | None = None
    """Context parallelism (parallel/context.py): attention of this rank's part of the sequence over the keys
    of the whole group, attend(q, k, v, mask, gqa) on (batch, heads, seq, head_dim). None: attention over
    the local sequence (SDPA's causal kernel, or the document mask)."""
    recompute: Callable[..., torch.Tensor] | None = None
    """Activation checkpointing (parallel/activation_checkpoint.py): recompute(body, *args, policy=) runs the
    block's body so that its activations are recomputed in backward. None: every activation kept."""
    policy: str = ""
    """The name of `recompute`'s policy of what to keep (selective AC by op), which `recompute` looks the
    policy up by. Compiled blocks share graphs, and dynamo does not look into a policy function: it guards
    on this name, so blocks under different policies (activation_checkpoint.selective_ac_blocks) get a
    graph each. "": recompute the whole block."""
    body: Callable[..., torch.Tensor] | None = None
    """What runs as the block's body instead of TransformerBlock.body: its compiled graph, where
    parallel/compile.py compiles the body alone (context parallelism with a block recomputed whole: the
    checkpoint then runs around the compiled graph, not inside it). None: TransformerBlock.body."""


@dataclass
class ModelHooks:
    """How the whole model runs where a transform changes it (`model.hooks`)."""

    blocks: list[BlockHooks]
    """Each block's hooks, in block order (the objects the blocks hold)."""
    before_block: dict[int, Callable[[], None]] = field(default_factory=dict)
    """Called, by block index, before that block's forward: between blocks, outside their compiled graphs (a
    hook on a compiled block is traced into it). parallel.StepFence holds the CPU there under context
    parallelism."""
    flex_attention: bool | None = None
    """Document masks (model.attn_mask = block_causal) as flex attention's BlockMask (True) or a dense mask
    for SDPA (False); None: flex on CUDA, dense on a CPU. Tests set it to hold one against the other."""
