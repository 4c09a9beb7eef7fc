"""A Llama 3 style decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

Built on the meta device (no memory), then materialised and initialised with `init_weights()`,
which is deterministic in the seed and independent of how the parameters are sharded: every
parameter is drawn whole from its own generator and each rank keeps its slice. One seed gives
the same model on 1 GPU, on 8, or on a CPU test with 2 ranks.

Rotary embeddings use real arithmetic and the "rotate half" pairing (dimension i with i + d/2),
which is what Hugging Face's Llama uses, so exported weights need no permutation.

What code outside the model may change of how it runs (context parallelism's attention, activation
checkpointing, a compiled body, calls between blocks) is one object, `model.hooks` (hooks.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from titanlike.model.hooks import BlockHooks, ModelHooks
from titanlike.model.loss import LinearCrossEntropy
from titanlike.model.masks import document_mask, masked_attention
from titanlike.model.shape import ModelArgs


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the compute dtype: bf16 sums of squares lose too much.
        return F.rms_norm(x.float(), self.weight.shape, self.weight.float(), self.eps).type_as(x)


def rope_tables(head_dim: int, seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (seq_len, head_dim), each half repeated for the rotate-half pairing."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, S, H, D) by position: pairs (i, i + D/2) turn by angle pos·θ^(-2i/D)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return (x.float() * cos + rotated.float() * sin).type_as(x)


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = a.n_heads, a.n_kv_heads, a.head_dim
        self.qkv_widths = a.qkv_widths
        # q, k and v projections stacked in one Linear (rows: q, then k, then v): one matmul of
        # width (n_heads + 2·n_kv_heads)·head_dim instead of three narrow ones, and in backward one
        # matmul for the gradient of x instead of three and two additions. 1b, tensorwise float8,
        # one H100: 71.7-72.3k tok/s against 71.2k (docs/benchmarks/2026-11-22-stacked-qkv-gqa.md).
        # Hugging Face export splits it into q_proj, k_proj, v_proj (interchange.py).
        self.wqkv = nn.Linear(a.dim, sum(a.qkv_widths), bias=False)
        self.wo = nn.Linear(a.n_heads * a.head_dim, a.dim, bias=False)
        # QK-norm: one RMSNorm gain of head_dim shared by all heads, applied to each head's q and k
        # before RoPE. It bounds the attention logits, which lets small models take higher LRs.
        self.q_norm = RMSNorm(a.head_dim, a.norm_eps) if a.qk_norm else None
        self.k_norm = RMSNorm(a.head_dim, a.norm_eps) if a.qk_norm else None

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q (B, S, H, D), k and v (B, S, Hkv, D), with QK-norm and RoPE applied."""
        bsz, seq, _ = x.shape
        q, k, v = self.wqkv(x).split(self.qkv_widths, dim=-1)
        q = q.view(bsz, seq, self.n_heads, self.head_dim)
        k = k.view(bsz, seq, self.n_kv_heads, self.head_dim)
        v = v.view(bsz, seq, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None,
                attend: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
        """`attend`: the block's hooks.attend (context parallelism), or None."""
        bsz, seq, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        gqa = self.n_kv_heads != self.n_heads
        if attend is not None:  # context parallelism: `mask` is its own (parallel/context.py)
            out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, gqa)
            return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))
        if mask is not None:  # block_causal: attention within each document (masks.py)
            out = masked_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, gqa)
            return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))
        # Grouped-query attention: each kv head serves n_heads / n_kv_heads query heads. SDPA
        # shares them itself (enable_gqa): on an H100 the cuDNN kernel runs the 1b preset's
        # attention 8 % faster than on kv heads repeated into a copy (scripts/bench_attention.py).
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                             enable_gqa=gqa)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        # Gate and up stay two Linears: stacked, the backward of their split is a concatenation
        # that inductor writes out in bf16 before the float8 cast, 3-4 % slower in tensorwise
        # (a custom SwiGLU backward without the concatenation still lost 1.4 %).
        self.w1 = nn.Linear(a.dim, a.ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(a.dim, a.ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(a.ffn_dim, a.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(a.dim, a.norm_eps)
        self.attention = Attention(a)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps)
        self.feed_forward = FeedForward(a)
        # How this block runs where a transform changes it: its attention, recomputation, body (hooks.py).
        self.hooks = BlockHooks()

    def body(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, mask, self.hooks.attend)
        return x + self.feed_forward(self.ffn_norm(x))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None) -> torch.Tensor:
        # `mask`: a document mask (masks.py) with model.attn_mask = block_causal; None is causal.
        args = (x, cos, sin) if mask is None else (x, cos, sin, mask)
        body = self.hooks.body or self.body
        if self.hooks.recompute is not None:
            return self.hooks.recompute(body, *args, policy=self.hooks.policy)
        return body(*args)


class OutputLayer(nn.Linear):
    """The output layer: a bias-free Linear from the hidden states to the vocabulary, with the fused
    chunked loss (model/loss.py) as a second forward method. The loss reads the weight, which FSDP
    gathers only around a forward: parallel/fsdp.py registers `loss_sum` as one, so inside it the
    weight is the gathered one, FSDP casts `h` to the compute dtype, and the weight's gradient is
    reduce-scattered after backward as after `forward`'s."""

    def __init__(self, dim: int, vocab_size: int):
        super().__init__(dim, vocab_size, bias=False)

    def loss_sum(self, h: torch.Tensor, targets: torch.Tensor, chunk_tokens: int, ce_grad: Callable,
                 token_losses: bool = False):
        """Summed cross-entropy of this layer's logits of h (tokens × dim) against targets (tokens),
        `chunk_tokens` at a time, its gradients computed in forward (`LinearCrossEntropy`). With
        `token_losses`, (that sum, each token's fp32 loss): the buffer is made here, since FSDP casts a
        forward's floating-point arguments to the compute dtype (a buffer passed in would be a copy)."""
        if not token_losses:
            return LinearCrossEntropy.apply(h, self.weight, targets, chunk_tokens, ce_grad)
        tokens = torch.empty(targets.numel(), dtype=torch.float32, device=targets.device)
        return LinearCrossEntropy.apply(h, self.weight, targets, chunk_tokens, ce_grad, tokens), tokens


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, document_end: int | None = None):
        """`document_end`: the data's end-of-document id, which args.attn_mask = block_causal masks at;
        without it (inference: one prompt is one document) attention is causal."""
        super().__init__()
        self.args = args
        self.document_end = document_end if args.attn_mask == "block_causal" else None
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = OutputLayer(args.dim, args.vocab_size)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Rotary tables are derived state: rebuilt by init_weights(), never checkpointed.
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        # Everything outside code may change of how the model runs, in one object (hooks.py).
        self.hooks = ModelHooks(blocks=[block.hooks for block in self.blocks()])

    def sample_block(self, batch: int, seq: int, device: torch.device) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        """A fresh block of this model's shape on `device` (random weights, norm gains 1) and the
        arguments of its forward for a micro-batch of `batch` × `seq` bf16 activations: what a
        training step runs per block, for timing it (float8's `measure` gets this from the trainer)."""
        block = TransformerBlock(self.args).to(device)
        with torch.no_grad():
            for name, p in block.named_parameters():
                p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(std=0.02)
        cos, sin = rope_tables(self.args.head_dim, seq, self.args.rope_theta, device)
        x = torch.randn(batch, seq, self.args.dim, device=device, dtype=torch.bfloat16, requires_grad=True)
        return block, (x, cos, sin)

    def blocks(self) -> list[TransformerBlock]:
        """self.layers with their type (to a type checker an nn.ModuleList holds plain Modules)."""
        return cast("list[TransformerBlock]", list(self.layers))

    def forward(self, tokens: torch.Tensor, head=None, context=None) -> torch.Tensor:
        """The logits (batch, seq, vocab); or, given `head`, what `head(self.norm, self.output, h)`
        returns for the last block's output h: the loss (titanlike/model/loss.py) runs the final norm, the
        output layer and the cross-entropy itself, compiled as one graph or chunk by chunk so the
        whole logits never exist. Through this forward either way, so that FSDP's hooks on the model
        run. With context parallelism `tokens` are this rank's part of each window and `context` its
        SequenceShard (parallel/context.py): their window positions and attention's mask."""
        seq = tokens.shape[1]
        if context is not None:  # RoPE at the local tokens' positions in the window
            cos, sin = self.rope_cos[context.positions], self.rope_sin[context.positions]
        else:
            cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        h = self.tok_embeddings(tokens)
        if torch.is_autocast_enabled(h.device.type):
            # The residual stream in the compute dtype. Autocast leaves an embedding lookup in the
            # weight's dtype, so on one GPU (autocast over fp32 weights) the stream, every residual
            # add and every gradient flowing back along it would be fp32: twice the bytes through
            # each block's norms and adds. FSDP's bf16 parameters give bf16 here already; with the
            # cast one GPU computes in the same dtypes as many.
            h = h.to(torch.get_autocast_dtype(h.device.type))
        if cos.dtype != h.dtype and not torch.is_autocast_enabled(h.device.type):
            # FSDP's mixed precision: each block would cast the fp32 tables to the compute dtype on
            # entry (FSDP casts a module's floating-point inputs) and keep its own copy for backward,
            # 0.12 GiB over 8b's 32 blocks. Cast once here, the same values. (Under autocast, one
            # process, RoPE keeps computing with the fp32 tables.)
            cos, sin = cos.to(h.dtype), sin.to(h.dtype)
        mask = None  # causal: SDPA's own
        if context is not None:  # context parallelism: the mask ContextParallel.shard made
            mask = context.mask
        elif self.document_end is not None:  # one mask for every layer, from this micro-batch's tokens
            mask = document_mask(tokens, self.document_end, self.hooks.flex_attention)
        for i, layer in enumerate(self.layers):
            if i in self.hooks.before_block:
                self.hooks.before_block[i]()
            h = layer(h, cos, sin, mask)
        return self.output(self.norm(h)) if head is None else head(self.norm, self.output, h)

    # ---- initialisation ------------------------------------------------------------------

    def init_rope(self, seq_len: int, theta: float | None = None, device: torch.device | None = None) -> None:
        """Rotary tables for `seq_len` positions with base `theta` (default: the shape's rope_theta; a
        long-context stage rotates with another), on `device` (default: where the tables are, else the
        weights'; offloaded weights live on the host, their tables on the GPU)."""
        tables = self.get_buffer("rope_cos")
        device = device or (tables.device if tables.numel() else self.tok_embeddings.weight.device)
        theta = self.args.rope_theta if theta is None else theta
        self.rope_cos, self.rope_sin = rope_tables(self.args.head_dim, seq_len, theta, device)

    def init_std(self, name: str) -> float:
        """Per-parameter init scale (0 means 'ones', for norm gains)."""
        a = self.args
        if name.endswith("norm.weight"):
            return 0.0
        if name == "tok_embeddings.weight":
            return a.dim**-0.5 if a.tie_embeddings else 1.0
        if name == "output.weight":
            return a.dim**-0.5
        if name.endswith(("wo.weight", "w2.weight")):
            # Residual-branch outputs shrink with depth so the residual stream keeps its scale.
            return 0.02 / math.sqrt(2 * a.n_layers)
        return 0.02

    @torch.no_grad()
    def init_weights(self, seed: int, seq_len: int, device: torch.device | None = None) -> None:
        """Deterministic, sharding-independent init: each full parameter from its own generator.
        `device`: where the numbers are drawn and the rotary tables live, if not where the parameters
        are: weights offloaded to the host are drawn on their GPU, the same numbers as without offload."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        if self.args.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            # Module.to_empty() materialises a meta model module by module, which unties a shared
            # weight on a plain (unsharded) model; FSDP keeps it tied. Tie it again before init.
            self.output.weight = self.tok_embeddings.weight
        for index, (name, param) in enumerate(self.named_parameters()):
            std = self.init_std(name)
            draw = device or param.device
            gen = torch.Generator(device=draw).manual_seed(seed * 100_003 + index)
            full = torch.empty(param.shape, dtype=torch.float32, device=draw)
            if std == 0.0:
                full.fill_(1.0)
            else:
                nn.init.trunc_normal_(full, std=std, a=-3 * std, b=3 * std, generator=gen)
            if isinstance(param, DTensor):
                # Every rank drew the same full tensor; keep the local slice, no communication.
                full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
                # Shard into shard: copy_ converts the dtype and, offloaded, moves it to the host.
                param.to_local().copy_(full.to_local())
            else:
                param.copy_(full)
        self.init_rope(seq_len, device=device)
