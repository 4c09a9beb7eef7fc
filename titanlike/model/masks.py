"""Document masks for model.attn_mask = block_causal: a token attends only to the earlier tokens of
its own document within the window.

Documents are told apart by the end-of-document id: a token's document is the number of end ids
before it in the window (the end id itself closes its own document). On a GPU the mask is a flex
attention BlockMask, built once per micro-batch and shared by every layer, and attention runs
through flex attention (compiled: its eager form is a slow reference). On a CPU, where flex
attention has no backward, the same mask is a dense (batch, 1, seq, seq) boolean one for SDPA. The
causal mask (the default) takes neither path: the decoder calls SDPA with is_causal as it always did.

Rotary embeddings are not restarted at a document's first token: attention scores depend only on
the distance between two positions, so a document's outputs are the same whatever precedes it.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

_compiled_flex = None


def document_ids(tokens: torch.Tensor, end_id: int) -> torch.Tensor:
    """(batch, seq) int32: how many documents ended before each position."""
    ends = (tokens == end_id).int()
    return torch.cumsum(ends, dim=1, dtype=torch.int32) - ends


def document_mask(tokens: torch.Tensor, end_id: int, flex: bool | None = None):
    """The block-causal mask of a micro-batch of token ids: a BlockMask for flex attention (`flex`;
    default: on CUDA), else a dense boolean mask for SDPA."""
    docs = document_ids(tokens, end_id)
    batch, seq = tokens.shape
    if flex if flex is not None else tokens.is_cuda:
        from torch.nn.attention.flex_attention import create_block_mask

        def same_document(b, h, q, kv):
            return (q >= kv) & (docs[b, q] == docs[b, kv])

        # Compiled mask construction on a GPU: the eager form evaluates all seq² pairs in one go. (A
        # private argument since torch 2.5; passed only where this torch still takes it.)
        compiled = {"_compile": True} if tokens.is_cuda and _takes_compile(create_block_mask) else {}
        return create_block_mask(same_document, batch, None, seq, seq, device=tokens.device, **compiled)
    causal = torch.ones(seq, seq, dtype=torch.bool, device=tokens.device).tril()
    return (causal & (docs[:, :, None] == docs[:, None, :]))[:, None]


@functools.cache
def _takes_compile(create_block_mask) -> bool:
    return "_compile" in inspect.signature(create_block_mask).parameters


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, gqa: bool) -> torch.Tensor:
    """Attention of (batch, heads, seq, head_dim) q, k, v under a document_mask."""
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    from torch.nn.attention.flex_attention import flex_attention

    global _compiled_flex
    if torch.compiler.is_compiling():
        # Inside a compiled block (compile.enable) the block's graph compiles it. Its inputs are
        # pinned to (batch, heads, seq, head_dim) layout, which the RoPE kernel then writes directly:
        # fed a transposed RoPE output, torch 2.13's CPU flex template computed wrong outputs
        # (0.7 off in a test where the same inputs given contiguous matched SDPA exactly).
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        return flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa)
    if not q.is_cuda:  # inference and tests only: flex attention has no CPU backward
        return flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa)
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex(q, k, v, block_mask=mask, enable_gqa=gqa)
