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
from titanlike.errors import STOPS as STOP_SIGNALS  # what stops titanlike-prepare besides Ctrl-C (cli.py cleans up)
from titanlike.errors import UserError
from titanlike.process import lifeline

_tokenizer = None


# What a worker starts with held (blocked): Ctrl-C and the stop signals; where signals can be held (not Windows).
_HELD = (signal.SIGINT, *STOP_SIGNALS)
_CAN_HOLD = hasattr(signal, "pthread_sigmask")


@contextlib.contextmanager
def stop_signals_held():
    """Ctrl-C and the stop signals held in this thread while it starts workers, so that each worker starts
    with them held and takes them only once its own handling is set (`_init_worker`).

    Why: a worker forked without them held starts with the main process's handlers (cli.py's, which raise).
    A stop that reaches it then, such as a SIGTERM to the whole process group just as prepare starts its
    workers, runs that handler, and multiprocessing's start-up code can drop the exception (its after-fork
    hooks log and ignore exceptions). Once in CI a worker was left so: alive, its SIGTERM back at the
    default, waiting for a task, and the shutdown of the multiprocessing.Pool used then waiting on it for
    ever. Held, the signal waits until the worker's own default is in place, and ends it. The main thread
    takes any that arrive meanwhile as soon as the workers have started."""
    with lifeline.signals_held(_HELD):
        yield


def _init_worker(spec: str, bos: str, eos: str, own_process: bool = True) -> None:
    global _tokenizer
    if own_process:  # Ctrl-C is the main process's to handle (it stops the workers): no traceback per worker
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for sig in STOP_SIGNALS:  # the main process's handlers (cli.py) are not a worker's: the main process ends it
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
        _init_worker(spec, bos, eos, own_process=False)
        yield from map(tokenize_chunk, chunks)
        return
    # fork where there is one: the workers start at once, with the parsed modules already imported.
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    crew: list[_Worker] = []
    try:
        with stop_signals_held():
            crew.extend(_Worker(ctx, spec, bos, eos) for _ in range(workers))
        # In input order: chunk k goes to worker k mod n, which answers its chunks in the order it got them.
        # At most a few chunks in flight per worker: enough to keep every core busy, few enough that a large
        # compressed file is never decompressed into memory all at once. The chunks are planned here, in the
        # main thread, so a bad input raises here too.
        in_flight: collections.deque = collections.deque()
        for k, chunk in enumerate(chunks):
            crew[k % workers].give(chunk)
            in_flight.append(crew[k % workers])
            if len(in_flight) >= 3 * workers:
                yield in_flight.popleft().take()
        while in_flight:
            yield in_flight.popleft().take()
    finally:
        for worker in crew:
            worker.stop()


class _Worker:
    """One tokenizing process: chunks go in through a queue of its own (whose feeder thread writes them, so
    handing one over never blocks the main thread), results come back through a pipe only it writes to. No
    lock is shared by two processes, so stopping a worker at any moment cannot leave another process
    waiting. (multiprocessing.Pool's workers share one lock to answer: a worker ended while it held it, as
    the pool's own terminate() may end one, left that terminate() waiting for ever.)"""

    def __init__(self, ctx, spec: str, bos: str, eos: str) -> None:
        self.tasks = ctx.Queue()
        self.results, answers = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=_work, args=(self.tasks, answers, spec, bos, eos, os.getpid()), daemon=True)
        self.process.start()
        answers.close()  # the worker's end: once it is gone, a read here says so instead of waiting

    def give(self, chunk: Chunk) -> None:
        self.tasks.put(chunk)

    def take(self) -> tuple[np.ndarray, np.ndarray, ChunkCounts]:
        """The result of the oldest chunk given; its error raised here."""
        try:
            ok, value = self.results.recv()
        except EOFError:
            self.process.join(5)
            raise UserError(f"a tokenizing worker ended before it finished (exit code {self.process.exitcode}); "
                            f"nothing was written") from None
        if not ok:
            raise value
        return value

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.tasks.cancel_join_thread()  # chunks still queued for a worker that is gone are dropped
        self.tasks.close()
        self.results.close()


def _work(tasks, answers, spec: str, bos: str, eos: str, parent: int) -> None:
    """A worker's life: tokenize the chunks it is given, in order, until it is stopped."""
    lifeline.end_with(parent)  # killed with titanlike-prepare, even by a SIGKILL of it: a worker saves nothing
    _init_worker(spec, bos, eos)
    while True:
        chunk = tasks.get()
        try:
            answer: tuple = (True, tokenize_chunk(chunk))
        except Exception as e:  # a bad input (InputError) or a reader's own error: the main process raises it
            answer = (False, e)
        try:
            answers.send(answer)
        except Exception as e:  # an error that does not pickle: its words go instead
            answers.send((False, RuntimeError(f"{type(e).__name__}: {e}" if answer[0] else
                                              f"{type(answer[1]).__name__}: {answer[1]}")))
