"""Context parallelism (parallel.cp = N): the N ranks of a context group split every sample's
sequence between them, so a window whose activations do not fit one GPU trains on N.

Layout (head-tail load balancing). A window of S tokens is cut into 2N equal chunks of L = S / 2N;
rank r of the group holds chunk r and chunk 2N-1-r, side by side (`shard_sequence`). Under a causal
mask a chunk's cost grows with its position, and chunks r and 2N-1-r together cost the same for
every r, so no rank waits on another at the end of a layer.

Attention (all-gather, as Llama 3's paper describes): every other part of a block is per token and
runs on the local tokens untouched. In each attention layer the rank all-gathers the keys and
values of its group and computes its own queries against the keys each may see; backward
reduce-scatters (sums) the keys' and values' gradients back to the ranks that made them.
- causal, with the override cp_attention_kernels (titanlike/overrides): per local chunk c covering
  window positions [s, s+L), attention of its queries against keys [0, s+L): an unmasked prefix and a
  square causal block on the rank's own keys, merged by log-sum-exp (parallel/chunk_attention.py), on
  cuDNN's fused attention on a GPU in bf16/fp16 (the one SDPA runs for a whole window on Hopper),
  torch's fused CPU attention on a CPU, attention written out in torch on a GPU in fp32 (`kernel_for`).
  One custom op each way (chunk_attention.py says why): the gather starts before the square blocks;
  only the rank's own keys and values are kept for backward, which gathers the rest again: what a rank
  keeps shrinks with cp. Not FlashAttention's own
  bottom-right mask through SDPA's flash op, which is one call a chunk but a slower kernel: a cp 2 rank
  of `1b` at 16,384 tokens ran at 0.67× one GPU's speed on it, 0.81× on cuDNN's (H200, docs/benchmarks).
  Not flex attention either: on an H200 its causal kernel took 2.4 times cuDNN's time at 16,384 tokens.
- causal on stock torch (the override off): the window as one document under block_causal's mask.
- block_causal: the decoder's document mask over window positions (model/masks.py
  `document_mask_at`): query i is the local token's window position, keys are the gathered ones;
  document ids come from the whole window, which every rank of the group reads anyway. A flex
  BlockMask on a GPU, a dense mask for SDPA on a CPU. Flex runs here with torch's default kernel
  options on contiguous inputs and the kv heads as they are (its grouped-query support: no copies
  repeated to the query heads, which were kept for backward, 4× the window's keys and values on `8b`);
  the two-GPU tests measured it right against unsplit attention (H200, torch 2.11). Its wrong key and
  value gradients before were the BlockMask's transposed index lists (model/masks.py `_block_lists`). Its
  keys and values come from `gather`, DTensor's public redistribute (the backward is the
  reduce-scatter); autograd keeps them for backward, unless activation checkpointing recomputes the
  block (the selective policy never keeps them: its backward gathers again).

Why not torch's own `context_parallel`: it lives in a private, experimental module whose API changed
across the torch versions this runs on (2.11 to 2.14), it has no CPU SDPA path (so no gloo tests),
and its flex attention support differs by version. The all-gather form is a few dozen lines.

The rest of the run: the loader hands the same samples to every rank of a group (its data-parallel
rank is rank // N) and each keeps its part of inputs, targets and positions (`ContextParallel.shard`:
one read of the batch per rank). RoPE reads its tables at the local tokens' window positions. Each
rank's loss is the mean over its local tokens, equal counts on every rank, and FSDP (over dp_shard ×
cp ranks) averages the gradients over all of them: the gradient of the window's mean loss, and the
logged loss (a mean over ranks) is the window's mean.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from titanlike import overrides
from titanlike.model.decoder import Transformer
from titanlike.model.masks import BLOCK_SIZE as FLEX_BLOCK
from titanlike.model.masks import document_ids, document_mask_at, masked_attention
from titanlike.parallel.chunk_attention import CpuKernel, CudnnKernel, TorchKernel, causal_chunks, make_plan

CAUSAL = "causal"  # the causal mask of a context-parallel micro-batch: each rank's chunks know their keys


def chunks_of(rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of 2·cp) of a window that context-parallel rank `rank` holds: head and tail."""
    return rank, 2 * cp - 1 - rank


def shard_sequence(x: torch.Tensor, rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """This rank's part of `x` along `dim` (the sequence): its two chunks, side by side."""
    parts = x.chunk(2 * cp, dim=dim)
    head, tail = chunks_of(rank, cp)
    return torch.cat([parts[head], parts[tail]], dim=dim)


def window_order(gathered: torch.Tensor, cp: int) -> torch.Tensor:
    """(cp · n, ..., 2L, d), every rank's (n, ..., 2L, d) part stacked in rank order (what an all-gather
    along dim 0 makes), as (n, ..., cp · 2L, d) in window order, in one copy."""
    n, *middle, local, dim = gathered.shape
    n //= cp
    parts = gathered.view(cp, n, *middle, 2, local // 2, dim)
    # Every rank's head chunk in rank order, then the tail chunks in reverse (views: flip would copy).
    tails = [parts[r].select(-3, 1) for r in reversed(range(cp))]
    ordered = torch.stack([*parts.select(-3, 0), *tails], dim=-3)  # (n, ..., 2cp, L, d)
    return ordered.reshape(n, *middle, cp * local, dim)


class KeyValueExchange:
    """The collectives of causal attention under cp (parallel/chunk_attention.py), each split into a start
    and a finish so that attention runs between them: c10d's all-gather and reduce-scatter, async (on a
    GPU, NCCL's stream runs them beside the compute stream; a finish makes the compute stream wait).

    Each is two collectives, one of the ranks' tail chunks and one of their head chunks, into (and out of)
    one buffer in chunk_attention's `prefix_order`: each rank reads every prefix of the window from it as it
    lies, with no copy into window order."""

    def __init__(self, group):
        self.group, self.cp = group, dist.get_world_size(group)

    def gather_start(self, kv: torch.Tensor):
        """Start gathering every rank's (2, L, ...) keys and values (its head chunk, then its tail chunk)."""
        whole = kv.new_empty((2 * self.cp, *kv.shape[1:]))
        # Chunks stacked along the tokens (dim 0), as c10d gathers.
        return whole, self._start(_all_gather, (whole[:self.cp].flatten(0, 1), kv[1]),
                                  (whole[self.cp:].flatten(0, 1), kv[0]))

    def gather_finish(self, pending) -> torch.Tensor:
        """(2·cp, L, ...): the window's keys and values, chunk by chunk in `prefix_order`."""
        return _finish(pending)

    def scatter_start(self, send: torch.Tensor):
        """Start summing (2·cp, L, ...) key and value gradients for every chunk of the window, in `prefix_order`,
        over the group; each rank receives the sums for its own two chunks."""
        mine = send.new_empty((2, *send.shape[1:]))
        return mine, self._start(_reduce_scatter, (mine[1], send[:self.cp].flatten(0, 1)),
                                 (mine[0], send[self.cp:].flatten(0, 1)))

    def scatter_finish(self, pending) -> torch.Tensor:
        """This rank's (2, L, ...) summed key and value gradients: its head chunk's, then its tail chunk's."""
        return _finish(pending)

    def _start(self, collective, tails: tuple, heads: tuple) -> list:
        """`collective(output, input)` of the tail chunks, then of the head chunks, async over the group."""
        return [collective(out, inp, group=self.group, async_op=True) for out, inp in (tails, heads)]


def _finish(pending) -> torch.Tensor:
    """The buffer of a started exchange, once its collectives are done."""
    buffer, works = pending
    for work in works:
        work.wait()
    return buffer


# c10d's newer names where this torch has them (torch 2.13 warns that the older ones are deprecated).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class SequenceShard:
    """What the model needs of one micro-batch beyond its local tokens: their window positions (for
    RoPE) and attention's mask, as the blocks take it (see ContextParallel.attend)."""

    positions: torch.Tensor
    mask: object


class ContextParallel:
    """One rank's part in its context group: the sharding of each micro-batch and the attention that
    gathers the group's keys and values."""

    def __init__(self, group, flex: bool | None = None, device_type: str = "cpu"):
        self.group = group
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.flex = flex  # document masks for flex attention; None = on CUDA
        self._positions: dict[tuple, torch.Tensor] = {}
        # The group as a DeviceMesh, for DTensor's gather: made here, never inside a compiled block.
        self.mesh = DeviceMesh.from_group(group, device_type)
        # Causal attention on fused kernels with the gather overlapped and not kept for backward (an
        # override of torch's internals), or stock: SDPA's public front door over the gathered keys.
        self.kernels = overrides.active("cp_attention_kernels")
        self.exchange = KeyValueExchange(group)
        # Each kernel's chunk_attention plan, by the number the ops know it by: made here, never while
        # torch.compile traces attend (it would trace the registration as a side effect, done after).
        self._plans = {kernel: make_plan(chunks_of(self.rank, self.cp), kernel, self.exchange)
                       for kernel in (CudnnKernel, CpuKernel, TorchKernel)}

    def positions(self, seq: int, device: torch.device) -> torch.Tensor:
        """Window positions of this rank's tokens of a `seq`-token window."""
        key = (seq, str(device))
        if key not in self._positions:
            self._positions[key] = shard_sequence(torch.arange(seq, device=device), self.rank, self.cp, dim=0)
        return self._positions[key]

    def shard(self, inputs: torch.Tensor, targets: torch.Tensor, document_end: int | None):
        """This rank's (inputs, targets, SequenceShard) of a micro-batch's whole windows."""
        seq = inputs.shape[1]
        positions = self.positions(seq, inputs.device)
        if document_end is None and self.kernels:
            mask: object = CAUSAL
        else:
            # Document masks; or causal attention on stock torch: the mask of a window that is one document.
            docs = (document_ids(inputs, document_end) if document_end is not None else
                    torch.zeros(inputs.shape, dtype=torch.int32, device=inputs.device))
            flex = self.flex if self.flex is not None else inputs.is_cuda
            flex = flex and seq % (2 * self.cp * FLEX_BLOCK) == 0  # else flex cannot split it: a dense mask
            mask = document_mask_at(docs, positions, flex)
        local = (shard_sequence(inputs, self.rank, self.cp), shard_sequence(targets, self.rank, self.cp))
        return *local, SequenceShard(positions, mask)

    def gather(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The group's keys and values, (batch, heads, seq, head_dim) each, in window order, from each
        rank's (batch, heads, seq / cp, head_dim); backward sums their gradients back to the ranks that
        hold them. DTensor's public redistribute: the ranks' parts stacked (Shard) become every rank's
        (Replicate), an all-gather; the gradient of a replicated value differs by rank (Partial), and
        back to Shard it is a reduce-scatter."""
        kv = DTensor.from_local(torch.stack([k, v]).contiguous(), self.mesh, [Shard(0)], run_check=False)
        whole = window_order(kv.redistribute(self.mesh, [Replicate()]).to_local(grad_placements=[Partial()]), self.cp)
        return whole[0], whole[1]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, gqa: bool) -> torch.Tensor:
        """Attention of this rank's (batch, heads, 2L, head_dim) queries over the whole window; `mask`:
        the SequenceShard's (CAUSAL, or a document mask)."""
        if mask is None:
            raise RuntimeError("context-parallel attention needs the micro-batch's mask: call the model with "
                               "the SequenceShard that ContextParallel.shard made")
        if isinstance(mask, str):  # CAUSAL, on the fused kernels
            return causal_chunks(q, k, v, self._plans[kernel_for(q)])
        k, v = self.gather(k, v)
        if not isinstance(mask, torch.Tensor):  # a flex BlockMask: grouped kv heads as they are, all contiguous
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        return masked_attention(q, k, v, mask, gqa, tuned=False)


def kernel_for(q: torch.Tensor):
    """The kernel of causal attention's parts (parallel/chunk_attention.py) for queries like `q`."""
    if q.device.type == "cpu":
        return CpuKernel
    return CudnnKernel if q.dtype in (torch.bfloat16, torch.float16) else TorchKernel


def apply_context_parallel(model: Transformer, group, device_type: str = "cpu") -> ContextParallel:
    """Make every attention layer of `model` gather its keys and values over `group` (of `device_type`
    devices); the model then takes local tokens and a SequenceShard (ContextParallel.shard) per micro-batch."""
    context = ContextParallel(group, flex=model.hooks.flex_attention, device_type=device_type)
    for block in model.hooks.blocks:
        block.attend = context.attend
    return context
