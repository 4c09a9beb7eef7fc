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
apart, so that work that does not need them can sit between: forward starts the all-gather of the
group's keys and values, computes the square blocks on the rank's own keys, then waits and computes
the prefixes; backward computes the prefixes' gradients first (the only ones that reach other ranks'
keys), starts the reduce-scatter that sums and returns them, computes the square blocks' gradients,
then waits. Eager, the work queues in that order. Compiled (H200, torch 2.11), inductor's schedule
placed both collectives after the square blocks, so a compiled run does not overlap them yet; it ran
at the speed of the gather outside this Function
(docs/benchmarks/2026-11-26-cp-prefetch-offload-long-windows.md).

Kernels: CudnnKernel on a GPU in bf16/fp16; CpuKernel, torch's fused CPU attention, on a CPU (what
the gloo tests run); TorchKernel, attention written out in torch, on a GPU in fp32. Why not FlashAttention's
bottom-right causal mask in one call per chunk (SDPA's flash op takes fewer queries than keys that
way): a slower kernel; a cp 2 rank of `1b` at 16,384 tokens ran at 0.67× one GPU's speed on it, 0.81×
on cuDNN's parts (H200, docs/benchmarks/2026-11-26-cp-kernels-fit-to-target.md).
"""

from __future__ import annotations

from typing import Any

import torch

aten = torch.ops.aten


class CudnnKernel:
    """One part's attention and its backward on cuDNN (torch's `_scaled_dot_product_cudnn_attention`
    ops, as SDPA's own autograd calls them). `forward` gives (out, lse as (b, h, L, 1) fp32, state for
    backward: tensors, then other values)."""

    @staticmethod
    def forward(q, k, v, causal: bool):
        o, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False)
        return o, lse.float().reshape(*o.shape[:3], 1), (cum_q, cum_k, seed, offset), (max_q, max_k, lse.dim())

    @staticmethod
    def backward(grad, q, k, v, out, lse, causal: bool, tensors, values):
        cum_q, cum_k, seed, offset = tensors
        max_q, max_k, lse_dims = values
        lse = lse if lse_dims == 4 else lse.squeeze(-1)
        return aten._scaled_dot_product_cudnn_attention_backward(
            grad, q, k, v, out, lse.contiguous(), seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, causal)


def _per_kv_head(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Gradients computed for kv heads repeated to the query heads, summed back per kv head."""
    return x.unflatten(1, (kv_heads, x.shape[1] // kv_heads)).sum(2)


class CpuKernel:
    """One part on torch's fused CPU attention (`_scaled_dot_product_flash_attention_for_cpu` and its
    backward, what SDPA runs on a CPU): exact to fp32 rounding, and a few extern calls for torch.compile
    to trace instead of TorchKernel's materialised scores (the compiled cp test, cold, once on a 2-core CI
    machine: 51 s against 59). It takes as many kv heads as query heads: they are repeated, and their
    gradients summed back."""

    @staticmethod
    def forward(q, k, v, causal: bool):
        groups = q.shape[1] // k.shape[1]
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), 0.0, causal)
        return out, lse.float().unsqueeze(-1), (), ()

    @staticmethod
    def backward(grad, q, k, v, out, lse, causal: bool, tensors, values):
        groups = q.shape[1] // k.shape[1]
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), out,
            lse.squeeze(-1).contiguous(), 0.0, causal)
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
        ctx.local_kv = (k.shape, k.dtype)  # the local keys are in whole_k: not saved twice
        ctx.save_for_backward(q, whole_k, whole_v, *outs, *lses, *saved)
        return torch.cat(outs, dim=2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, whole_k, whole_v, *rest = ctx.saved_tensors
        n = len(ctx.chunks)
        outs, lses, saved = rest[:n], rest[n:2 * n], rest[2 * n:]
        length = q.shape[2] // n
        local_shape, kv_dtype = ctx.local_kv
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk, dv = (torch.zeros(local_shape, dtype=torch.float32, device=q.device) for _ in range(2))
        whole_dkv = torch.zeros((2, *whole_k.shape), dtype=torch.float32, device=q.device)
        offsets, used = [], 0
        for *_, count, _ in ctx.meta:
            offsets.append(used)
            used += count

        def part_backward(j: int, keys: torch.Tensor, values_: torch.Tensor, dkeys, dvalues, base: int) -> None:
            i, start, end, causal, count, values = ctx.meta[j]
            rows = slice(i * length, (i + 1) * length)
            gq, gk, gv = ctx.kernel.backward(grad[:, :, rows].contiguous(), q[:, :, rows], keys[:, :, start:end],
                                             values_[:, :, start:end], outs[i], lses[i], causal,
                                             saved[offsets[j]:offsets[j] + count], values)
            dq[:, :, rows] += gq
            dkeys[:, :, start - base:end - base] += gk
            dvalues[:, :, start - base:end - base] += gv

        blocks = [j for j, m in enumerate(ctx.meta) if m[3]]
        prefixes = [j for j, m in enumerate(ctx.meta) if not m[3]]
        # The prefixes first: their key gradients are the ones to sum over the group and send back.
        for j in prefixes:
            part_backward(j, whole_k, whole_v, whole_dkv[0], whole_dkv[1], 0)
        pending = ctx.exchange.scatter_start(whole_dkv.to(kv_dtype))
        # While the reduce-scatter runs: the square blocks, whose key gradients are this rank's own.
        for j in blocks:
            i = ctx.meta[j][0]
            part_backward(j, whole_k, whole_v, dk, dv, ctx.meta[j][1] - i * length)
        returned = ctx.exchange.scatter_finish(pending)
        dk += returned[0]
        dv += returned[1]
        return dq.to(q.dtype), dk.to(kv_dtype), dv.to(kv_dtype), None, None, None
