"""The training loss: mean next-token cross-entropy of a model on (inputs, targets).

Two ways to the same number. Whole: the model returns all logits, (tokens × vocab), and the loss
reads them. Chunked (training.loss_chunk_tokens): the model hands its final hidden states to
`chunked_output_loss`, which runs the output layer and the cross-entropy on chunks of that many
tokens, keeping no chunk's logits for backward: backward recomputes them, a chunk at a time. With a
128K vocabulary the logits of a 4096-token micro-batch are 1 GiB in bf16, 2 more in fp32 for the
softmax, and their gradient as much again; chunked, only one chunk's exist at any moment, for one
more output-layer matmul per chunk in backward.

The output layer is always *called* (`output(h_chunk)`), never its weight read: FSDP gathers the
weight in the module's forward hooks, and a float8 output layer does its casts there.

Compiled on one process (no FSDP), the whole-logits loss compiles the final norm, the output layer
and the cross-entropy as one graph (`head_loss`), so the norm, the casts of the output layer's input
and weight (to bf16 under autocast, or float8) and the softmax fuse around its matmul instead of
running as separate eager kernels. Under FSDP those modules' forward hooks (which gather the
weights) must run outside compiled code, so there only the cross-entropy is compiled.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # In fp32 whatever the logits' dtype; compiled, the upcast fuses into the softmax instead of
    # materialising a float copy of the (tokens × vocab) logits.
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed (not averaged) fp32 cross-entropy of one chunk's (tokens × vocab) logits."""
    return F.cross_entropy(logits.float(), targets, reduction="sum")


def head_loss(norm: nn.Module, output: nn.Module, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the logits `output(norm(h))`: the model's head and the loss in one."""
    return cross_entropy(output(norm(h)), targets)


def _chunk_loss(output: nn.Module, h: torch.Tensor, targets: torch.Tensor, ce_sum) -> torch.Tensor:
    return ce_sum(output(h), targets)


def chunked_output_loss(output: nn.Module, h: torch.Tensor, targets: torch.Tensor, chunk_tokens: int,
                        ce_sum=cross_entropy_sum) -> torch.Tensor:
    """Mean cross-entropy of `output(h)` against `targets`, computed `chunk_tokens` tokens at a time;
    each chunk runs under activation checkpointing, so its logits are recomputed in backward
    instead of kept. h: (batch, seq, dim); targets: (batch, seq)."""
    h, targets = h.flatten(0, 1), targets.flatten(0, 1)
    total = None
    # split, not slicing: its backward writes the chunks' gradients into one tensor, once.
    for h_chunk, t_chunk in zip(h.split(chunk_tokens), targets.split(chunk_tokens)):
        part = checkpoint(_chunk_loss, output, h_chunk, t_chunk, ce_sum, use_reentrant=False)
        total = part if total is None else total + part
    assert total is not None, "h holds at least one token, so one chunk"
    return total / targets.numel()


def build_loss(chunk_tokens: int, compile: bool, compile_head: bool = False) -> LossFn:
    """loss(model, inputs, targets): over whole logits (chunk_tokens = 0) or chunked. With `compile`,
    the cross-entropy is compiled (the upcast and softmax then fuse into one kernel); with
    `compile_head` too (one process: no FSDP hooks on the head), the final norm and the output layer
    are compiled with it into one graph."""
    if not chunk_tokens:
        if compile and compile_head:
            compiled_head = torch.compile(head_loss, fullgraph=True)

            def compiled_head_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
                return model(inputs, head=lambda norm, output, h: compiled_head(norm, output, h, targets))

            return compiled_head_loss
        ce = torch.compile(cross_entropy) if compile else cross_entropy

        def whole_logits_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return ce(model(inputs), targets)

        return whole_logits_loss

    # Chunks all have chunk_tokens rows but the last: two compiled graphs at most.
    ce_sum = torch.compile(cross_entropy_sum) if compile else cross_entropy_sum

    def chunked_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        def head(norm: nn.Module, output: nn.Module, h: torch.Tensor) -> torch.Tensor:
            return chunked_output_loss(output, norm(h), targets, chunk_tokens, ce_sum)

        return model(inputs, head=head)

    return chunked_loss
