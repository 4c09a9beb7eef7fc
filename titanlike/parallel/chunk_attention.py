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

The layouts, the other point (each saves a copy of the window's keys and values, or of the output, by
layer): the gather lays the chunks out in `prefix_order`, where every prefix is one run of chunks, so
no rank reorders what it gathered into window order (an unmasked prefix takes its keys in any order);
keys and values travel token by token (`token_major_kv`), so a run of chunks is a strided view the
kernel reads as it lies; and the output is laid out as the block's queries are (`_token_major`), so its
gradient comes back in the output's own layout and the kernel's backward reads it without a copy. At
16,384 tokens, `1b` with cp 2 ran 1.034x faster for them; at 32,768 they changed nothing (2x H200,
docs/benchmarks/2026-11-28-cp-gather-in-prefix-order.md).

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


_PLANS: dict[int, Plan] = {}


def make_plan(chunks: tuple[int, ...], kernel: Any, exchange: Any) -> int:
    """The number the ops know `Plan(chunks, kernel, exchange)` by (a process keeps one per rank and kernel).

    The number is written into every compiled graph that calls the ops, and compile's on-disk caches key a
    graph by its code. So it is a digest of the chunks and the kernel, not the order plans were made in:
    the ranks of a group save kernel states of different sizes (their parts differ), and with one number
    for all they would load each other's cached graphs wherever nothing else in their code differs (ranks
    on one device index of two hosts with one shared cache; one GPU standing in for each rank in turn),
    and fail on the state's size."""
    plan = Plan(tuple(chunks), kernel, exchange)
    digest = hashlib.sha256(repr((kernel.__module__, kernel.__qualname__, plan.chunks)).encode()).digest()
    number = int.from_bytes(digest[:6], "big")
    while number in _PLANS and _PLANS[number] != plan:  # the same chunks over another exchange (a test's)
        number += 1
    _PLANS[number] = plan
    return number


def causal_chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: int) -> torch.Tensor:
    """(batch, heads, len(chunks)·L, head_dim) queries of the plan's window chunks, side by side, over the
    window's keys and values, from this rank's (batch, kv_heads, len(chunks)·L, head_dim) keys and values
    (the same chunks)."""
    return _side_by_side(_attention_op(q, k, v, plan)[0])


def _side_by_side(stacked: torch.Tensor) -> torch.Tensor:
    """(chunks, b, h, L, d) as (b, h, chunks·L, d): a view of the ops' outputs, whose rows lie in memory as
    (b, chunks·L, h, d), the layout a block's queries and SDPA's output have (`_token_major`)."""
    n, b, h, length, d = stacked.shape
    return stacked.permute(1, 2, 0, 3, 4).reshape(b, h, n * length, d)


def _token_major(per_chunk: list[torch.Tensor]) -> torch.Tensor:
    """Chunks' (b, h, L, d) as (chunks, b, h, L, d) laid out in memory as (b, chunks, L, h, d). That is the
    layout of the block around the op: its queries come so, `_side_by_side` of this is a view, and the
    output gradient comes back the same way, which cuDNN's backward then reads without a copy (it makes
    an output gradient laid out unlike the output match it first, a copy per chunk)."""
    return torch.stack(per_chunk, dim=1).transpose(2, 3).contiguous().permute(1, 0, 3, 2, 4)


def _token_major_like(b: int, n: int, h: int, length: int, d: int, like: torch.Tensor) -> torch.Tensor:
    """An empty (n, b, h, L, d) tensor laid out as `_token_major` makes it (for the ops' fake kernels)."""
    return like.new_empty((b, n, length, h, d)).permute(1, 0, 3, 2, 4)


def prefix_order(cp: int) -> list[int]:
    """The window chunks in the order the gather lays them out: the ranks' tail chunks in rank order
    (2cp-1 down to cp), then their head chunks (0 up to cp-1). Every prefix [0, c) of the window is then
    one contiguous run of it, `prefix_run(c)`, and a prefix is attended unmasked, where keys may come in any
    order: so no rank reorders the gathered keys and values into window order (a copy of the window's, by
    layer, in forward and again in backward)."""
    return [2 * cp - 1 - r for r in range(cp)] + list(range(cp))


def prefix_run(chunk: int, cp: int) -> slice:
    """Where the keys before window chunk `chunk` lie in `prefix_order(cp)`, in chunks: the first `chunk` head
    chunks, or for a tail chunk all the head chunks and the tail chunks just before them."""
    start = cp if chunk <= cp else 2 * cp - chunk
    return slice(start, start + chunk)


def token_major_kv(k: torch.Tensor, v: torch.Tensor, n: int) -> torch.Tensor:
    """(n, L, b, 2, kv_heads, d): keys and values of (b, kv_heads, n·L, d) each, a chunk at a time, a token's
    keys and values side by side. What the exchange moves: a run of chunks of it is a run of tokens, which
    `kv_views` reads as keys and values without a copy."""
    b, h, seq, d = k.shape
    buf = k.new_empty((n, seq // n, b, 2, h, d))
    as_kv = buf.permute(3, 2, 4, 0, 1, 5)  # (2, b, h, n, L, d)
    as_kv[0].copy_(k.unflatten(2, (n, seq // n)))
    as_kv[1].copy_(v.unflatten(2, (n, seq // n)))
    return buf


def kv_views(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values (b, kv_heads, chunks·L, d), views of a `token_major_kv` buffer (chunks, L, b, 2, kv_heads, d)."""
    tokens = buf.flatten(0, 1)
    return tokens[:, :, 0].permute(1, 2, 0, 3), tokens[:, :, 1].permute(1, 2, 0, 3)


def _merge(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, lse_o: torch.Tensor):
    """Two parts' attention (out, lse) and (o, lse_o) over disjoint keys as one over both: out moves toward o
    by o's share of the softmax, sigmoid(lse_o - lse), computed in fp32; stable whichever lse is larger."""
    share = torch.sigmoid(lse_o - lse)
    merged = out.float() + share * (o.float() - out.float())
    return merged.to(out.dtype), lse - logsigmoid(lse - lse_o)


def _outputs(squares: list, prefixes: list):
    """Each chunk's square part merged with its prefix (None for chunk 0): (out as (chunks, b, h, L, d) laid
    out as `_token_major` makes it, lse as (chunks, b, h, L, 1) fp32, contiguous), the layouts the op
    declares."""
    merged = [_merge(*square, *prefix) if prefix is not None else square for square, prefix in zip(squares, prefixes)]
    return _token_major([o for o, _ in merged]), torch.stack([lse.float() for _, lse in merged])


def _to_send(cp: int, contributions: list[list[tuple[torch.Tensor, torch.Tensor]]], like: torch.Tensor):
    """(2·cp, L, b, 2, kv_heads, d): the key and value gradients this rank has for every window chunk, in
    `prefix_order(cp)` and laid out as `token_major_kv`, from `contributions`: per window chunk c the (key,
    value) gradients this rank has for its keys (summed; zeros where none)."""
    zeros = like.new_zeros((*like.shape[:2], like.shape[2] // 2, like.shape[3]))

    def total(c: int, which: int) -> torch.Tensor:
        parts = [pair[which] for pair in contributions[c]]
        return sum(parts[1:], parts[0]) if parts else zeros

    # (2cp, 2, b, h, L, d) as (2cp, L, b, 2, h, d)
    return torch.stack([torch.stack([total(c, 0), total(c, 1)]) for c in prefix_order(cp)]).permute(
        0, 4, 2, 1, 3, 5).contiguous()


def _gradients(dq_parts: list[list[torch.Tensor]], received: torch.Tensor, late: list):
    """(dq as (chunks, b, h, L, d) laid out as `_token_major` makes it, the key and value gradients
    (2, b, kv_heads, chunks·L, d)): each chunk's query gradients summed, and `late` (per chunk: its
    square's (key, value) gradients, or None where they went out with the reduce-scatter) added to
    what the reduce-scatter brought (`received`, (chunks, L, b, 2, kv_heads, d) as `token_major_kv`)."""
    dq = _token_major([sum(parts[1:], parts[0]) for parts in dq_parts])
    mine = received.permute(3, 2, 4, 0, 1, 5)  # (2, b, h, n, L, d)
    dkv = torch.cat([mine[:, :, :, i] if pair is None else mine[:, :, :, i] + torch.stack(pair)
                     for i, pair in enumerate(late)], dim=3)
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


def _before(chunk: int, whole: tuple[torch.Tensor, torch.Tensor], cp: int,
            length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values before window chunk `chunk`: a run of the gathered (in `prefix_order`), as views."""
    run = prefix_run(chunk, cp)
    keys = slice(run.start * length, run.stop * length)
    return whole[0][:, :, keys], whole[1][:, :, keys]


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Plan):
    """(out as (chunks, b, h, L, d), lse as (chunks, b, h, L, 1) fp32, the parts' kernel states as one int64
    tensor, the rank's keys and values as `token_major_kv`, which backward gathers again)."""
    kernel, exchange, n = plan.kernel, plan.exchange, len(plan.chunks)
    length = q.shape[2] // n
    kv = token_major_kv(k, v, n)
    pending = exchange.gather_start(kv)
    states = []

    def part(i: int, keys: torch.Tensor, values: torch.Tensor, causal: bool):
        o, lse, state = kernel.forward(q[:, :, i * length:(i + 1) * length], keys, values, causal)
        if state is not None:
            states.append(state)
        return o, lse

    # While the gather runs: each chunk's square block, on this rank's own keys.
    squares = [part(i, k[:, :, i * length:(i + 1) * length], v[:, :, i * length:(i + 1) * length], True)
               for i in range(n)]
    whole = kv_views(exchange.gather_finish(pending))  # in prefix_order
    cp = whole[0].shape[2] // (2 * length)
    prefixes = [part(i, *_before(chunk, whole, cp, length), False) if chunk else None
                for i, chunk in enumerate(plan.chunks)]
    del whole
    state = torch.cat(states) if states else q.new_empty(0, dtype=torch.int64)
    return *outputs(q.is_cuda, squares, prefixes), state, kv


def _backward(grad, q, kv, out, lse, state, plan: Plan):
    """(dq as (chunks, b, h, L, d), the rank's key and value gradients stacked) from the gradient of `out`."""
    kernel, exchange, n = plan.kernel, plan.exchange, len(plan.chunks)
    length = q.shape[2] // n
    k, v = kv_views(kv)
    rows = [slice(i * length, (i + 1) * length) for i in range(n)]
    # Parts in forward's order, squares then prefixes: each kernel state is at its part's place.
    parts = [(i, True) for i in range(n)] + [(i, False) for i, chunk in enumerate(plan.chunks) if chunk]
    place = {p: j * kernel.state_size for j, p in enumerate(parts)}
    dq: list[list[torch.Tensor]] = [[] for _ in range(n)]

    def part_backward(i: int, keys: torch.Tensor, values: torch.Tensor, causal: bool):
        at = place[(i, causal)]
        # grad[i] and out[i] share a layout (`_token_major`): the kernel reads both as they are.
        gq, gk, gv = kernel.backward(grad[i], q[:, :, rows[i]], keys, values, out[i], lse[i], causal,
                                     state[at:at + kernel.state_size])
        dq[i].append(gq)
        return gk, gv

    pending = exchange.gather_start(kv)
    first = part_backward(0, k[:, :, rows[0]], v[:, :, rows[0]], True)  # while the gather runs
    whole = kv_views(exchange.gather_finish(pending))  # in prefix_order
    cp = whole[0].shape[2] // (2 * length)
    order = prefix_order(cp)
    # Per window chunk, the key and value gradients this rank has for it: the first square's (summed with
    # the others' by the reduce-scatter), and the prefixes', which belong to the ranks that hold those keys.
    contributions: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(2 * cp)]
    contributions[plan.chunks[0]].append(first)
    for i, chunk in enumerate(plan.chunks):
        if chunk:
            gk, gv = part_backward(i, *_before(chunk, whole, cp, length), False)
            run = prefix_run(chunk, cp)
            for j, at in enumerate(range(run.start, run.stop)):
                these = slice(j * length, (j + 1) * length)
                contributions[order[at]].append((gk[:, :, these], gv[:, :, these]))
    del whole
    pending = exchange.scatter_start(to_send(q.is_cuda, cp, contributions, k))
    late = [None] + [part_backward(i, k[:, :, rows[i]], v[:, :, rows[i]], True) for i in range(1, n)]  # meanwhile
    received = exchange.scatter_finish(pending)  # (n, L, b, 2, kv_heads, d): the sums every rank sent this one
    return gradients(q.is_cuda, dq, received, late)


# ---- the ops: what torch.compile sees ---------------------------------------------------------------------

# The ops' names carry a digest of this file. Compile's on-disk caches key a graph by the ops it calls, not by
# what they take or save: after this file changed the backward's arguments, a cached graph from before called
# it with the old ones ("expected at most 7 argument(s) but received 8"). A changed file is a new name.
_NAME = f"titanlike::cp_causal_attention_{hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]}"


def _plan(number) -> Plan:
    """The plan of a number. Where one compiled function meets several plans (tests make many), compile
    turns the number into a symbol, which a dict cannot take: int() pins it again, with a guard."""
    return _PLANS[int(number)]


@torch.library.custom_op(_NAME, mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  plan: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, _plan(plan))


@_attention_op.register_fake
def _(q, k, v, plan):
    p = _plan(plan)
    n, parts = len(p.chunks), len(p.chunks) + sum(1 for chunk in p.chunks if chunk)
    b, h, window, d = q.shape
    kv = k.new_empty((n, k.shape[2] // n, b, 2, k.shape[1], d))
    return (_token_major_like(b, n, h, window // n, d, q), q.new_empty((n, b, h, window // n, 1), dtype=torch.float32),
            q.new_empty(parts * p.kernel.state_size, dtype=torch.int64), kv)


@torch.library.custom_op(f"{_NAME}_backward", mutates_args=())
def _attention_backward_op(grad: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor,
                           lse: torch.Tensor, state: torch.Tensor, plan: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward(grad, q, kv, out, lse, state, _plan(plan))


@_attention_backward_op.register_fake
def _(grad, q, kv, out, lse, state, plan):
    n, length, b, _, kv_heads, d = kv.shape
    return _token_major_like(b, n, q.shape[1], length, d, q), kv.new_empty((2, b, kv_heads, n * length, d))


def _setup_context(ctx, inputs, output) -> None:
    q, _, _, plan = inputs
    out, lse, state, kv = output
    ctx.plan = plan
    # The rank's own keys and values as the forward laid them out for its gather (backward gathers them again).
    ctx.save_for_backward(q, kv, out, lse, state)


def _backward_of_op(ctx, grad, _lse_grad, _state_grad, _kv_grad):
    q, kv, out, lse, state = ctx.saved_tensors
    dq, dkv = _attention_backward_op(grad, q, kv, out, lse, state, ctx.plan)
    return _side_by_side(dq), dkv[0], dkv[1], None


_attention_op.register_autograd(_backward_of_op, setup_context=_setup_context)

# For the selective activation-checkpointing policy: its output is kept, never recomputed (its collectives
# would run again).
ATTENTION_OP = getattr(torch.ops.titanlike, _NAME.split("::")[1]).default
