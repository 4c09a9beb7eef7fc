"""Epoch orders: which window a source reads at each of its positions, in O(1) memory.

Position k of a source of n windows is window perm_e(k mod n) of epoch e = k div n, where perm_e
is a permutation of range(n) keyed by (seed, e, salt). Two kinds:

- feistel (new runs): a keyed Feistel network on the smallest even number of bits that holds n,
  cycle-walked back into range(n) (an index that lands past n is encrypted again until it is
  below n; since the network is a bijection of its power-of-two domain, the walk is a bijection of
  range(n), and as that domain is under 4n a walk takes under 4 steps on average). Neighbouring
  positions land on unrelated windows.
- affine (runs started before the Feistel order): i -> (a*i + c) mod N, a coprime to N. It
  shuffles poorly (consecutive positions form an arithmetic progression mod N) and is kept only so
  that a checkpoint written with it resumes with the very same windows.

Everything is vectorised over numpy arrays of positions, and each key may be one per element, so
that a mixture permutes many blocks at once (mixture.py).
"""

from __future__ import annotations

import math

import numpy as np

AFFINE, FEISTEL = "affine", "feistel"
ORDERS = (AFFINE, FEISTEL)
ROUNDS = 6  # Luby-Rackoff needs 4 for a pseudo-random permutation; 2 more for small domains' sake

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_ROUND_SALTS = [np.uint64((r + 1) * 0x9E3779B97F4A7C15 % 2**64) for r in range(ROUNDS)]


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: a bijection of 64-bit words whose every output bit depends on every
    input bit (uint64 arithmetic wraps around, as intended). Always an array (numpy warns when a
    scalar wraps, never when an array does)."""
    x = np.array(x, dtype=np.uint64, ndmin=1)
    x = (x ^ (x >> _S30)) * _M1
    x = (x ^ (x >> _S27)) * _M2
    return x ^ (x >> _S31)


def derive_key(seed: int, *parts) -> np.ndarray:
    """A 64-bit key (an array, if a part is) from the seed and further integers, each absorbed through
    mix64 so that (seed, 1, 2) and (seed, 2, 1) give unrelated keys."""
    key = mix64(np.array([seed % 2**64], dtype=np.uint64) ^ _GOLDEN)
    for part in parts:
        word = np.array(part % 2**64 if isinstance(part, int) else part, ndmin=1).astype(np.uint64)
        key = mix64(key ^ mix64(word + _GOLDEN))
    return key


def feistel(i: np.ndarray, n: int, key) -> np.ndarray:
    """perm(i) for every i in range(n): a keyed bijection of range(n) (any n >= 1)."""
    i = np.asarray(i, dtype=np.uint64)
    if n == 1:
        return np.zeros_like(i)
    half = max(1, math.ceil((n - 1).bit_length() / 2))
    mask, shift = np.uint64((1 << half) - 1), np.uint64(half)
    key = np.broadcast_to(np.asarray(key, dtype=np.uint64), i.shape)
    round_keys = [mix64(key + salt) for salt in _ROUND_SALTS]

    def encrypt(x: np.ndarray, rows) -> np.ndarray:
        left, right = x >> shift, x & mask
        for rk in round_keys:
            left, right = right, left ^ (mix64(right ^ rk[rows]) & mask)
        return (left << shift) | right

    out = encrypt(i, slice(None))
    walk = np.flatnonzero(out >= n)
    while walk.size:  # cycle walking: encrypt again what fell past n (under 4 rounds on average)
        out[walk] = encrypt(out[walk], walk)
        walk = walk[out[walk] >= n]
    return out


def affine_map(n: int, seed: int, epoch: int, salt: int = 0) -> tuple[int, int]:
    """(a, c) of the affine order's epoch: drawn exactly as titanlike drew them before the Feistel
    order, so that those checkpoints resume with the same windows."""
    rng = np.random.default_rng([seed, epoch, salt] if salt else [seed, epoch])
    while True:
        a = int(rng.integers(1, max(2, n)))
        if math.gcd(a, n) == 1:
            break
    return a, int(rng.integers(0, n))


class EpochOrder:
    """Position k of one source of `n` windows -> its window, epoch after epoch (see the module's
    docstring). `salt` tells the sources of a mixture apart; `kind` is feistel or affine."""

    def __init__(self, n: int, seed: int, kind: str = FEISTEL, salt: int = 0):
        assert n >= 1 and kind in ORDERS, (n, kind)
        self.n, self.seed, self.kind, self.salt = n, seed, kind, salt
        self._affine: dict[int, tuple[int, int]] = {}

    def windows(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        epochs, index = np.divmod(positions, self.n)
        if self.kind == FEISTEL:
            keys = derive_key(self.seed, epochs, self.salt)
            return feistel(index, self.n, keys).astype(np.int64)
        out = []
        for epoch, i in zip(epochs.tolist(), index.tolist()):  # Python ints: a·i may pass 2^63
            if epoch not in self._affine:
                self._affine = {epoch: affine_map(self.n, self.seed, epoch, self.salt)}  # one epoch at a time
            a, c = self._affine[epoch]
            out.append((a * i + c) % self.n)
        return np.array(out, dtype=np.int64)

    def window(self, position: int) -> int:
        return int(self.windows(np.array([position]))[0])
