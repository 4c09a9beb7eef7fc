"""Causal attention of a context-parallel rank's chunks over the window's keys, on cuDNN's kernel.

A rank's chunk c of a window cut into chunks of L tokens holds the queries at window positions
[cL, cL + L); under a causal mask they see keys [0, cL + L): every key before the chunk, unmasked, and
the chunk's own keys under the square causal mask. cuDNN's fused attention (through
`_scaled_dot_product_cudnn_attention`, what SDPA runs for the whole window on Hopper) aligns its
causal mask to the top left, which is only right for the square block, so each chunk is two calls:

    prefix: queries of c against keys [0, cL), no mask      (absent for chunk 0)
    block:  queries of c against keys [cL, cL + L), causal

merged exactly with their log-sum-exps (out = Σ out_p · exp(lse_p − lse), lse = log Σ exp(lse_p)).
Backward calls cuDNN's backward for each part with the merged output and log-sum-exp, which makes each
part's softmax the merged one (ring attention's rule); the parts' gradients add up in fp32.
Grouped-query kv heads go to the kernel as they are (it shares them).

Why not FlashAttention's bottom-right causal mask in one call per chunk (SDPA's flash op takes fewer
queries than keys that way): it is a slower kernel, and a cp 2 rank of `1b` at 16,384 tokens ran at 0.67×
one GPU's speed on it, 0.81× on this (H200, docs/benchmarks/2026-11-26-cp-kernels-fit-to-target.md).
"""

from __future__ import annotations

from typing import Any

import torch

aten = torch.ops.aten


def parts_of(chunk: int, length: int) -> list[tuple[int, int, bool]]:
    """The (key start, key end, causal) parts of chunk `chunk`'s attention, chunks `length` long."""
    start = chunk * length
    block = (start, start + length, True)
    return [(0, start, False), block] if start else [block]


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


class CausalChunks(torch.autograd.Function):
    """(batch, heads, len(chunks)·L, head_dim) queries of window chunks `chunks`, side by side, over
    (batch, kv_heads, window, head_dim) keys and values in window order; `kernel` computes each part
    (CudnnKernel; the tests hand it an exact one written out in torch)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks: tuple[int, ...],
                kernel: Any) -> torch.Tensor:
        length = q.shape[2] // len(chunks)
        outs, lses, saved, meta = [], [], [], []
        for i, chunk in enumerate(chunks):
            qi = q[:, :, i * length:(i + 1) * length]
            merged: tuple[torch.Tensor, torch.Tensor] | None = None  # (out, lse) in fp32
            for start, end, causal in parts_of(chunk, length):
                o, part_lse, tensors, values = kernel.forward(qi, k[:, :, start:end], v[:, :, start:end], causal)
                if merged is None:
                    merged = (o.float(), part_lse)
                else:  # out - sigmoid(lse_p - lse)·(out - out_p): the merge, stable whichever is larger
                    out, lse = merged
                    merged = (out - torch.sigmoid(part_lse - lse) * (out - o.float()),
                              lse - torch.nn.functional.logsigmoid(lse - part_lse))
                saved += tensors
                meta.append((i, start, end, causal, len(tensors), values))
            assert merged is not None
            out, lse = merged
            outs.append(out.to(q.dtype).contiguous())
            lses.append(lse)
        ctx.chunks, ctx.meta, ctx.kernel = chunks, meta, kernel
        ctx.save_for_backward(q, k, v, *outs, *lses, *saved)
        return torch.cat(outs, dim=2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, *rest = ctx.saved_tensors
        n = len(ctx.chunks)
        outs, lses, saved = rest[:n], rest[n:2 * n], rest[2 * n:]
        length = q.shape[2] // n
        dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v))
        used = 0
        for i, start, end, causal, count, values in ctx.meta:
            rows = slice(i * length, (i + 1) * length)
            gq, gk, gv = ctx.kernel.backward(grad[:, :, rows].contiguous(), q[:, :, rows], k[:, :, start:end],
                                             v[:, :, start:end], outs[i], lses[i], causal,
                                             saved[used:used + count], values)
            used += count
            dq[:, :, rows] += gq
            dk[:, :, start:end] += gk
            dv[:, :, start:end] += gv
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None
