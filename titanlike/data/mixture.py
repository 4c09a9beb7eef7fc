"""Which source, and which of its windows, every global sample position reads: a pure function of
(seed, position), so that a mixture resumes exactly at any world size and any number of workers.

A run's sources are numbered 0..S-1; a phase (config/sources.py) is a mixture that applies from a global
position on. Within a phase, positions fall into blocks of B (1024, doubled until every source of
the phase has a slot). Each block gives source s the same number of slots, c_s, the largest-
remainder rounding of w_s·B (the c_s sum to B, and c_s/B is within 1/B of w_s), and the block's
positions are dealt out by a keyed permutation of range(B) (order.py's Feistel network, keyed by
the seed, the phase's first position and the block): position j of the block goes to the source
whose run of slots [C_s, C_s + c_s) holds perm(j). So the uses of a source before any position are
counted in O(B): c_s per whole block, and one dealt block for the rest. A source's k-th use, in
position order, is position k of its own epoch order (epoch k div N_s, a new permutation each
epoch): a small source repeats while a large one goes on, and a source that sits out a phase goes on
where it stopped. A phase of one source deals nothing: its k-th use is the phase's k-th position,
which makes a run on `data.path` read exactly the plain epoch order.
"""

from __future__ import annotations

import numpy as np

from titanlike.data.order import FEISTEL, EpochOrder, derive_key, feistel

BLOCK = 1024
MAX_BLOCK = 2**20  # config.sources.MIN_SHARE keeps every source of a phase above 1/MAX_BLOCK
_DEAL = 0x4D4958  # keys the dealing of slots apart from the sources' epoch orders


def block_counts(weights: list[float], block: int) -> list[int]:
    """Slots per source in a block of `block` positions: largest remainder of w·block (ties to the
    earlier source), summing to `block`."""
    total = sum(weights)
    exact = [w / total * block for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[: block - sum(counts)]:
        counts[i] += 1
    return counts


def block_size(weights: list[float]) -> int:
    block = BLOCK
    while min(block_counts(weights, block)) == 0 and block < MAX_BLOCK:
        block *= 2
    return block


class _Phase:
    def __init__(self, start: int, sources: list[int], weights: list[float], seed: int):
        self.start, self.sources, self.seed = start, np.array(sources, dtype=np.int64), seed
        self.block = block_size(weights)
        self.counts = np.array(block_counts(weights, self.block), dtype=np.int64)
        self.first_slot = np.concatenate([[0], np.cumsum(self.counts)[:-1]])  # C_s
        self._dealt: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Block b dealt out: each slot's source (index into self.sources) and its rank among that
        source's slots of the block, in position order. Kept for the few blocks in use."""
        if b not in self._dealt:
            dealt = feistel(np.arange(self.block), self.block, derive_key(self.seed, _DEAL, self.start, b))
            which = np.searchsorted(self.first_slot, dealt.astype(np.int64), side="right") - 1
            by_source = np.argsort(which, kind="stable")  # source 0's slots in position order, then 1's, ...
            rank = np.empty(self.block, dtype=np.int64)
            rank[by_source] = np.arange(self.block) - self.first_slot[which[by_source]]
            if len(self._dealt) >= 8:
                self._dealt.clear()
            self._dealt[b] = (which, rank)
        return self._dealt[b]

    def deal(self, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(index into self.sources, uses of that source within this phase before it) for positions
        `offsets` after the phase's start."""
        if len(self.sources) == 1:
            return np.zeros_like(offsets), offsets
        blocks, slots = np.divmod(offsets, self.block)
        which, within = np.empty_like(offsets), np.empty_like(offsets)
        for b in np.unique(blocks).tolist():
            rows = blocks == b
            block_which, rank = self._block(b)
            which[rows] = block_which[slots[rows]]
            within[rows] = b * self.counts[which[rows]] + rank[slots[rows]]
        return which, within

    def uses(self, length: int, n_sources: int) -> np.ndarray:
        """Uses of every run source over the phase's first `length` positions."""
        whole, part = divmod(length, self.block)
        out = np.zeros(n_sources, dtype=np.int64)
        out[self.sources] += whole * self.counts
        if part and len(self.sources) > 1:
            which, _ = self._block(whole)
            out[self.sources] += np.bincount(which[:part], minlength=len(self.sources))
        elif part:
            out[self.sources] += part
        return out


class MixturePlan:
    """Global sample position -> global window id (source s's windows are numbered from offsets[s],
    as loader.MixedWindows numbers them).

    `sizes`: windows per source. `phases`: (first global position, {source index: weight}) in
    order, the first from position 0. `salts` key each source's epoch orders (config.sources.Source.salt).
    """

    def __init__(self, sizes: list[int], phases: list[tuple[int, dict[int, float]]], seed: int,
                 salts: list[int], kind: str = FEISTEL, start_uses: list[int] | None = None):
        assert phases and phases[0][0] == 0 and all(a[0] < b[0] for a, b in zip(phases, phases[1:])), phases
        self.sizes = np.array(sizes, dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]])
        self.orders = [EpochOrder(n, seed, kind, salt) for n, salt in zip(sizes, salts)]
        self.phases = [_Phase(start, list(w), list(w.values()), seed) for start, w in phases]
        self.starts = np.array([p.start for p in self.phases], dtype=np.int64)
        # Uses of each source before each phase: a source goes on where it left off in an earlier phase.
        # `start_uses`: where each source's order begins (a later stage goes on from an earlier one's reading).
        self.before = [np.array(start_uses or [0] * len(sizes), dtype=np.int64)]
        for p, q in zip(self.phases, self.phases[1:]):
            self.before.append(self.before[-1] + p.uses(q.start - p.start, len(sizes)))

    @property
    def kind(self) -> str:
        return self.orders[0].kind

    @kind.setter
    def kind(self, kind: str) -> None:
        for order in self.orders:
            order.kind = kind

    def sources_and_uses(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For each position: its source, and how many times that source was read before it."""
        positions = np.asarray(positions, dtype=np.int64)
        source, use = np.empty_like(positions), np.empty_like(positions)
        phase_of = np.searchsorted(self.starts, positions, side="right") - 1
        for k in np.unique(phase_of).tolist():
            rows = phase_of == k
            phase = self.phases[k]
            which, within = phase.deal(positions[rows] - phase.start)
            source[rows] = phase.sources[which]
            use[rows] = self.before[k][source[rows]] + within
        return source, use

    def windows(self, positions: np.ndarray) -> np.ndarray:
        source, use = self.sources_and_uses(positions)
        out = np.empty_like(use)
        for s in np.unique(source).tolist():
            rows = source == s
            out[rows] = self.offsets[s] + self.orders[s].windows(use[rows])
        return out

    def uses_before(self, position: int) -> np.ndarray:
        """Windows read from each source over global positions [0, position): O(block)."""
        k = int(np.searchsorted(self.starts, position, side="right")) - 1
        return self.before[k] + self.phases[k].uses(position - self.phases[k].start, len(self.sizes))

    def phase_weights(self, position: int) -> np.ndarray:
        """Each source's share at `position` (0 for a source its phase leaves out)."""
        phase = self.phases[int(np.searchsorted(self.starts, position, side="right")) - 1]
        out = np.zeros(len(self.sizes))
        out[phase.sources] = phase.counts / phase.block
        return out
