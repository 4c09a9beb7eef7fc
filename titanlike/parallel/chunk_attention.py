"""Causal attention of a context-parallel rank's chunks over the window's keys, with the gather of the
group's keys and values started before the attention that needs only the rank's own.

A rank's chunk c of a window cut into chunks of L tokens holds the queries at window positions
[cL, cL + L); under a causal mask they see keys [0, cL + L): every key before the chunk, unmasked, and
the chunk's own keys under the square causal mask. cuDNN's fused attention (through
`_scaled_dot_product_cudnn_attention`, what SDPA runs for the whole window on Hopper) aligns its
causal mask to the top left, which is only right for the square block, so each chunk is two calls:

    block:  queries of c against keys [cL, cL + L), causal  (the rank's own keys)
    prefix: queries of c against keys [0, cL), no mask      (absent for chunk 0)

merged exactly with their log-sum-exps (out = Σ out_p · exp(lse_p − lse), lse = log Σ exp(lse_p)).
Backward calls the kernel's backward for each part with the merged output and log-sum-exp, which makes
each part's softmax the merged one (ring attention's rule); the parts' gradients add up in fp32.
Grouped-query kv heads go to the kernel as they are (it shares them).

The collectives go through an exchange (context.py's KeyValueExchange), each started and finished
apart, so that work that does not need them can sit between. Forward starts the all-gather of the
group's keys and values, computes the square blocks on the rank's own keys, then waits and computes
the prefixes. Only the rank's own keys and values are kept for backward, never the gathered ones:
backward starts the all-gather again, computes the square blocks' gradients on its own keys meanwhile,
then the prefixes' (the only ones that reach other ranks' keys) and reduce-scatters those, summed, to
the ranks that hold the keys. What a rank keeps for backward is then its own part of the window, which
shrinks with cp, for one more all-gather a layer. Eager, the work queues in that order; compiled,
inductor schedules it (on an H200 under torch 2.11 it placed both collectives of forward after the
square blocks: docs/benchmarks/2026-11-26-cp-prefetch-offload-long-windows.md).

These kernels are an override of torch's internals (titanlike/overrides: cp_attention_kernels); off,
context.py's stock path runs SDPA's public front door instead.

Kernels: CudnnKernel on a GPU in bf16/fp16; CpuKernel, torch's fused CPU attention, on a CPU (what
the gloo tests run); TorchKernel, attention written out in torch, on a GPU in fp32. Why not FlashAttention's
bottom-right causal mask in one call per chunk (SDPA's flash op takes fewer queries than keys that
way): a slower kernel; a cp 2 rank of `1b` at 16,384 tokens ran at 0.67× one GPU's speed on it, 0.81×
on cuDNN's parts (H200, docs/benchmarks/2026-11-26-cp-kernels-fit-to-target.md).
"""

from __future__ import annotations

from typing import Any

import torch

from titanlike.overrides import attention as private


class CudnnKernel:
    """One part's attention and its backward on cuDNN (the ops SDPA's own autograd calls,
    overrides/attention.py). `forward` gives (out, lse as (b, h, L, 1) fp32, state for backward:
    tensors, then other values)."""

    @staticmethod
    def forward(q, k, v, causal: bool):
        o, lse, cum_q, cum_k, max_q, max_k, seed, offset = private.cudnn_attention(q, k, v, causal)
        return o, lse.float().reshape(*o.shape[:3], 1), (cum_q, cum_k, seed, offset), (max_q, max_k, lse.dim())

    @staticmethod
    def backward(grad, q, k, v, out, lse, causal: bool, tensors, values):
        cum_q, cum_k, seed, offset = tensors
        max_q, max_k, lse_dims = values
        lse = lse if lse_dims == 4 else lse.squeeze(-1)
        return private.cudnn_attention_backward(grad, q, k, v, out, lse.contiguous(), seed, offset, cum_q, cum_k,
                                                max_q, max_k, causal)


def _per_kv_head(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Gradients computed for kv heads repeated to the query heads, summed back per kv head."""
    return x.unflatten(1, (kv_heads, x.shape[1] // kv_heads)).sum(2)


class CpuKernel:
    """One part on torch's fused CPU attention (what SDPA runs on a CPU, overrides/attention.py): exact to
    fp32 rounding, and a few extern calls for torch.compile to trace instead of TorchKernel's materialised
    scores (the compiled cp test, cold, once on a 2-core CI machine: 51 s against 59). It takes as many kv
    heads as query heads: they are repeated, and their gradients summed back."""

    @staticmethod
    def forward(q, k, v, causal: bool):
        groups = q.shape[1] // k.shape[1]
        out, lse = private.cpu_attention(q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1),
                                         causal)
        return out, lse.float().unsqueeze(-1), (), ()

    @staticmethod
    def backward(grad, q, k, v, out, lse, causal: bool, tensors, values):
        groups = q.shape[1] // k.shape[1]
        dq, dk, dv = private.cpu_attention_backward(grad, q, k.repeat_interleave(groups, dim=1),
                                                    v.repeat_interleave(groups, dim=1), out,
                                                    lse.squeeze(-1).contiguous(), causal)
        return dq, _per_kv_head(dk, k.shape[1]), _per_kv_head(dv, k.shape[1])


class TorchKernel:
    """One part's attention written out in torch: exact in fp32, the scores materialised (for a GPU in
    fp32, where neither fused kernel runs, and small windows); the same contract as CudnnKernel."""

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
        return out, lse.float(), (), ()

    @staticmethod
    def backward(grad, q, k, v, out, lse, causal: bool, tensors, values):
        groups = q.shape[1] // k.shape[1]
        p = (TorchKernel.scores(q, k, causal) - lse).exp()  # the merged softmax, from the merged lse
        dv = p.transpose(-1, -2) @ grad
        ds = p * (grad @ v.repeat_interleave(groups, dim=1).transpose(-1, -2) - (grad * out).sum(-1, keepdim=True))
        ds = ds * q.shape[-1] ** -0.5
        dq = ds @ k.repeat_interleave(groups, dim=1)
        dk = ds.transpose(-1, -2) @ q
        return dq, _per_kv_head(dk, k.shape[1]), _per_kv_head(dv, k.shape[1])


@torch.library.custom_op("titanlike::stack_in_backward", mutates_args=())
def stack_in_backward(k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """torch.stack([k, v]) that a compiler sees as needing `grad`, the incoming gradient, and cannot see into:
    so it, and the gather of its output, run in backward (see CausalChunks.backward)."""
    return torch.stack([k, v])


@stack_in_backward.register_fake
def _(k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    return k.new_empty((2, *k.shape))


class CausalChunks(torch.autograd.Function):
    """(batch, heads, len(chunks)·L, head_dim) queries of window chunks `chunks`, side by side, over the
    window's keys and values, from this rank's (batch, kv_heads, len(chunks)·L, head_dim) keys and values
    (the same chunks) and `exchange`, which gathers the rest (context.py's KeyValueExchange; the tests
    hand it a stand-in). `kernel` computes each part (CudnnKernel, CpuKernel, TorchKernel: context.py's
    `kernel_for` picks)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks: tuple[int, ...],
                kernel: Any, exchange: Any) -> torch.Tensor:
        length = q.shape[2] // len(chunks)
        pending = exchange.gather_start(torch.stack([k, v]))
        merged: list[tuple[torch.Tensor, torch.Tensor]] = []  # per chunk: (out, lse), fp32
        saved, meta = [], []

        def part(i: int, keys: torch.Tensor, values_: torch.Tensor, start: int, end: int, causal: bool):
            """Chunk i's queries against `keys` and `values_`: the window's keys [start, end)."""
            qi = q[:, :, i * length:(i + 1) * length]
            o, lse, tensors, values = kernel.forward(qi, keys, values_, causal)
            saved.extend(tensors)
            meta.append((i, start, end, causal, len(tensors), values))
            if len(merged) <= i:
                merged.append((o.float(), lse))
            else:  # out - sigmoid(lse_p - lse)·(out - out_p): the merge, stable whichever is larger
                out, total = merged[i]
                merged[i] = (out - torch.sigmoid(lse - total) * (out - o.float()),
                             total - torch.nn.functional.logsigmoid(total - lse))

        # While the gather runs: each chunk's square block, on this rank's own keys.
        for i, chunk in enumerate(chunks):
            own = slice(i * length, (i + 1) * length)
            part(i, k[:, :, own], v[:, :, own], chunk * length, (chunk + 1) * length, True)
        whole_k, whole_v = exchange.gather_finish(pending)
        for i, chunk in enumerate(chunks):
            if chunk:
                part(i, whole_k[:, :, :chunk * length], whole_v[:, :, :chunk * length], 0, chunk * length, False)
        outs = [out.to(q.dtype).contiguous() for out, _ in merged]
        lses = [lse for _, lse in merged]
        ctx.chunks, ctx.meta, ctx.kernel, ctx.exchange = chunks, meta, kernel, exchange
        # The window's keys and values are not kept: backward gathers them again, so that what a rank keeps
        # for backward is its own part (memory that shrinks with cp), at the cost of one more all-gather.
        ctx.save_for_backward(q, k, v, *outs, *lses, *saved)
        return torch.cat(outs, dim=2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, *rest = ctx.saved_tensors
        n = len(ctx.chunks)
        outs, lses, saved = rest[:n], rest[n:2 * n], rest[2 * n:]
        length = q.shape[2] // n
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk, dv = (torch.zeros(k.shape, dtype=torch.float32, device=q.device) for _ in range(2))
        offsets, used = [], 0
        for *_, count, _ in ctx.meta:
            offsets.append(used)
            used += count

        def part_backward(j: int, keys: torch.Tensor, values_: torch.Tensor, base: int, dkeys, dvalues) -> None:
            """Part j's gradients; `keys` and `values_` hold window positions from `base` on, and so do
            `dkeys` and `dvalues`."""
            i, start, end, causal, count, values = ctx.meta[j]
            rows, cols = slice(i * length, (i + 1) * length), slice(start - base, end - base)
            gq, gk, gv = ctx.kernel.backward(grad[:, :, rows].contiguous(), q[:, :, rows], keys[:, :, cols],
                                             values_[:, :, cols], outs[i], lses[i], causal,
                                             saved[offsets[j]:offsets[j] + count], values)
            dq[:, :, rows] += gq
            dkeys[:, :, cols] += gk
            dvalues[:, :, cols] += gv

        # Not torch.stack: compiled, forward and backward are traced as one graph, whose passes merged this
        # gather with forward's (the same op on the same tensors) and kept its output, the window's keys and
        # values, from forward to backward whatever cp (measured: tests/test_context_parallel.py).
        pending = ctx.exchange.gather_start(stack_in_backward(k, v, grad))
        # While the gather runs: the square blocks, on this rank's own keys (their gradients are its own).
        for j, (i, start, _, causal, *_) in enumerate(ctx.meta):
            if causal:
                part_backward(j, k, v, start - i * length, dk, dv)
        whole_k, whole_v = ctx.exchange.gather_finish(pending)
        # The prefixes: their key and value gradients go to the ranks that hold those keys, summed.
        whole_dkv = torch.zeros((2, *whole_k.shape), dtype=torch.float32, device=q.device)
        for j, meta in enumerate(ctx.meta):
            if not meta[3]:
                part_backward(j, whole_k, whole_v, 0, whole_dkv[0], whole_dkv[1])
        del whole_k, whole_v
        returned = ctx.exchange.scatter_finish(ctx.exchange.scatter_start(whole_dkv.to(k.dtype)))
        dk += returned[0]
        dv += returned[1]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(k.dtype), None, None, None
