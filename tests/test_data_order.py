"""Epoch orders (titanlike/data/order.py): the keyed Feistel permutation, and the affine order that
checkpoints written before it resume with."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest

from conftest import build_train_loader
from titanlike.data.loader import GlobalBatchSampler, open_dataset
from titanlike.data.order import AFFINE, FEISTEL, EpochOrder, derive_key, feistel
from titanlike.data.shards import DataError, Shard, write_shard

RANDOM_N = [int(n) for n in np.random.default_rng(1).integers(4, 50_000, size=8)]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 13, 97, 65537, 4, 16, 1024, 4096, 2**16, *RANDOM_N])
def test_feistel_is_a_bijection_of_range_n(n):
    for seed, epoch in ((0, 0), (1, 0), (0, 7), (2**63 - 1, 12345)):
        perm = EpochOrder(n, seed).windows(np.arange(epoch * n, (epoch + 1) * n))
        assert perm.min() >= 0 and perm.max() < n
        assert np.array_equal(np.sort(perm), np.arange(n)), (n, seed, epoch)


def test_neighbours_are_uncorrelated_and_no_progression():
    n = 100_003  # a prime: the affine order's neighbours differ by the same a every time
    w = EpochOrder(n, seed=3).windows(np.arange(n))
    assert abs(np.corrcoef(w[:-1], w[1:])[0, 1]) < 0.02
    steps = np.diff(w) % n
    assert np.unique(steps).size > n // 2  # an arithmetic progression would have one step size
    # Nearby positions land anywhere: their windows are spread like random ones (mean distance n/3).
    assert abs(np.abs(np.diff(w)).mean() / n - 1 / 3) < 0.01
    old = EpochOrder(n, seed=3, kind=AFFINE).windows(np.arange(n))
    assert np.unique(np.diff(old) % n).size == 1  # what the affine order did


def test_every_epoch_and_seed_is_another_order():
    n = 1000
    order = EpochOrder(n, seed=0)
    epochs = [order.windows(np.arange(e * n, (e + 1) * n)) for e in range(3)]
    assert not np.array_equal(epochs[0], epochs[1]) and not np.array_equal(epochs[1], epochs[2])
    assert not np.array_equal(epochs[0], np.arange(n))
    assert not np.array_equal(epochs[0], EpochOrder(n, seed=1).windows(np.arange(n)))
    assert not np.array_equal(epochs[0], EpochOrder(n, seed=0, salt=5).windows(np.arange(n)))


def test_a_key_per_element_is_the_same_as_one_key_each():
    keys = derive_key(9, np.array([0, 1, 2, 3]), 4)
    together = feistel(np.array([5, 5, 6, 6]), 37, keys)
    alone = [int(feistel(np.array([i]), 37, derive_key(9, e, 4))[0]) for i, e in ((5, 0), (5, 1), (6, 2), (6, 3))]
    assert together.tolist() == alone


def test_the_affine_order_is_the_one_titanlike_used_before():
    """The affine map as titanlike drew it before the Feistel order: (a, c) from default_rng([seed, epoch]),
    a redrawn until coprime to n. A checkpoint of such a run resumes with these windows."""
    def before(n, seed, p):
        epoch, i = divmod(p, n)
        rng = np.random.default_rng([seed, epoch])
        while True:
            a = int(rng.integers(1, max(2, n)))
            if math.gcd(a, n) == 1:
                break
        return (a * i + int(rng.integers(0, n))) % n

    for n in (1, 2, 97, 1000):
        order = EpochOrder(n, seed=4, kind=AFFINE)
        assert order.windows(np.arange(3 * n)).tolist() == [before(n, 4, p) for p in range(3 * n)]


def test_order_is_sharding_independent():
    """The windows of a step are the same at any world size (and each rank's are disjoint)."""
    def step_windows(world):
        out = []
        for rank in range(world):
            it = iter(GlobalBatchSampler(EpochOrder(777, 5), 2, 8, rank, world))
            out += [w for _ in range(8 // (2 * world)) for w in next(it)]
        return sorted(out)

    assert step_windows(1) == step_windows(2) == step_windows(4)


def test_loader_state_names_its_order_and_an_old_state_means_affine(tmp_path):
    write_shard(tmp_path / "d.bin", np.arange(40 * 8 + 1) % 300)
    ds = open_dataset(str(tmp_path / "d.bin"), 8, 320, "data.path")

    def loader():
        return build_train_loader(ds, 2, 4, 0, 1, seed=3, num_workers=0, pin_memory=False)

    fresh = loader()
    marks = hashlib.blake2b(Shard(tmp_path / "d.bin").fingerprint.encode(), digest_size=16).hexdigest()
    data = {str(tmp_path): {"shards": 1, "tokens": 40 * 8 + 1, "fingerprint": marks}}  # what the windows are read from
    assert fresh.state_dict() == {"batches_read": 0, "order": FEISTEL, "data": data}
    old = loader()
    old.load_state_dict({"batches_read": 2})  # a checkpoint from before the Feistel order
    assert old.state_dict() == {"batches_read": 2, "order": AFFINE, "data": data}
    expected = EpochOrder(len(ds), 3, kind=AFFINE).windows(np.arange(8, 10)).tolist()
    assert next(old)[:, 0].tolist() == [ds[w][0].item() for w in expected]
    with pytest.raises(DataError, match="data order 'zigzag' is unknown"):
        loader().load_state_dict({"batches_read": 2, "order": "zigzag"})
