"""Causal attention of a context-parallel rank's chunks over the window's keys, with the collectives of the
group's keys and values running beside attention that does not need them.

A rank's chunk c of a window cut into chunks of L tokens holds the queries at window positions
[cL, cL + L); under a causal mask they see keys [0, cL + L): every key before the chunk, unmasked, and
the chunk's own keys under the square causal mask. cuDNN's fused attention (through
`_scaled_dot_product_cudnn_attention`, what SDPA runs for the whole window on Hopper) aligns its
causal mask to the top left, which is only right for the square block, so each chunk is two parts:

    square: queries of c against keys [cL, cL + L), causal  (the rank's own keys)
    prefix: queries of c against keys [0, cL), no mask      (absent for chunk 0)

merged exactly with their log-sum-exps (out = Σ out_p · exp(lse_p − lse), lse = log Σ exp(lse_p)).
Backward calls the kernel's backward for each part with the merged output and log-sum-exp, which makes
each part's softmax the merged one (ring attention's rule), and adds the parts' gradients up.
Grouped-query kv heads go to the kernel as they are (it shares them).

The order of the work, the point of this module:
- forward: start the all-gather of the group's keys and values; the square parts (the rank's own keys)
  while it runs; wait; the prefixes; merge.
- backward: start the all-gather again (only the rank's own keys and values are kept for backward, so
  what a rank keeps shrinks with cp); the first chunk's square while it runs; wait; the prefixes, whose
  key and value gradients belong to the ranks that hold those keys; start the reduce-scatter that sums
  them there; the other chunks' squares while it runs; wait.

Both directions are one custom op each (torch.library, public): torch.compile sees an opaque call, as it
sees SDPA's kernels, and the order above is the order on the GPU. Traced by compile as ops of the block
instead, inductor placed both gathers after the square parts and the reduce-scatter where nothing ran
beside it (its schedule, read in the generated code: CPU, torch 2.13), and on two H200s the reduce-scatter
waited exposed 1.2 ms a layer at 32,768 tokens (docs/benchmarks/2026-11-28-cp-speed-and-memory-after-the-fixes.md);
as ops, `1b` with cp 2 ran 1.028x faster there (docs/benchmarks/2026-11-28-cp-attention-as-one-op.md).
The ops take the rank's chunks, kernel and exchange by a number (`plan`), as ops take no Python objects.

The collectives go through an exchange (context.py's KeyValueExchange: c10d's async all-gather and
reduce-scatter; the tests hand in a stand-in), each started and finished apart. These kernels are an
override of torch's internals (titanlike/overrides: cp_attention_kernels); off, context.py's stock path
runs SDPA's public front door instead.

Kernels: CudnnKernel on a GPU in bf16/fp16; CpuKernel, torch's fused CPU attention, on a CPU (what
the gloo tests run); TorchKernel, attention written out in torch, on a GPU in fp32. Why not FlashAttention's
bottom-right causal mask in one call per chunk (SDPA's flash op takes fewer queries than keys that
way): a slower kernel; a cp 2 rank of `1b` at 16,384 tokens ran at 0.67× one GPU's speed on it, 0.81×
on cuDNN's parts (H200, docs/benchmarks/2026-11-26-cp-kernels-fit-to-target.md).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn.functional import logsigmoid

from titanlike.overrides import attention as private


class CudnnKernel:
    """One part's attention and its backward on cuDNN (the ops SDPA's own autograd calls,
    overrides/attention.py). `forward` gives (out, lse as (b, h, L, 1) fp32, state): the state, the
    random-number seed and offset cuDNN's backward takes back, is `state_size` int64 values."""

    state_size = 2
    lse_dims = 4  # the log-sum-exp's dims as cuDNN's forward gives it on this torch (its backward wants them)

    @staticmethod
    def forward(q, k, v, causal: bool):
        o, lse, _, _, _, _, seed, offset = private.cudnn_attention(q, k, v, causal)
        CudnnKernel.lse_dims = lse.dim()
        return o, lse.float().reshape(*o.shape[:3], 1), torch.stack([seed, offset])

    @staticmethod
    def backward(grad, q, k, v, out, lse, causal: bool, state):
        lse = lse if CudnnKernel.lse_dims == 4 else lse.squeeze(-1)
        return private.cudnn_attention_backward(grad, q, k, v, out, lse.contiguous(), state[0], state[1], None, None,
                                                q.shape[2], k.shape[2], causal)


def _per_kv_head(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Gradients computed for kv heads repeated to the query heads, summed back per kv head."""
    return x.unflatten(1, (kv_heads, x.shape[1] // kv_heads)).sum(2)


class CpuKernel:
    """One part on torch's fused CPU attention (what SDPA runs on a CPU, overrides/attention.py): exact to
    fp32 rounding. It takes as many kv heads as query heads: they are repeated, and their gradients
    summed back."""

    state_size = 0

    @staticmethod
    def forward(q, k, v, causal: bool):
        groups = q.shape[1] // k.shape[1]
        out, lse = private.cpu_attention(q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1),
                                         causal)
        return out, lse.float().unsqueeze(-1), None

    @staticmethod
    def backward(grad, q, k, v, out, lse, causal: bool, state):
        groups = q.shape[1] // k.shape[1]
        dq, dk, dv = private.cpu_attention_backward(grad, q, k.repeat_interleave(groups, dim=1),
                                                    v.repeat_interleave(groups, dim=1), out,
                                                    lse.squeeze(-1).contiguous(), causal)
        return dq, _per_kv_head(dk, k.shape[1]), _per_kv_head(dv, k.shape[1])


class TorchKernel:
    """One part's attention written out in torch: exact in fp32, the scores materialised (for a GPU in
    fp32, where neither fused kernel runs, and small windows); the same contract as CudnnKernel."""

    state_size = 0

    @staticmethod
    def scores(q, k, causal: bool):
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        if causal:  # square: query j sees keys 0..j of the part
            s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(), float("-inf"))
        return s

    @staticmethod
    def forward(q, k, v, causal: bool):
        s = TorchKernel.scores(q, k, causal)
        lse = s.logsumexp(-1, keepdim=True)
        out = (s - lse).exp() @ v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        return out, lse.float(), None

    @staticmethod
    def backward(grad, q, k, v, out, lse, causal: bool, state):
        groups = q.shape[1] // k.shape[1]
        p = (TorchKernel.scores(q, k, causal) - lse).exp()  # the merged softmax, from the merged lse
        dv = p.transpose(-1, -2) @ grad
        ds = p * (grad @ v.repeat_interleave(groups, dim=1).transpose(-1, -2) - (grad * out).sum(-1, keepdim=True))
        ds = ds * q.shape[-1] ** -0.5
        dq = ds @ k.repeat_interleave(groups, dim=1)
        dk = ds.transpose(-1, -2) @ q
        return dq, _per_kv_head(dk, k.shape[1]), _per_kv_head(dv, k.shape[1])


@dataclass(frozen=True)
class Plan:
    """What one rank's causal attention needs besides its tensors: its window chunks, side by side in its
    queries, keys and values; the kernel of each part; the exchange of keys, values and their gradients."""

    chunks: tuple[int, ...]
    kernel: Any
    exchange: Any


_PLANS: list[Plan] = []


def make_plan(chunks: tuple[int, ...], kernel: Any, exchange: Any) -> int:
    """The number the ops know `Plan(chunks, kernel, exchange)` by (a process keeps one per rank and kernel)."""
    _PLANS.append(Plan(tuple(chunks), kernel, exchange))
    return len(_PLANS) - 1


def causal_chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: int) -> torch.Tensor:
    """(batch, heads, len(chunks)·L, head_dim) queries of the plan's window chunks, side by side, over the
    window's keys and values, from this rank's (batch, kv_heads, len(chunks)·L, head_dim) keys and values
    (the same chunks)."""
    return _side_by_side(_attention_op(q, k, v, plan)[0])


def _side_by_side(stacked: torch.Tensor) -> torch.Tensor:
    """(chunks, b, h, L, d) as (b, h, chunks·L, d). The ops keep each chunk's rows apart, contiguous, as the
    kernels take them; compiled, this copy fuses into the block's next one (attention's output is
    transposed into the output projection's input anyway)."""
    n, b, h, length, d = stacked.shape
    return stacked.permute(1, 2, 0, 3, 4).reshape(b, h, n * length, d)


def _merge(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, lse_o: torch.Tensor):
    """Two parts' attention (out, lse) and (o, lse_o) over disjoint keys as one over both: out moves toward o
    by o's share of the softmax, sigmoid(lse_o - lse), computed in fp32; stable whichever lse is larger."""
    share = torch.sigmoid(lse_o - lse)
    merged = out.float() + share * (o.float() - out.float())
    return merged.to(out.dtype), lse - logsigmoid(lse - lse_o)


def _outputs(squares: list, prefixes: list):
    """Each chunk's square part merged with its prefix (None for chunk 0), stacked: (out as (chunks, b, h, L,
    d), lse as (chunks, b, h, L, 1) fp32), contiguous, the layout the op declares."""
    merged = [_merge(*square, *prefix) if prefix is not None else square for square, prefix in zip(squares, prefixes)]
    return torch.stack([o for o, _ in merged]), torch.stack([lse.float() for _, lse in merged])


def _to_send(cp: int, contributions: list[list[tuple[torch.Tensor, torch.Tensor]]], like: torch.Tensor):
    """(2·cp, *like.shape): the key and value gradients each rank sends, rank r's at [2r, 2r + 2), its chunks r
    and 2cp-1-r side by side (context.py's shard_sequence), from `contributions`, per window chunk c the
    (key, value) gradients this rank has for its keys (summed; zeros where none)."""
    half = like.shape[2] // 2
    zeros = like.new_zeros((*like.shape[:2], half, like.shape[3]))

    def total(c: int, which: int) -> torch.Tensor:
        parts = [pair[which] for pair in contributions[c]]
        return sum(parts[1:], parts[0]) if parts else zeros

    return torch.stack([torch.cat([total(c, which) for c in (r, 2 * cp - 1 - r)], dim=2)
                        for r in range(cp) for which in (0, 1)])


def _gradients(dq_parts: list[list[torch.Tensor]], received: torch.Tensor, late: list):
    """(dq as (chunks, b, h, L, d), the key and value gradients (2, b, kv_heads, chunks·L, d)): each chunk's
    query gradients summed, and `late` (per chunk: its square's (key, value) gradients, or None where
    they went out with the reduce-scatter) added to what the reduce-scatter brought."""
    dq = torch.stack([sum(parts[1:], parts[0]) for parts in dq_parts])
    length = dq.shape[3]
    rows = [received[:, :, :, i * length:(i + 1) * length] for i in range(len(late))]
    dkv = torch.cat([mine if pair is None else mine + torch.stack(pair) for mine, pair in zip(rows, late)], dim=3)
    return dq, dkv


def _fast(fn):
    """`fn(*args)`, on a GPU as a compiled kernel or a few (compiled on first use); elsewhere (the CPU tests)
    as written. Written out, their fp32 temporaries and copies made a layer's attention 1.11-1.13x as long as
    the same attention traced into the block's graph at 16,384 tokens; compiled, 1.02-1.06x (one H200, no
    communication: docs/benchmarks/2026-11-28-cp-attention-as-one-op.md)."""
    compiled = None

    def run(on_gpu: bool, *args):
        nonlocal compiled
        if not on_gpu:
            return fn(*args)
        if compiled is None:
            compiled = torch.compile(fn)  # past dynamo's recompile limit, as written
        return compiled(*args)

    return run


outputs, to_send, gradients = _fast(_outputs), _fast(_to_send), _fast(_gradients)


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Plan):
    """(out as (chunks, b, h, L, d), lse as (chunks, b, h, L, 1) fp32, the parts' kernel states as one int64
    tensor, the rank's keys and values stacked (2, *k.shape), which backward gathers again)."""
    kernel, exchange, length = plan.kernel, plan.exchange, q.shape[2] // len(plan.chunks)
    kv = torch.stack([k, v])
    pending = exchange.gather_start(kv)
    states = []

    def part(i: int, keys: torch.Tensor, values: torch.Tensor, causal: bool):
        o, lse, state = kernel.forward(q[:, :, i * length:(i + 1) * length], keys, values, causal)
        if state is not None:
            states.append(state)
        return o, lse

    # While the gather runs: each chunk's square block, on this rank's own keys.
    squares = [part(i, k[:, :, i * length:(i + 1) * length], v[:, :, i * length:(i + 1) * length], True)
               for i in range(len(plan.chunks))]
    whole_k, whole_v = exchange.gather_finish(pending)
    prefixes = [part(i, whole_k[:, :, :chunk * length], whole_v[:, :, :chunk * length], False) if chunk else None
                for i, chunk in enumerate(plan.chunks)]
    del whole_k, whole_v
    state = torch.cat(states) if states else q.new_empty(0, dtype=torch.int64)
    return *outputs(q.is_cuda, squares, prefixes), state, kv


def _backward(grad, q, kv, out, lse, state, plan: Plan):
    """(dq as (chunks, b, h, L, d), the rank's key and value gradients stacked) from the gradient of `out`."""
    kernel, exchange, n = plan.kernel, plan.exchange, len(plan.chunks)
    length = q.shape[2] // n
    k, v = kv[0], kv[1]
    rows = [slice(i * length, (i + 1) * length) for i in range(n)]
    # Parts in forward's order, squares then prefixes: each kernel state is at its part's place.
    parts = [(i, True) for i in range(n)] + [(i, False) for i, chunk in enumerate(plan.chunks) if chunk]
    place = {p: j * kernel.state_size for j, p in enumerate(parts)}
    grads = [grad[i].contiguous() for i in range(n)]
    dq: list[list[torch.Tensor]] = [[] for _ in range(n)]

    def part_backward(i: int, keys: torch.Tensor, values: torch.Tensor, causal: bool):
        at = place[(i, causal)]
        gq, gk, gv = kernel.backward(grads[i], q[:, :, rows[i]], keys, values, out[i], lse[i], causal,
                                     state[at:at + kernel.state_size])
        dq[i].append(gq)
        return gk, gv

    pending = exchange.gather_start(kv)
    first = part_backward(0, k[:, :, rows[0]], v[:, :, rows[0]], True)  # while the gather runs
    whole_k, whole_v = exchange.gather_finish(pending)
    cp = whole_k.shape[2] // (n * length)
    # Per window chunk, the key and value gradients this rank has for it: the first square's (summed with
    # the others' by the reduce-scatter), and the prefixes', which belong to the ranks that hold those keys.
    contributions: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(2 * cp)]
    contributions[plan.chunks[0]].append(first)
    for i, chunk in enumerate(plan.chunks):
        if chunk:
            gk, gv = part_backward(i, whole_k[:, :, :chunk * length], whole_v[:, :, :chunk * length], False)
            for c in range(chunk):
                keys = slice(c * length, (c + 1) * length)
                contributions[c].append((gk[:, :, keys], gv[:, :, keys]))
    del whole_k, whole_v
    pending = exchange.scatter_start(to_send(q.is_cuda, cp, contributions, k))
    late = [None] + [part_backward(i, k[:, :, rows[i]], v[:, :, rows[i]], True) for i in range(1, n)]  # meanwhile
    received = exchange.scatter_finish(pending)  # (2, *k.shape): the sums of what every rank sent this one
    return gradients(q.is_cuda, dq, received, late)


# ---- the ops: what torch.compile sees ---------------------------------------------------------------------

# The ops' names carry a digest of this file. Compile's on-disk caches key a graph by the ops it calls, not by
# what they take or save: after this file changed the backward's arguments, a cached graph from before called
# it with the old ones ("expected at most 7 argument(s) but received 8"). A changed file is a new name.
_NAME = f"titanlike::cp_causal_attention_{hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]}"



@torch.library.custom_op(_NAME, mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  plan: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, _PLANS[plan])


@_attention_op.register_fake
def _(q, k, v, plan):
    p = _PLANS[plan]
    n, parts = len(p.chunks), len(p.chunks) + sum(1 for chunk in p.chunks if chunk)
    b, h, window, d = q.shape
    return (q.new_empty((n, b, h, window // n, d)), q.new_empty((n, b, h, window // n, 1), dtype=torch.float32),
            q.new_empty(parts * p.kernel.state_size, dtype=torch.int64), k.new_empty((2, *k.shape)))


@torch.library.custom_op(f"{_NAME}_backward", mutates_args=())
def _attention_backward_op(grad: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor,
                           lse: torch.Tensor, state: torch.Tensor, plan: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward(grad, q, kv, out, lse, state, _PLANS[plan])


@_attention_backward_op.register_fake
def _(grad, q, kv, out, lse, state, plan):
    return q.new_empty(grad.shape), kv.new_empty(kv.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, _, _, plan = inputs
    out, lse, state, kv = output
    ctx.plan = plan
    # The rank's own keys and values as the forward stacked them for its gather (backward gathers them again).
    ctx.save_for_backward(q, kv, out, lse, state)


def _backward_of_op(ctx, grad, _lse_grad, _state_grad, _kv_grad):
    q, kv, out, lse, state = ctx.saved_tensors
    dq, dkv = _attention_backward_op(grad, q, kv, out, lse, state, ctx.plan)
    return _side_by_side(dq), dkv[0], dkv[1], None


_attention_op.register_autograd(_backward_of_op, setup_context=_setup_context)

# For the selective activation-checkpointing policy: its output is kept, never recomputed (its collectives
# would run again).
ATTENTION_OP = getattr(torch.ops.titanlike, _NAME.split("::")[1]).default
