"""Document masks for model.attn_mask = block_causal: a token attends only to the earlier tokens of
its own document within the window.

Documents are told apart by the end-of-document id: a token's document is the number of end ids
before it in the window (the end id itself closes its own document). On a GPU the mask is a flex
attention BlockMask, built once per micro-batch and shared by every layer, and attention runs
through flex attention (compiled: its eager form is a slow reference). On a CPU, where flex
attention has no backward, the same mask is a dense (batch, 1, seq, seq) boolean one for SDPA. The
causal mask (the default) takes neither path: the decoder calls SDPA with is_causal as it always did.

The BlockMask is built from each 128-token block's range of document ids rather than by
create_block_mask, which evaluates the mask on every (batch, query, key) triple: that took 3.1 ms
per micro-batch on an H100 at batch 64 x 2048 tokens and 2.4 ms at 6 x 4096, about 1 % of a 124m
training step. Document ids never decrease along a window, so a block's ids are the range from its
first token's to its last's, and comparing ranges classifies a pair of blocks (B x blocks² work, not
B x seq²): no shared document, skipped; one document across both and the key block earlier, full
(no mask needed inside); else partial (the diagonal and document boundaries), where the kernel
applies the same per-token rule. The blocks are those create_block_mask lists, in its order; built
so, 0.45 ms and 0.8 ms at those two shapes (an H100, torch 2.11, where create_block_mask took 4.9
and 4.5 ms in the same timing loop), mostly the launching of some 60 small kernels. A window whose
length is not a multiple of the block size (not the case in training) falls back to
create_block_mask.

Rotary embeddings are not restarted at a document's first token: attention scores depend only on
the distance between two positions, so a document's outputs are the same whatever precedes it.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import torch.nn.functional as F

_compiled_flex = None
# Flex attention's default block size (create_block_mask's BLOCK_SIZE): the tile its kernels skip,
# run unmasked (a full block) or run with the mask applied (a partial one).
BLOCK_SIZE = 128

# Flex attention kernel options measured faster than torch's defaults, by (compute capability,
# head_dim), for bf16; elsewhere torch's own. On an H100 at the 124m shape (24 x 2048, 12/3 heads of
# 64, documents of about 1,500 tokens) the forward kernel with 128 x 64 tiles and 4 stages took
# 0.56 ms against the default's 0.76 (cuDNN's causal forward: 0.43); the backward's defaults were
# already the fastest tried (scripts/bench_doc_attention.py, docs/benchmarks/2026-11-25-flex-kernel-options.md).
KERNEL_OPTIONS: dict[tuple[tuple[int, int], int], dict] = {
    ((9, 0), 64): {"BLOCK_M": 128, "BLOCK_N": 64, "fwd_num_stages": 4, "fwd_num_warps": 4},
}
# Each CUDA device's compute capability, read by document_mask outside any compiled region, so that
# masked_attention can look its options up while being traced.
_capability: dict[int, tuple[int, int]] = {}


def document_ids(tokens: torch.Tensor, end_id: int) -> torch.Tensor:
    """(batch, seq) int32: how many documents ended before each position."""
    ends = (tokens == end_id).int()
    return torch.cumsum(ends, dim=1, dtype=torch.int32) - ends


def document_mask(tokens: torch.Tensor, end_id: int, flex: bool | None = None):
    """The block-causal mask of a micro-batch of token ids: a BlockMask for flex attention (`flex`;
    default: on CUDA), else a dense boolean mask for SDPA."""
    docs = document_ids(tokens, end_id)
    batch, seq = tokens.shape
    if tokens.is_cuda and tokens.device.index not in _capability:
        _capability[tokens.device.index] = torch.cuda.get_device_capability(tokens.device)
    if flex if flex is not None else tokens.is_cuda:
        from torch.nn.attention.flex_attention import BlockMask, create_block_mask

        def same_document(b, h, q, kv):
            return (q >= kv) & (docs[b, q] == docs[b, kv])

        if seq % BLOCK_SIZE == 0:
            num, indices = _document_blocks(docs)
            return BlockMask(seq_lengths=(seq, seq), kv_num_blocks=num[0], kv_indices=indices[0],
                             full_kv_num_blocks=num[1], full_kv_indices=indices[1], q_num_blocks=num[2],
                             q_indices=indices[2], full_q_num_blocks=num[3], full_q_indices=indices[3],
                             BLOCK_SIZE=(BLOCK_SIZE, BLOCK_SIZE), mask_mod=same_document)
        # A window of another length (not met in training): the mask evaluated on every pair,
        # compiled on a GPU (the eager form evaluates all seq² pairs in one go). (A private argument
        # since torch 2.5; passed only where this torch still takes it.)
        compiled = {"_compile": True} if tokens.is_cuda and _takes_compile(create_block_mask) else {}
        return create_block_mask(same_document, batch, None, seq, seq, device=tokens.device, **compiled)
    causal = torch.ones(seq, seq, dtype=torch.bool, device=tokens.device).tril()
    return (causal & (docs[:, :, None] == docs[:, None, :]))[:, None]


def _document_blocks(docs: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The blocks of a BlockMask for the document ids `docs` (batch, seq), seq a multiple of
    BLOCK_SIZE: 4 counts (batch, 1, blocks) and 4 indices (batch, 1, blocks, blocks), int32, of the
    partial and the full key blocks of each query block, then of the partial and the full query blocks
    of each key block; each row's blocks first and ascending, then the rest (padding the kernels never
    read), as create_block_mask lays them out."""
    return _block_lists(_block_kinds(docs))


def _block_kinds(docs: torch.Tensor) -> torch.Tensor:
    """(2, batch, blocks, blocks) bool: query block i and key block j share a document but not every
    pair (partial), or every pair attends (full)."""
    # A block's lowest and highest document id: its first token's and its last's, ids never
    # decreasing along a window. (batch, blocks) each.
    first, last = docs[:, ::BLOCK_SIZE], docs[:, BLOCK_SIZE - 1::BLOCK_SIZE]
    q_first, q_last = first[:, :, None], last[:, :, None]  # query block i along dim 1
    kv_first, kv_last = first[:, None, :], last[:, None, :]  # key block j along dim 2
    order = torch.arange(first.shape[1], device=docs.device)
    causal = order[None, :] <= order[:, None]  # j <= i
    shared = causal & (kv_first <= q_last) & (kv_last >= q_first)  # some document in both ranges
    # Every token of both blocks in one document, and all of key block j before query block i.
    full = (order[None, :] < order[:, None]) & (q_first == q_last) & (kv_first == kv_last) & (kv_first == q_first)
    return torch.stack([shared & ~full, full])


def _block_lists(blocks: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """_block_kinds' (2, batch, query blocks, key blocks) as a BlockMask's four counts (batch, 1, rows)
    and four index lists (batch, 1, rows, columns)."""
    # The query side (what the backward pass reads) is the transpose: derived here from the same
    # block matrices rather than by from_kv_blocks, which rebuilds them from the index lists (most of
    # its cost). One sort for all four where both sides have the same shape.
    sides = [blocks, blocks.transpose(-2, -1)]
    if blocks.shape[-1] == blocks.shape[-2]:
        sides = [torch.cat(sides)]
    counts, indices = [], []
    for side in sides:
        side = side.to(torch.int8)
        counts += list(side.sum(dim=-1, dtype=torch.int32)[:, :, None])
        # Contiguous: flex's kernels read the lists as laid out row after row, and argsort of the
        # transposed side keeps its transposed strides (a context-parallel rank's non-square mask; the
        # key and value gradients came out wrong on an H200 from such q_indices).
        indices += list(torch.argsort(side, dim=-1, descending=True, stable=True).to(torch.int32)
                        .contiguous()[:, :, None])
    return counts, indices


def document_mask_at(docs: torch.Tensor, positions: torch.Tensor, flex: bool):
    """The block-causal mask of queries at window positions `positions` (seq_q,) against every key of the
    window, from the whole window's document ids `docs` (batch, seq): a context-parallel rank's
    queries against the gathered keys. With `flex` a BlockMask, which needs every run of BLOCK_SIZE
    queries to be one whole block of the window (positions made of block-aligned ranges); else a dense
    (batch, 1, seq_q, seq) boolean mask for SDPA."""
    batch, seq = docs.shape
    keys = torch.arange(seq, device=docs.device)
    if not flex:
        causal = positions[:, None] >= keys[None, :]
        return (causal & (docs[:, positions, None] == docs[:, None, :]))[:, None]
    from torch.nn.attention.flex_attention import BlockMask

    def same_document(b, h, q, kv):
        at = positions[q]
        return (at >= kv) & (docs[b, at] == docs[b, kv])

    # The window's block pairs, then the rows of this rank's query blocks.
    rows = positions[::BLOCK_SIZE] // BLOCK_SIZE
    num, indices = _block_lists(_block_kinds(docs)[:, :, rows])
    return BlockMask(seq_lengths=(positions.numel(), seq), kv_num_blocks=num[0], kv_indices=indices[0],
                     full_kv_num_blocks=num[1], full_kv_indices=indices[1], q_num_blocks=num[2],
                     q_indices=indices[2], full_q_num_blocks=num[3], full_q_indices=indices[3],
                     BLOCK_SIZE=(BLOCK_SIZE, BLOCK_SIZE), mask_mod=same_document)


@functools.cache
def _takes_compile(create_block_mask) -> bool:
    return "_compile" in inspect.signature(create_block_mask).parameters


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, gqa: bool,
                     tuned: bool = True) -> torch.Tensor:
    """Attention of (batch, heads, seq, head_dim) q, k, v under a document_mask; flex attention with the
    measured kernel options unless not `tuned` (torch's defaults)."""
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    from torch.nn.attention.flex_attention import flex_attention

    global _compiled_flex
    options = kernel_options(q) if tuned else None
    if torch.compiler.is_compiling():
        # Inside a compiled block (compile.enable) the block's graph compiles it. Its inputs are
        # pinned to (batch, heads, seq, head_dim) layout, which the RoPE kernel then writes directly:
        # fed a transposed RoPE output, torch 2.13's CPU flex template computed wrong outputs
        # (0.7 off in a test where the same inputs given contiguous matched SDPA exactly).
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        return flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa, kernel_options=options)
    if not q.is_cuda:  # inference and tests only: flex attention has no CPU backward
        return flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa)
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex(q, k, v, block_mask=mask, enable_gqa=gqa, kernel_options=options)


def kernel_options(q: torch.Tensor) -> Any:
    """The measured KERNEL_OPTIONS for q's device and head_dim, or None (torch's defaults). (Any: the
    FlexKernelOptions type is torch's, and not in every torch this runs on.)"""
    if not q.is_cuda or q.dtype != torch.bfloat16:
        return None
    options = KERNEL_OPTIONS.get((_capability.get(q.device.index, (0, 0)), q.shape[-1]))
    return dict(options) if options else None
