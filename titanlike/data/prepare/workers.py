"""titanlike-prepare's workers: a chunk of input in, its documents' tokens out.

Each worker is one process on one core, with its own tokenizer. `tokenized()` hands them the chunks
the readers planned and yields the results in input order, so the shards are the same bytes for any
number of workers.
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing
import os
import signal
from dataclasses import dataclass

import numpy as np

from titanlike.data.prepare.readers import Chunk, read_chunk
from titanlike.data.shards import token_dtype

_tokenizer = None
# Signals that stop titanlike-prepare (besides Ctrl-C): the main process cleans up on them (cli.py).
STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n))


# What a worker starts with held (blocked): Ctrl-C and the stop signals; where signals can be held (not Windows).
_HELD = (signal.SIGINT, *STOP_SIGNALS)
_CAN_HOLD = hasattr(signal, "pthread_sigmask")


@contextlib.contextmanager
def stop_signals_held():
    """Ctrl-C and the stop signals held in this thread while it starts workers, so that each worker starts
    with them held and takes them only once its own handling is set (`_init_worker`).

    Why: a worker forked without them held starts with the main process's handlers (cli.py's, which raise).
    A stop that reaches it then, such as the pool's own SIGTERM when prepare stops just after starting the
    pool, runs that handler, and multiprocessing's start-up code can drop the exception (its after-fork
    hooks log and ignore exceptions). Once in CI a worker was left so: alive, its SIGTERM back at the
    default, waiting for a task, and `pool.terminate()` waiting on it for ever. Held, the signal waits until
    the worker's own default is in place, and ends it. The main thread takes any that arrive meanwhile as
    soon as the pool has started."""
    if not _CAN_HOLD:
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _init_worker(spec: str, bos: str, eos: str, pool_worker: bool = True) -> None:
    global _tokenizer
    if pool_worker:  # Ctrl-C is the main process's to handle (it stops the pool): no traceback per worker
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for sig in STOP_SIGNALS:  # the main process's handlers (cli.py) are not a worker's: the pool ends it
            signal.signal(sig, signal.SIG_DFL)
        if _CAN_HOLD:  # held since the fork (stop_signals_held): taken from here on
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELD)
    # Each worker is one core: the tokenizers package's own thread pool would only oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from titanlike.data.tokenizer import load_tokenizer

    _tokenizer = load_tokenizer(spec, bos, eos)


def tokenize_chunk(chunk: Chunk) -> tuple[np.ndarray, np.ndarray, ChunkCounts]:
    """(all tokens of the chunk's non-empty documents with their BOS/EOS, each document's length, counts)."""
    tok = _tokenizer
    assert tok is not None, "tokenize_chunk runs in a worker set up by _init_worker"
    read = read_chunk(chunk)
    docs = [d for d in read if d]  # an empty document would be a lone BOS/EOS pair: dropped, and counted
    counts = ChunkCounts(chunk.input_bytes, sum(len(d.encode("utf-8")) for d in docs), len(read) - len(docs),
                         chunk.source, chunk.text_field if chunk.kind != "text" else "")
    ids = tok.encode_batch(docs) if docs else []
    head = [tok.bos_id] if tok.bos_id is not None else []
    dtype = token_dtype(tok.vocab_size)
    lengths = np.fromiter((len(x) + len(head) + 1 for x in ids), dtype=np.int64, count=len(ids))
    out = np.empty(int(lengths.sum()), dtype=dtype)
    pos = 0
    for x in ids:
        if head:
            out[pos] = head[0]
            pos += 1
        out[pos : pos + len(x)] = x
        pos += len(x)
        out[pos] = tok.eos_id
        pos += 1
    return out, lengths, counts


@dataclass(frozen=True)
class ChunkCounts:
    input_bytes: int  # on disk (compressed, for compressed inputs): what the progress bar's ETA runs on
    text_bytes: int  # UTF-8 text of the documents kept: what the summary reports
    empty_documents: int  # dropped
    source: int = 0  # the INPUT argument the chunk came from
    text_field: str = ""  # the field (column) its text came from ("" for text files)


def tokenized(chunks, workers: int, spec: str, bos: str, eos: str):
    """Tokenized chunks in input order; with several workers, computed in parallel."""
    if workers == 1:
        _init_worker(spec, bos, eos, pool_worker=False)
        yield from map(tokenize_chunk, chunks)
        return
    # fork where there is one: the workers start at once, with the parsed modules already imported.
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    with stop_signals_held():
        pool = ctx.Pool(workers, initializer=_init_worker, initargs=(spec, bos, eos))
    try:
        # In input order, with at most a few chunks in flight per worker: enough to keep every core busy,
        # few enough that a large compressed file is never decompressed into memory all at once. The
        # chunks are planned here, in the main thread, so a bad input raises here too.
        in_flight: collections.deque = collections.deque()
        for chunk in chunks:
            in_flight.append(pool.apply_async(tokenize_chunk, (chunk,)))
            if len(in_flight) >= 3 * workers:
                yield in_flight.popleft().get()
        while in_flight:
            yield in_flight.popleft().get()
    finally:
        pool.terminate()
        pool.join()
