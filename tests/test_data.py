"""Token shards, their checks, global-batch sampling and the stateful loader."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
import torch

from conftest import build_train_loader
from titanlike.data.loader import GlobalBatchSampler, TokenWindows, open_dataset, validation_batches
from titanlike.data.order import EpochOrder
from titanlike.data.shards import HEADER, MAGIC, DataError, Shard, find_shards, write_shard
from titanlike.data.tokenizer import ByteTokenizer


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "héllo, wörld ✓\n"
    (ids,) = tok.encode_batch([text])
    assert ids.max() < 256 and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(list(ids) + [tok.eos_id, tok.bos_id]) == text


@pytest.mark.parametrize("high,width", [(300, 2), (65535, 2), (65536, 4), (200_000, 4)])
def test_shard_round_trip(tmp_path, high, width):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, high, size=1001)
    tokens[7] = high  # the largest id is exactly `high`
    path = tmp_path / "s.bin"
    write_shard(path, tokens)
    raw = path.read_bytes()
    # The header, parsed independently of the reader.
    magic, version, w, count, max_id = struct.unpack("<8sIIQQ", raw[:32])
    assert (magic, version, w, count, max_id) == (b"TLSHARD\0", 1, width, 1001, high)
    assert len(raw) == 32 + width * 1001
    shard = Shard(path)
    assert shard.count == 1001 and shard.max_id == high
    assert shard.tokens.dtype == (np.uint16 if width == 2 else np.uint32)
    np.testing.assert_array_equal(np.asarray(shard.tokens, dtype=np.int64), tokens)
    assert not list(tmp_path.glob("*.tmp*"))  # the atomic write leaves no temporary file


def header(version=1, width=2, count=10, max_id=9, magic=MAGIC) -> bytes:
    return HEADER.pack(magic, version, width, count, max_id)


def test_bad_magic(tmp_path):
    path = tmp_path / "text.bin"
    path.write_bytes(b"hello world, this is not a shard at all" * 3)
    with pytest.raises(DataError, match=r"text\.bin is not a token shard \(bad magic\)"):
        Shard(path)
    short = tmp_path / "short.bin"
    short.write_bytes(b"TLS")
    with pytest.raises(DataError, match="bad magic"):
        Shard(short)


def test_bad_version(tmp_path):
    path = tmp_path / "v2.bin"
    path.write_bytes(header(version=2) + bytes(20))
    with pytest.raises(DataError, match="shard format version 2, this titanlike reads version 1"):
        Shard(path)


def test_bad_width(tmp_path):
    path = tmp_path / "w3.bin"
    path.write_bytes(header(width=3) + bytes(30))
    with pytest.raises(DataError, match="3 bytes per token"):
        Shard(path)


def test_truncated(tmp_path):
    path = tmp_path / "cut.bin"
    write_shard(path, np.arange(1000))
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(DataError, match=r"cut\.bin is truncated: the header promises 1000 tokens \(2032 bytes\), "
                                        r"the file has 2022 bytes"):
        Shard(path)


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="cannot read token shard"):
        Shard(tmp_path / "nope.bin")
    with pytest.raises(DataError, match="no such file or folder"):
        open_dataset(str(tmp_path / "nope.bin"), 8, 320, "data.path")


def test_token_id_beyond_vocab(tmp_path):
    path = tmp_path / "ids.bin"
    write_shard(path, np.array([5, 6, 319, 320, 7] * 50))
    with pytest.raises(DataError,
                       match=r"holds token id 320 but the model's vocabulary has 320 ids; set --model.vocab_size 321"):
        open_dataset(str(path), 8, 320, "data.path")
    assert len(open_dataset(str(path), 8, 321, "data.path")) == (250 - 1) // 8


def test_dataset_smaller_than_one_sample(tmp_path):
    path = tmp_path / "tiny.bin"
    write_shard(path, np.arange(16))  # 16 tokens: one window needs seq_len + 1 = 17
    with pytest.raises(DataError, match="holds 16 tokens, fewer than one sample of data.seq_len \\+ 1 = 17"):
        open_dataset(str(path), 16, 320, "data.path")
    assert len(open_dataset(str(path), 15, 320, "data.path")) == 1


def test_dataset_smaller_than_one_batch(tmp_path):
    path = tmp_path / "small.bin"
    write_shard(path, np.arange(8 * 5 + 1))  # exactly 5 windows of 8 + 1 tokens
    ds = open_dataset(str(path), 8, 320, "data.path")
    assert len(ds) == 5
    with pytest.raises(DataError, match="has 5 samples .* fewer than one global batch of 6"):
        build_train_loader(ds, 3, 6, 0, 1, 0, 0, False)
    build_train_loader(ds, 5, 5, 0, 1, 0, 0, False)


def test_empty_folder(tmp_path):
    (tmp_path / "notes.txt").write_text("no shards here")
    with pytest.raises(DataError, match=r"holds no \*\.bin token shards"):
        open_dataset(str(tmp_path), 8, 320, "data.path")



@pytest.mark.parametrize("where", ["file", "in a folder"])
def test_a_fifo_in_place_of_a_shard_is_refused_not_waited_on(tmp_path, where):
    """A FIFO (or any file that is not a regular one) would block the first read forever, in the
    preflight and in the trainer, holding the folder lock: one line naming it instead."""
    import threading

    write_shard(tmp_path / "a.bin", np.full(33, 2))
    fifo = tmp_path / "b.bin"
    os.mkfifo(fifo)
    path = str(fifo) if where == "file" else str(tmp_path)
    result: list = []

    def check():
        try:
            open_dataset(path, 8, 320, "data.path")
            result.append(None)
        except DataError as e:
            result.append(e)

    worker = threading.Thread(target=check, daemon=True)
    worker.start()
    worker.join(timeout=20)
    if worker.is_alive():  # blocked in open(): a writer releases it, and the test fails
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(timeout=5)
        pytest.fail(f"reading {fifo} blocked")
    assert isinstance(result[0], DataError)
    assert str(result[0]) == f"token shard {fifo} is not a regular file (a FIFO); make shards with titanlike-prepare"

def test_folder_of_shards(tmp_path):
    write_shard(tmp_path / "b.bin", np.full(33, 2))
    write_shard(tmp_path / "a.bin", np.full(17, 1))
    shards = find_shards(str(tmp_path))
    assert [s.path.rsplit("/", 1)[1] for s in shards] == ["a.bin", "b.bin"]
    ds = TokenWindows(shards, 8)
    assert len(ds) == 2 + 4  # windows never straddle two shards
    assert [int(ds[i][0]) for i in range(len(ds))] == [1, 1, 2, 2, 2, 2]
    assert all(ds[i].shape == (9,) for i in range(len(ds)))


def test_windows_are_shifted_targets(tmp_path):
    write_shard(tmp_path / "r.bin", np.arange(100))
    ds = TokenWindows(find_shards(str(tmp_path)), 10)
    assert len(ds) == 9
    assert ds[0].tolist() == list(range(0, 11))
    assert ds[3].tolist() == list(range(30, 41))  # input 30..39, targets 31..40


# ---- global-batch sampling --------------------------------------------------------------------------


def step_samples(n, local, global_batch, world, steps, seed=0):
    """{step: [per-rank list of window indices]} from each rank's sampler."""
    out = {s: [] for s in range(steps)}
    for rank in range(world):
        sampler = GlobalBatchSampler(EpochOrder(n, seed), local, global_batch, rank, world)
        it = iter(sampler)
        accum = global_batch // (local * world)
        for s in range(steps):
            windows = []
            for _ in range(accum):
                batch = next(it)
                assert len(batch) == local
                windows += batch
            out[s].append(windows)
    return out


def test_same_global_batch_whatever_the_world_size():
    n, steps = 1000, 30
    runs = {world: step_samples(n, 2, 8, world, steps) for world in (1, 2, 4)}
    for s in range(steps):
        sets = {world: sorted(w for rank in runs[world][s] for w in rank) for world in runs}
        assert sets[1] == sets[2] == sets[4], f"step {s}"
        assert len(set(sets[1])) == 8
        for world in (2, 4):  # ranks are disjoint within a step
            ranks = [set(r) for r in runs[world][s]]
            assert sum(map(len, ranks)) == len(set().union(*ranks)) == 8
    # Consecutive steps differ.
    assert sorted(runs[1][0][0]) != sorted(runs[1][1][0])


def test_permutation_covers_every_window_each_epoch():
    for n in (97, 100, 1024):
        sampler = GlobalBatchSampler(EpochOrder(n, 5), 4, 4, 0, 1)
        epoch0 = [sampler.window(p) for p in range(n)]
        epoch1 = [sampler.window(p) for p in range(n, 2 * n)]
        assert sorted(epoch0) == list(range(n)) and sorted(epoch1) == list(range(n))
        assert epoch0 != epoch1  # a new order each epoch
        assert epoch0 != list(range(n))  # shuffled
    # Through the iterator, with the global batch dividing the corpus: one epoch = n / B steps.
    it = iter(GlobalBatchSampler(EpochOrder(96, 1), 4, 8, 0, 1))
    seen = [w for _ in range(96 // 4) for w in next(it)]
    assert sorted(seen) == list(range(96))


def test_seed_changes_the_order():
    a = GlobalBatchSampler(EpochOrder(500, 0), 4, 4, 0, 1)
    b = GlobalBatchSampler(EpochOrder(500, 1), 4, 4, 0, 1)
    assert [a.window(p) for p in range(50)] != [b.window(p) for p in range(50)]


def test_start_step_skips_ahead():
    full = iter(GlobalBatchSampler(EpochOrder(300, 0), 2, 4, 1, 2))
    batches = [next(full) for _ in range(10)]
    resumed = iter(GlobalBatchSampler(EpochOrder(300, 0), 2, 4, 1, 2, start_step=6))
    assert [next(resumed) for _ in range(4)] == batches[6:]


def test_validation_batches_are_fixed_and_split(tmp_path):
    write_shard(tmp_path / "v.bin", np.arange(8 * 20 + 1))
    ds = open_dataset(str(tmp_path / "v.bin"), 8, 1000, "data.val_path")
    one = list(validation_batches(ds, 2, 0, 1, 3))
    assert len(one) == 3 and all(torch.equal(a, b) for a, b in zip(one, validation_batches(ds, 2, 0, 1, 3)))
    assert [int(b[i, 0]) for b in one for i in range(2)] == [8 * w for w in range(6)]  # the leading windows
    r0, r1 = list(validation_batches(ds, 2, 0, 2, 3)), list(validation_batches(ds, 2, 1, 2, 3))
    starts0 = {int(b[i, 0]) for b in r0 for i in range(2)}
    starts1 = {int(b[i, 0]) for b in r1 for i in range(2)}
    assert not starts0 & starts1


# ---- the stateful loader --------------------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_seek_mid_epoch(tmp_path, num_workers):
    """The data position is a number (global batches read): a loader that seeks to it continues with
    exactly the batches an uninterrupted one reads next, whatever its number of workers."""
    write_shard(tmp_path / "d.bin", np.arange(20 * 8 + 1) % 300)
    ds = open_dataset(str(tmp_path / "d.bin"), 8, 320, "data.path")
    assert len(ds) == 20

    def loader(workers):
        return build_train_loader(ds, 2, 4, 1, 2, seed=7, num_workers=workers, pin_memory=False)

    reference = loader(0)
    head = [next(reference) for _ in range(7)]  # mid-epoch: 7 steps of 4 samples, epoch = 5 steps
    tail = [next(reference) for _ in range(9)]  # crosses the next epoch boundary too
    resumed = loader(num_workers)
    resumed.seek(7)
    again = [next(resumed) for _ in range(9)]
    assert all(torch.equal(a, b) for a, b in zip(tail, again))
    # And the resumed batches are not just a restart from the beginning.
    assert not all(torch.equal(a, b) for a, b in zip(head, again[:7]))
    # The batches are what the sampler prescribes (rank 1 of 2 of the global batch of 4).
    sampler = iter(GlobalBatchSampler(EpochOrder(20, 7), 2, 4, 1, 2))
    expected = [next(sampler) for _ in range(16)]
    for batch, windows in zip(head + tail, expected):
        assert batch.shape == (2, 9)
        assert batch[:, 0].tolist() == [ds[w][0].item() for w in windows]


def test_validation_set_is_the_same_for_any_world_size(tmp_path):
    from titanlike.data.loader import TokenWindows, validation_batches

    path = tmp_path / "v.bin"
    write_shard(path, np.arange(5000) % 300)
    ds = TokenWindows([Shard(path)], 16)
    steps, local, global_batch = 2, 3, 12

    def seen(world):
        accum = global_batch // (local * world)
        rows = [b for r in range(world) for b in validation_batches(ds, local, r, world, steps * accum)]
        return sorted(tuple(row.tolist()) for batch in rows for row in batch)

    assert seen(1) == seen(2) == seen(4)
    assert len(seen(1)) == steps * global_batch


# ---- shards that change or lie -------------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_shard_truncated_during_training_is_one_line_naming_it(tmp_path, num_workers):
    """A shard cut short after it was opened (in place, as a failed copy does): a memory map would
    die with SIGBUS; the loader says which file and what happened."""
    from titanlike.data.shards import ShardFault

    path = tmp_path / "d.bin"
    write_shard(path, np.arange(20 * 8 + 1) % 300)
    ds = open_dataset(str(path), 8, 320, "data.path")
    loader = build_train_loader(ds, 2, 4, 0, 1, seed=7, num_workers=num_workers, pin_memory=False)
    next(loader)
    os.truncate(path, 32 + 2 * 10)  # the header and ten tokens are left
    loader.seek(1)  # fresh workers, which read the file as it is now
    with pytest.raises(ShardFault) as e:
        for _ in range(5):
            next(loader)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"{path} became shorter while training read it: tokens ")


@pytest.mark.parametrize("num_workers", [0, 1])  # a worker's fault reaches the trainer as the same line
def test_a_header_that_understates_the_largest_id_is_caught_in_the_loader(tmp_path, num_workers):
    from titanlike.data.shards import HEADER, MAGIC, ShardFault

    path = tmp_path / "d.bin"
    tokens = (np.arange(20 * 8 + 1) % 300).astype(np.uint16)
    tokens[77] = 5000  # past the vocabulary of 320
    with open(path, "wb") as f:  # a header that claims the largest id is 299
        f.write(HEADER.pack(MAGIC, 1, 2, tokens.size, 299))
        f.write(tokens.tobytes())
    ds = open_dataset(str(path), 8, 320, "data.path")  # the header passes
    loader = build_train_loader(ds, 2, 4, 0, 1, seed=7, num_workers=num_workers, pin_memory=False)
    with pytest.raises(ShardFault) as e:
        for _ in range(10):  # 5 steps make an epoch: every window is read
            next(loader)
    assert str(e.value) == (f"{path} holds token id 5000 (at token 77), but the model's vocabulary has 320 ids "
                            f"(its header claims the largest id is 299); set --model.vocab_size 5001 or more, "
                            f"or re-tokenize")
