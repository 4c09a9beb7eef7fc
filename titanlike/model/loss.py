"""The training loss: mean next-token cross-entropy of a model on (inputs, targets).

Two ways to the same number. Whole: the model returns all logits, (tokens × vocab), and the loss
reads them. Chunked (training.loss_chunk_tokens): the model hands its final hidden states to the
loss, which runs the output layer and the cross-entropy on chunks of that many tokens, so the whole
logits never exist. With a 128K vocabulary the logits of a 4096-token micro-batch are 1 GiB in bf16,
2 more in fp32 for the softmax, and their gradient as much again; chunked, only one chunk's exist
at any moment.

The chunked loss comes in two kinds:
- Fused (`LinearCrossEntropy`, a bias-free high-precision output layer, on one process or under
  FSDP): each chunk's gradients, for the hidden states and the output weight, are computed in
  forward while its logits exist, and kept for backward (tokens × dim and vocab × dim: small next to
  the logits). The output layer's three matmuls run once each, as over whole logits. It runs as the
  output layer's `loss_sum`, which FSDP treats as a forward (the gathered weight is only there).
- Recomputed (`chunked_output_loss`, a float8 output layer): each chunk runs under activation
  checkpointing and backward recomputes its logits, one more output-layer matmul per chunk. It
  *calls* the output layer (`output(h_chunk)`), never reads its weight: a float8 output layer does
  its casts in its forward.

Compiled on one process (no FSDP), the whole-logits loss compiles the final norm, the output layer
and the cross-entropy as one graph (`head_loss`), so the norm, the casts of the output layer's input
and weight (to bf16 under autocast, or float8) and the softmax fuse around its matmul instead of
running as separate eager kernels. Under FSDP those modules' forward hooks (which gather the
weights) must run outside compiled code, so there only the cross-entropy is compiled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, overload

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

# loss(model, inputs, targets, context=None): `context`, with context parallelism, the micro-batch's
# SequenceShard (parallel/context.py), handed to the model's forward.
LossFn = Callable[..., torch.Tensor]
TokenLossFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""(the mean loss, as LossFn's; each token's loss, detached, fp32, shaped like the targets)."""


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # In fp32 whatever the logits' dtype; compiled, the upcast fuses into the softmax instead of
    # materialising a float copy of the (tokens × vocab) logits.
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed (not averaged) fp32 cross-entropy of one chunk's (tokens × vocab) logits."""
    return F.cross_entropy(logits.float(), targets, reduction="sum")


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each token's fp32 cross-entropy, detached, for (tokens × vocab) logits: a reading beside the
    loss (per-source training loss), never part of what backward sees."""
    return F.cross_entropy(logits.detach().float(), targets, reduction="none")


def head_loss(norm: nn.Module, output: nn.Module, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the logits `output(norm(h))`: the model's head and the loss in one."""
    return cross_entropy(output(norm(h)), targets)


def head_token_losses(norm: nn.Module, output: nn.Module, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each token's loss (token_cross_entropy) of the logits `output(norm(h))`, for a reading under no_grad."""
    return token_cross_entropy(output(norm(h)).flatten(0, 1), targets.flatten(0, 1))


def _chunk_loss(output: nn.Module, h: torch.Tensor, targets: torch.Tensor, ce_sum) -> torch.Tensor:
    return ce_sum(output(h), targets)


def _chunk_loss_and_tokens(output: nn.Module, h: torch.Tensor, targets: torch.Tensor, ce_sum
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    logits = output(h)
    return ce_sum(logits, targets), token_cross_entropy(logits, targets)


def chunked_output_loss(output: nn.Module, h: torch.Tensor, targets: torch.Tensor, chunk_tokens: int,
                        ce_sum=cross_entropy_sum, token_losses: torch.Tensor | None = None) -> torch.Tensor:
    """Mean cross-entropy of `output(h)` against `targets`, computed `chunk_tokens` tokens at a time;
    each chunk runs under activation checkpointing, so its logits are recomputed in backward
    instead of kept. h: (batch, seq, dim); targets: (batch, seq). Given `token_losses` (fp32, one
    per token), each token's loss is written there too; the mean is the same either way."""
    h, targets = h.flatten(0, 1), targets.flatten(0, 1)
    total = None
    # split, not slicing: its backward writes the chunks' gradients into one tensor, once.
    for i, (h_chunk, t_chunk) in enumerate(zip(h.split(chunk_tokens), targets.split(chunk_tokens))):
        if token_losses is None:
            part = checkpoint(_chunk_loss, output, h_chunk, t_chunk, ce_sum, use_reentrant=False)
        else:
            part, tokens = checkpoint(_chunk_loss_and_tokens, output, h_chunk, t_chunk, ce_sum, use_reentrant=False)
            token_losses[i * chunk_tokens:i * chunk_tokens + len(tokens)] = tokens
        total = part if total is None else total + part
    assert total is not None, "h holds at least one token, so one chunk"
    return total / targets.numel()


def cross_entropy_sum_grad_and_tokens(logits: torch.Tensor, targets: torch.Tensor
                                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's summed fp32 cross-entropy, its gradient with respect to the logits,
    softmax(logits) − onehot(targets), in the logits' dtype, and the per-token losses the sum adds up
    (fp32, one per row, detached). Compiled, this is one pass over the logits for the row maxima and
    sums and one that writes the gradient."""
    x = logits.float()
    shifted = x - x.amax(dim=-1, keepdim=True)
    exp = shifted.exp()
    sum_exp = exp.sum(dim=-1, keepdim=True)
    per_token = sum_exp.log() - shifted.gather(-1, targets[:, None])
    loss = per_token.sum()
    is_target = torch.arange(x.shape[-1], device=x.device) == targets[:, None]
    grad = exp / sum_exp - is_target.float()
    return loss, grad.to(logits.dtype), per_token[:, 0].detach()


def without_tokens(ce_grad: Callable[..., tuple[torch.Tensor, ...]]
                   ) -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """`ce_grad` (cross_entropy_sum_grad_and_tokens, compiled or not) giving the sum and the gradient alone.
    The plain loss runs the graph that also gives each token's loss (a mixture's, build_loss's per_token):
    the same graph gives the same sum to the last bit, where a graph of its own fused the sum another way
    on a GPU. The per-token losses it writes besides are 4 bytes a token."""

    def sum_and_grad(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        loss, grad, _ = ce_grad(logits, targets)
        return loss, grad

    return sum_and_grad


cross_entropy_sum_and_grad = without_tokens(cross_entropy_sum_grad_and_tokens)
"""One chunk's summed fp32 cross-entropy and its gradient with respect to the logits."""


class LinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of `h @ weight.T` against `targets`, `chunk_tokens` rows at a time, with
    the gradients computed in forward: per chunk one matmul for the logits, then the loss and the
    logits' gradient (`ce_grad`, compiled or not; given `token_losses`, each row's loss is written
    there too), then one matmul each for the chunk's share of the
    hidden states' and the weight's gradients; the logits are freed before the next chunk. Backward
    only scales what forward kept by the incoming gradient.

    Under autocast the matmuls run in the autocast dtype, as `nn.Linear` would, and the weight's
    gradient sums the chunks in that dtype too, as autograd does for recomputed chunks (an fp32 sum
    would hold 0.5 GiB more on `1b` and cost a copy of each chunk's product)."""

    @staticmethod
    def forward(ctx, h, weight, targets, chunk_tokens, ce_grad, token_losses=None):
        device = h.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype
        with torch.autocast(device, enabled=False):
            x, w = h.to(dtype), weight.to(dtype)
            want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
            grad_h = torch.empty_like(x) if want_h else None
            grad_w = torch.zeros_like(w) if want_w else None
            total = torch.zeros((), dtype=torch.float32, device=h.device)
            for start in range(0, x.shape[0], chunk_tokens):
                x_chunk, t_chunk = x[start:start + chunk_tokens], targets[start:start + chunk_tokens]
                # With `token_losses` (fp32, one per row), ce_grad is cross_entropy_sum_grad_and_tokens.
                loss, grad_logits, *tokens = ce_grad(x_chunk @ w.t(), t_chunk)
                if token_losses is not None:
                    token_losses[start:start + chunk_tokens] = tokens[0]
                total += loss
                if grad_h is not None:
                    torch.mm(grad_logits, w, out=grad_h[start:start + chunk_tokens])
                if grad_w is not None:
                    torch.addmm(grad_w, grad_logits.t(), x_chunk, out=grad_w)  # adds in the matmul: no product copy
                # Freed now, not when the next chunk's replaces it: else the next logits and their
                # gradient would be allocated beside it (a third chunk's worth, 1 GiB on 8b).
                del grad_logits
        ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = (h.dtype, weight.dtype)
        ctx.spent = False
        return total

    @staticmethod
    def backward(ctx, grad_total):
        # The weight's gradient is scaled in place (a second copy of it would cost 0.5 GiB on 1b),
        # so a second backward through the same graph would be wrong: refuse it.
        if ctx.spent:
            raise RuntimeError("LinearCrossEntropy's backward runs once per forward")
        ctx.spent = True
        grad_h, grad_w = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        if grad_h is not None:
            grad_h = (grad_h * grad_total).to(h_dtype)
        if grad_w is not None:
            grad_w = grad_w.mul_(grad_total).to(w_dtype)  # fp32 for the fp32 weight under autocast
        return grad_h, grad_w, None, None, None, None


def fuses(output: nn.Module) -> bool:
    """Whether the chunked loss may compute the output layer's gradients in forward: the model's own
    bias-free output layer, with its `loss_sum` (under FSDP too). Not a float8 layer (its casts
    happen in its forward): that one is called, chunk by chunk."""
    return callable(getattr(output, "loss_sum", None)) and getattr(output, "bias", None) is None


@overload
def build_loss(chunk_tokens: int, compile: bool, compile_head: bool = ..., *,
               per_token: Literal[False] = ...) -> LossFn: ...
@overload
def build_loss(chunk_tokens: int, compile: bool, compile_head: bool = ..., *,
               per_token: Literal[True]) -> TokenLossFn: ...
def build_loss(chunk_tokens: int, compile: bool, compile_head: bool = False, *,
               per_token: bool = False) -> LossFn | TokenLossFn:
    """loss(model, inputs, targets, context=None): over whole logits (chunk_tokens = 0) or chunked. With
    `compile`, the cross-entropy is compiled (the upcast and softmax then fuse into one kernel); with
    `compile_head` too (one process: no FSDP hooks on the head), the final norm and the output layer are
    compiled with it into one graph.

    `per_token` (a mixture's per-source training loss): the loss returns (the mean loss, each token's fp32
    loss, detached, shaped like the targets), the mean computed by the same operations on the same values
    as without, so bit for bit the same. The reading costs one more pass over each chunk's logits (the
    fused chunked loss gets it from the pass it makes anyway; the compiled head, one more forward of the
    output layer)."""
    if chunk_tokens:
        return _chunked_loss(chunk_tokens, compile, per_token)
    if compile and compile_head:
        return _compiled_head_loss(per_token)
    return _whole_logits_loss(compile, per_token)


def _compiled_head_loss(per_token: bool) -> Callable[..., Any]:
    compiled_head = torch.compile(head_loss, fullgraph=True)
    # The per-token reading is a second graph under no_grad: one graph giving both fused differently on a
    # GPU (the loss then differed in its last bits), for one more output-layer matmul (forward only) a step.
    compiled_tokens = torch.compile(head_token_losses, fullgraph=True) if per_token else None

    def compiled_head_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                           context: object = None) -> Any:
        def head(norm: nn.Module, output: nn.Module, h: torch.Tensor) -> Any:
            loss = compiled_head(norm, output, h, targets)
            if compiled_tokens is None:
                return loss
            with torch.no_grad():
                return loss, compiled_tokens(norm, output, h, targets)

        return _shaped(model(inputs, head=head, context=context), targets, per_token)

    return compiled_head_loss


def _whole_logits_loss(compile: bool, per_token: bool) -> Callable[..., Any]:
    ce = torch.compile(cross_entropy) if compile else cross_entropy
    ce_tokens = (torch.compile(token_cross_entropy) if compile else token_cross_entropy) if per_token else None

    def whole_logits_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, context: object = None) -> Any:
        logits = model(inputs, context=context)
        if ce_tokens is None:
            return ce(logits, targets)
        return ce(logits, targets), ce_tokens(logits.flatten(0, 1), targets.flatten(0, 1)).view_as(targets)

    return whole_logits_loss


def _chunked_loss(chunk_tokens: int, compile: bool, per_token: bool) -> Callable[..., Any]:
    # Chunks all have chunk_tokens rows but the last: two compiled graphs at most, each.
    ce_sum = torch.compile(cross_entropy_sum) if compile else cross_entropy_sum
    with_tokens = torch.compile(cross_entropy_sum_grad_and_tokens) if compile else cross_entropy_sum_grad_and_tokens
    ce_grad = with_tokens if per_token else without_tokens(with_tokens)

    def chunked_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, context: object = None) -> Any:
        def head(norm: nn.Module, output: nn.Module, h: torch.Tensor) -> Any:
            h = norm(h)
            if torch.is_grad_enabled() and fuses(output):
                loss_sum: Callable = output.loss_sum  # type: ignore[assignment]
                out = loss_sum(h.flatten(0, 1), targets.flatten(0, 1), chunk_tokens, ce_grad, token_losses=per_token)
                return (out[0] / targets.numel(), out[1]) if per_token else out / targets.numel()
            tokens = torch.empty(targets.numel(), dtype=torch.float32, device=targets.device) if per_token else None
            loss = chunked_output_loss(output, h, targets, chunk_tokens, ce_sum, token_losses=tokens)
            return loss if tokens is None else (loss, tokens)

        return _shaped(model(inputs, head=head, context=context), targets, per_token)

    return chunked_loss


def _shaped(out: Any, targets: torch.Tensor, per_token: bool) -> Any:
    """The loss as the model's head returned it; with per_token, each token's loss shaped like the targets."""
    if not per_token:
        return out
    loss, tokens = out
    return loss, tokens.view_as(targets)
