"""Orthogonalising Muon's matrices: the odd-quintic Newton–Schulz iteration (batched), the update scale, and the
two collectives that give Newton–Schulz whole matrices when FSDP holds them in row shards.

Newton–Schulz must see the whole matrix: on a shard of rows it would orthogonalise the shard, a different
update. Under FSDP2 a Muon matrix is a DTensor sharded on its rows (Shard(0), torch.chunk's rule:
ceil(rows/W) rows a rank, the last ranks fewer or none) over the mesh's shard dimension, replicated over
the other (HSDP). Each matrix has one owner among the W ranks of its shard group (`assign_owners`:
balanced by Newton–Schulz FLOPs, then bytes; the same on every rank, as it depends on the shapes alone).
A step (`orthogonalize_sharded`):

1. every rank writes its rows of each matrix's update U (bf16, what Newton–Schulz casts to anyway) into
   one flat buffer, ordered by owner, and one `all_to_all_single` over the shard group (uneven split
   sizes; gloo and NCCL both have it) gives each owner every rank's rows of its matrices;
2. the owner orthogonalises them whole (`orthogonalize_whole`: the pieces of all its matrices, same
   shapes batched into one bmm-based call);
3. one `all_to_all_single` back gives each rank its rows of every result.

Each replica of an HSDP mesh does this in its own shard group, the same work on the same numbers. Plain
tensors, and DTensors whose rows are not split (a shard group of one), take `orthogonalize_local`: the
same arithmetic with no collective."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from titanlike.config.optimizer import NS_BATCH_ELEMENTS

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""(a, b, c) of the quintic iteration X <- a X + (b A + c A²) X with A = X Xᵀ: the coefficients of Keller
Jordan's Muon, chosen for the steepest slope at zero (singular values end near, not at, 1)."""
NS_POLYNOMIALS = ("quintic", "polar_express")
"""optimizer.ns_coefficients: the quintic's one (a, b, c) at every step, or Polar Express's own for each step
(optim/polar_express.py)."""
NS_STEPS = 5
NS_EPS = 1e-7
"""The Frobenius norm a matrix is divided by is at least this (a zero update stays zero)."""
ADJUST_LR = ("match_rms_adamw", "original")


Coefficients = tuple[tuple[float, float, float], ...]
"""Each Newton–Schulz step's (a, b, c); steps past the end take the last."""


def ns_schedule(polynomial: str, steps: int) -> Coefficients:
    """The (a, b, c) of each of `steps` steps for optimizer.ns_coefficients = `polynomial`."""
    if polynomial == "quintic":
        return (NS_COEFFICIENTS,)
    if polynomial == "polar_express":
        from titanlike.optim.polar_express import polar_express

        return polar_express(steps)
    raise ValueError(f"ns_coefficients = {polynomial!r}: must be one of {', '.join(NS_POLYNOMIALS)} or (a, b, c)")


def newton_schulz(batch: torch.Tensor, coefficients: Coefficients = (NS_COEFFICIENTS,),
                  steps: int = NS_STEPS, eps: float = NS_EPS) -> torch.Tensor:
    """The orthogonalised (k, rows, cols) `batch`, each matrix on its own, in bf16: cast to bf16, divided by
    its Frobenius norm (at least `eps`; that bounds its spectral norm by 1), then `steps` quintic
    iterations, step i with coefficients[i] (the last for the steps past the end); with the quintic's one
    (a, b, c), as torch.optim.Muon computes one matrix. A tall matrix is iterated as its transpose, so
    that the Gram matrix X Xᵀ is the small one."""
    if batch.ndim != 3:
        raise ValueError(f"newton_schulz takes a (k, rows, cols) batch, not shape {tuple(batch.shape)}")
    tall = batch.shape[1] > batch.shape[2]
    x = batch.bfloat16()
    if tall:
        x = x.mT
    x = x / torch.linalg.vector_norm(x, dim=(1, 2), keepdim=True).clamp(min=eps)
    for step in range(steps):
        a, b, c = coefficients[min(step, len(coefficients) - 1)]
        gram = torch.bmm(x, x.mT)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b A + c A²
        x = torch.baddbmm(x, poly, x, beta=a)  # a X + (b A + c A²) X
    return x.mT if tall else x


def update_scale(rows: int, cols: int, rule: str) -> float:
    """What the orthogonalised update of a rows × cols matrix is multiplied by before the learning rate.

    "match_rms_adamw" (0.2·sqrt(max(rows, cols))): an orthogonal rows × cols matrix has an RMS of
    1/sqrt(max(rows, cols)), so the update's RMS becomes 0.2, about AdamW's, and AdamW's learning rate
    and weight decay carry over (Moonshot's "Muon is Scalable for LLM Training"). "original"
    (sqrt(max(1, rows/cols))): Keller Jordan's, which wants a learning rate of its own (about 0.02)."""
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if rule == "original":
        return math.sqrt(max(1.0, rows / cols))
    raise ValueError(f"adjust_lr = {rule!r}: must be one of {', '.join(ADJUST_LR)}")


def ns_flops(rows: int, cols: int, steps: int = NS_STEPS) -> int:
    """Multiply-add FLOPs of Newton–Schulz on one rows × cols matrix (m = the smaller side, n = the larger):
    per step X Xᵀ (2m²n), A·A (2m³) and the product with X (2m²n)."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m ** 3)


def piece_bounds(rows: int, splits: tuple[int, ...] | None) -> list[tuple[int, int]]:
    """The row ranges of a matrix that are orthogonalised separately: each of `splits` (a stacked
    projection's parts, in order), or the whole matrix."""
    if not splits:
        return [(0, rows)]
    if sum(splits) != rows or any(s <= 0 for s in splits):
        raise ValueError(f"row splits {list(splits)} must be positive and add up to the matrix's {rows} rows")
    bounds, start = [], 0
    for width in splits:
        bounds.append((start, start + width))
        start += width
    return bounds


# ---- whole matrices from row shards -------------------------------------------------------------

@dataclass(frozen=True)
class Matrix:
    """One Muon matrix of a step: this rank's rows (all of them off the sharded path) of its gradient and its
    momentum buffer, already updated (B = mu·B + G), and how it is orthogonalised."""

    grad: torch.Tensor
    momentum: torch.Tensor
    nesterov: float | None
    """mu for Nesterov's U = G + mu·B; None for U = B."""
    rows: int
    cols: int
    pieces: tuple[tuple[int, int], ...]
    """Row ranges orthogonalised separately (a stacked projection's q, k and v), or the whole."""
    ns: tuple[Coefficients, int, float]
    """Newton–Schulz's (each step's coefficients, steps, eps)."""
    adjust_lr: str

    def write_update(self, out: torch.Tensor) -> None:
        """U of this rank's rows into `out` (bf16): computed in fp32, rounded once as it is written, so no
        fp32 copy of U is ever made (a shard of U is 4 bytes a parameter)."""
        if self.nesterov is None:
            out.copy_(self.momentum)
        else:
            torch.add(self.grad, self.momentum, alpha=self.nesterov, out=out)

    def scales(self) -> list[float]:
        return [update_scale(end - start, self.cols, self.adjust_lr) for start, end in self.pieces]

    def cost(self) -> int:
        return sum(ns_flops(end - start, self.cols, self.ns[1]) for start, end in self.pieces)


@dataclass(frozen=True)
class ShardGroup:
    """The ranks one matrix's rows are spread over (FSDP's shard mesh dimension) and this rank among them."""

    group: dist.ProcessGroup
    size: int
    rank: int


def shard_group(param: torch.Tensor, name: str = "") -> ShardGroup | None:
    """Where `param`'s rows live: its shard group, or None if this rank holds them all (a plain tensor, a
    DTensor replicated or sharded over one rank). A sharding other than rows over one mesh dimension
    (FSDP's Shard(0)) is refused: Newton–Schulz needs the whole matrix, and only rows are put together."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return None
    split = [(dim, p) for dim, p in enumerate(param.placements) if not p.is_replicate()]
    if not split:
        return None
    if len(split) > 1 or split[0][1] != Shard(0):
        raise ValueError(f"Muon matrix {name or tuple(param.shape)} is placed {param.placements}: only rows "
                         "sharded over one mesh dimension (FSDP's Shard(0)) are supported")
    dim = split[0][0]
    mesh = param.device_mesh
    if mesh.size(dim) == 1:
        return None
    return ShardGroup(mesh.get_group(dim), mesh.size(dim), mesh.get_local_rank(dim))


def row_ranges(rows: int, size: int) -> list[tuple[int, int]]:
    """Each rank's rows of a matrix sharded on dim 0 over `size` ranks, as FSDP2 and DTensor cut it:
    torch.chunk's ceil(rows / size) rows a rank, in rank order; the last ranks may get fewer or none."""
    chunk = -(-rows // size)
    return [(min(r * chunk, rows), min((r + 1) * chunk, rows)) for r in range(size)]


def assign_owners(costs: list[tuple[int, int]], size: int) -> list[int]:
    """An owner rank for each matrix of (FLOPs, bytes) `costs`: the costliest first, each to the rank with
    the least FLOPs so far (then bytes, then the lower rank). Deterministic in the list, so every rank of
    a shard group computes the same owners without a word."""
    loads = [(0, 0)] * size
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i][0], -costs[i][1], i)):
        r = min(range(size), key=lambda r: (loads[r], r))
        owners[i] = r
        loads[r] = (loads[r][0] + costs[i][0], loads[r][1] + costs[i][1])
    return owners


def orthogonalize_whole(matrices: list[Matrix], wholes: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Newton–Schulz of each whole matrix's pieces (`wholes[i]`: matrices[i]'s U, all its rows, bf16), every
    group of pieces of one shape and one setting in one batched call. Returns each matrix's orthogonalised
    update O (bf16, unscaled) and the sum of the squares of the scaled updates (scale · O), for the update
    RMS."""
    batches: dict[tuple, list[tuple[int, int]]] = {}
    for i, m in enumerate(matrices):
        for j, (start, end) in enumerate(m.pieces):
            batches.setdefault((end - start, m.cols, m.ns, m.adjust_lr), []).append((i, j))
    outs: list[dict[int, torch.Tensor]] = [{} for _ in matrices]
    device = wholes[0].device if wholes else torch.device("cpu")
    square_sum = torch.zeros((), dtype=torch.float32, device=device)
    for (rows, cols, (coefficients, steps, eps), adjust_lr), same_shape in batches.items():
        per_call = max(1, NS_BATCH_ELEMENTS // (rows * cols))  # a cap on the temporaries of one call
        for first in range(0, len(same_shape), per_call):
            members = same_shape[first:first + per_call]
            stacked = torch.stack([wholes[i][slice(*matrices[i].pieces[j])] for i, j in members])
            result = newton_schulz(stacked, coefficients, steps, eps)
            del stacked
            norms = torch.linalg.vector_norm(result, dim=(1, 2), dtype=torch.float32)
            square_sum += norms.square().sum() * update_scale(rows, cols, adjust_lr) ** 2
            for k, (i, j) in enumerate(members):
                outs[i][j] = result[k]
    # A stacked matrix's pieces back in row order (their batches ran in the order their shapes came).
    return [out[0] if len(out) == 1 else torch.cat([out[j] for j in range(len(out))]) for out in outs], square_sum


def orthogonalize_local(matrices: list[Matrix]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """This rank holds every row: orthogonalise them here, no collective."""
    wholes = []
    for m in matrices:
        wholes.append(torch.empty((m.rows, m.cols), dtype=torch.bfloat16, device=m.grad.device))
        m.write_update(wholes[-1])
    return orthogonalize_whole(matrices, wholes)


def orthogonalize_sharded(matrices: list[Matrix], shards: ShardGroup,
                          owners: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each matrix's U (this rank's rows) to its owner, Newton–Schulz there, and this rank's rows of every
    O back: two all_to_all_single over the shard group. Returns this rank's rows of each O (bf16) and this
    rank's part of the update's sum of squares (of the matrices it owns: add it up over the group)."""
    size, me = shards.size, shards.rank
    ranges = [row_ranges(m.rows, size) for m in matrices]
    by_owner = [[i for i, o in enumerate(owners) if o == r] for r in range(size)]
    mine = by_owner[me]
    device = matrices[0].grad.device

    def count(i: int, r: int) -> int:  # elements of matrix i that rank r holds
        start, end = ranges[i][r]
        return (end - start) * matrices[i].cols

    for i, m in enumerate(matrices):
        start, end = ranges[i][me]
        if tuple(m.grad.shape) != (end - start, m.cols):
            raise ValueError(f"a Muon matrix of {m.rows} rows holds {tuple(m.grad.shape)} on rank {me} of {size}, "
                             f"not the {end - start} rows of FSDP's row split")
    # Out: to each owner r, this rank's rows of r's matrices; in: from each rank s, its rows of mine.
    send_sizes = [sum(count(i, me) for i in by_owner[r]) for r in range(size)]
    recv_sizes = [sum(count(i, s) for i in mine) for s in range(size)]
    send = torch.empty(sum(send_sizes), dtype=torch.bfloat16, device=device)
    order = [i for r in range(size) for i in by_owner[r]]
    offset = 0
    for i in order:
        matrices[i].write_update(send[offset:offset + count(i, me)].view(-1, matrices[i].cols))
        offset += count(i, me)
    recv = torch.empty(sum(recv_sizes), dtype=torch.bfloat16, device=device)
    dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=shards.group)
    del send

    # Whole matrices from every rank's rows (the buffer holds rank 0's rows of all mine, then rank 1's, ...).
    parts: dict[int, list[torch.Tensor]] = {i: [] for i in mine}
    offset = 0
    for s in range(size):
        for i in mine:
            parts[i].append(recv[offset:offset + count(i, s)].view(-1, matrices[i].cols))
            offset += count(i, s)
    wholes = [torch.cat(parts[i]) for i in mine]
    del recv, parts
    outs, square_sum = orthogonalize_whole([matrices[i] for i in mine], wholes)
    del wholes

    # Back: to each rank r its rows of every O this rank owns; from each owner s, this rank's rows of s's.
    back = torch.cat([out[slice(*ranges[i][r])].reshape(-1) for r in range(size) for i, out in zip(mine, outs)]
                     or [torch.empty(0, dtype=torch.bfloat16, device=device)])
    del outs
    result = torch.empty(sum(send_sizes), dtype=torch.bfloat16, device=device)
    dist.all_to_all_single(result, back, send_sizes, recv_sizes, group=shards.group)
    local: dict[int, torch.Tensor] = {}
    offset = 0
    for i in order:
        local[i] = result[offset:offset + count(i, me)].view(-1, matrices[i].cols)
        offset += count(i, me)
    return [local[i] for i in range(len(matrices))], square_sum
