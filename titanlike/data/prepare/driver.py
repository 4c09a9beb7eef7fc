"""prepare(): inputs in, a dataset folder out.

The readers plan the inputs into chunks, the workers tokenize them, and here each document goes to
its split (val, drawn at random with the probability --val-fraction: Holdout) and into that split's
shards; dataset.json, val_documents.json (which documents went to val) and a copy of the tokenizer go
beside them. OUT is claimed first (fs.OutputClaim: one run at a time writes it); everything is
written into OUT.tmp-<pid>/ and moved into OUT only once complete (output.py), so Ctrl-C or an
error leaves nothing behind.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import threading
import time

import numpy as np

from titanlike import fs
from titanlike.config.dataset import DATASET_FORMAT, DATASET_JSON
from titanlike.config.schema import MAX_WORKERS_PER_CORE, available_cores
from titanlike.data.prepare.output import (
    VAL_DOCUMENTS,
    check_output,
    publish,
    remove_stale_work,
    remove_work,
    start_work,
    work_folder,
)
from titanlike.data.prepare.readers import expand, plan
from titanlike.data.prepare.workers import STOP_SIGNALS, tokenized
from titanlike.data.shards import ShardWriter, token_dtype
from titanlike.errors import UserError


class Progress:
    """A progress bar on a terminal (documents, tokens, tokens/s, ETA from input bytes); silent otherwise."""

    def __init__(self, total_bytes: int, enabled: bool):
        self.total, self.enabled = max(1, total_bytes), enabled
        self.start = self.last = time.perf_counter()
        self.bytes = self.docs = self.tokens = 0

    def update(self, nbytes: int, docs: int, tokens: int) -> None:
        self.bytes += nbytes
        self.docs += docs
        self.tokens += tokens
        now = time.perf_counter()
        if self.enabled and now - self.last > 0.2:
            self.last = now
            frac = min(1.0, self.bytes / self.total)
            elapsed = now - self.start
            eta = elapsed * (1 - frac) / frac if frac > 0 else 0
            bar = "#" * int(frac * 24)
            sys.stderr.write(f"\r[{bar:<24}] {frac:5.1%} | {self.docs:,} docs | {self.tokens:,} tokens | "
                             f"{self.tokens / max(elapsed, 1e-9):,.0f} tok/s | ETA {eta:,.0f}s ")
            sys.stderr.flush()

    def done(self) -> None:
        if self.enabled:
            sys.stderr.write("\r" + " " * 100 + "\r")
            sys.stderr.flush()


def prepare(out: str, inputs: list[str], tokenizer: str = "", workers: int = 0, text_field: str | list[str] = "",
            val_fraction: float = 0.01, shard_tokens: int = 100_000_000, overwrite: bool = False,
            bos_token: str = "", eos_token: str = "", progress: bool = False) -> dict:
    """Tokenize `inputs` into OUT/train, OUT/val and OUT/dataset.json; returns the dataset.json record.
    `text_field`: one for all inputs or one per input; "" = the first of readers.TEXT_FIELDS a file has."""
    from titanlike.data.tokenizer import load_tokenizer

    out = os.path.normpath(out)
    if not 0 <= val_fraction < 1:
        raise UserError(f"--val-fraction {val_fraction} must be in [0, 1)")
    if shard_tokens < 1:
        raise UserError(f"--shard-tokens {shard_tokens} must be >= 1")
    cores = available_cores()
    if workers > MAX_WORKERS_PER_CORE * cores:  # as data.num_workers: each one is a process
        raise UserError(f"--workers {workers} is more than {MAX_WORKERS_PER_CORE} per CPU core ({cores} cores here): "
                        f"use at most {MAX_WORKERS_PER_CORE * cores} (0 = one per core)")
    given = text_field if isinstance(text_field, list) else [text_field]
    if len(given) not in (1, len(inputs)):
        raise UserError(f"--text-field is given {len(given)} times for {len(inputs)} inputs: give it once (for "
                        f"every input) or once per input, in their order")
    per_input = [expand([i]) for i in inputs]
    files = [f for group in per_input for f in group]
    file_source = [n for n, group in enumerate(per_input) for _ in group]
    file_field = [given[n] if len(given) > 1 else given[0] for n in file_source]
    # OUT is claimed before anything is checked or written: a second run into it stops here, and while this
    # one holds the claim no other run is at work on OUT, so what is checked now still holds at the end.
    with fs.OutputClaim(out, "titanlike-prepare", "the dataset"):
        check_output(out, files, overwrite)
        tok = load_tokenizer(tokenizer, bos_token, eos_token)  # a bad tokenizer.json stops here, before any work
        removed, kept = remove_stale_work(out)
        for stale in removed:
            print(f"removed {stale}: an earlier titanlike-prepare into {out} was killed before it finished",
                  file=sys.stderr)
        for stale in kept:
            print(f"note: kept {stale}, left by a titanlike-prepare into {out} that was killed: it holds files "
                  f"titanlike-prepare does not write", file=sys.stderr)
        try:
            tmp = start_work(out)
        except OSError as e:
            raise UserError(f"cannot write the dataset: {fs.describe_os_error(e, work_folder(out))}") from None
        try:
            # Every core this process may use (a container or taskset may allow fewer than the machine has).
            info = _write(tmp, files, file_source, file_field, inputs, tok, workers or cores, val_fraction,
                          shard_tokens, progress)
            _publish_uninterrupted(tmp, out, overwrite)
        except OSError as e:  # a read-only or full disk, a folder we may not write: one line, nothing left behind
            remove_work(tmp)
            raise UserError(f"cannot write the dataset: {fs.describe_os_error(e, tmp)}") from None
        except BaseException:
            remove_work(tmp)
            raise
    return info


def _write(tmp: str, files: list[str], file_source: list[int], file_field: list[str], inputs: list[str], tok,
           workers: int, val_fraction: float, shard_tokens: int, progress: bool) -> dict:
    """Tokenize the inputs into the work folder `tmp`: the shards, tokenizer.json, val_documents.json and
    dataset.json; returns the dataset.json record, with the seconds it took."""
    total_bytes = sum(os.path.getsize(f) for f in files)
    holdout = Holdout(val_fraction, len(inputs))
    dtype = token_dtype(tok.vocab_size)
    splits = {"train": ShardWriter(os.path.join(tmp, "train"), shard_tokens, dtype),
              "val": ShardWriter(os.path.join(tmp, "val"), shard_tokens, dtype)}
    bar = Progress(total_bytes, progress)
    start = time.perf_counter()
    n_docs = text_bytes = empty = 0
    chunks = plan(files, file_field, file_source)
    spec = getattr(tok, "path", "byte")
    sources: list[dict] = [{"input": os.path.abspath(i), "documents": 0, "tokens": 0, "text_fields": set()}
                           for i in inputs]
    for tokens, lengths, counts in tokenized(chunks, workers, spec, tok.bos_token or "", tok.eos_token or ""):
        _split(tokens, lengths, holdout.held(lengths, counts.source), splits)
        n_docs += lengths.size
        text_bytes += counts.text_bytes
        empty += counts.empty_documents
        bar.update(counts.input_bytes, int(lengths.size), int(tokens.size))
        source = sources[counts.source]  # what each INPUT gave: a mixture's weights are set from these
        source["documents"] += int(lengths.size)
        source["tokens"] += int(tokens.size)
        source["text_fields"] |= {counts.text_field} - {""}
    for w in splits.values():
        w.finish()
    bar.done()
    seconds = time.perf_counter() - start
    if splits["train"].total == 0:
        what = ("no documents (every input was empty)" if n_docs == 0 else
                f"{n_docs} document(s), all held out for validation (--val-fraction {val_fraction:g})")
        raise UserError(f"{', '.join(inputs)}: {what}; nothing to train on")
    info = {
        "format": DATASET_FORMAT,
        "tokenizer": {"kind": tok.kind, "file": "tokenizer.json", "source": getattr(tok, "path", "byte"),
                      "bos_token": tok.bos_token, "eos_token": tok.eos_token},
        "vocab_size": tok.vocab_size,
        "bos_id": tok.bos_id,
        "eos_id": tok.eos_id,
        "token_bytes": np.dtype(dtype).itemsize,
        "documents": n_docs,
        "empty_documents_dropped": empty,
        "splits": {name: {"tokens": w.total, "documents": w.documents, "shards": w.index}
                   for name, w in splits.items()},
        # Each shard's tokens and fingerprint (data/shards.py): a run refuses a shard that is not the one written here.
        "shards": {f"{name}/{file}": {"tokens": count, "fingerprint": mark}
                   for name, w in splits.items() for file, count, mark in w.written},
        "val_fraction": val_fraction,
        "val_documents": VAL_DOCUMENTS,
        "inputs": [os.path.abspath(i) for i in inputs],
        "sources": [{**s, "text_fields": sorted(s["text_fields"])} for s in sources],
        "files": len(files),
        "input_bytes": total_bytes,
        "text_bytes": text_bytes,
        "text_field": ", ".join(sorted({f for s in sources for f in s["text_fields"]})),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    fs.write_text(os.path.join(tmp, "tokenizer.json"), tok.to_json())
    # Which documents went to val, per INPUT: their places among the documents it gave (0 = its first).
    fs.write_json(os.path.join(tmp, VAL_DOCUMENTS), {"inputs": [
        {"input": os.path.abspath(i), "val_documents": held} for i, held in zip(inputs, holdout.val_documents)]})
    fs.write_json(os.path.join(tmp, DATASET_JSON), info, indent=1)
    return {**info, "seconds": seconds}


def _publish_uninterrupted(tmp: str, out: str, overwrite: bool) -> None:
    """publish() with Ctrl-C and the stop signals ignored: over an earlier output it moves that output's
    files into `tmp` before the new ones into place, and a stop in between would remove them with `tmp`.
    It takes a few renames; a stop that comes then is answered by finishing."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread sets handlers
        publish(tmp, out, overwrite)
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, *STOP_SIGNALS)}
    try:
        publish(tmp, out, overwrite)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class Holdout:
    """Which documents go to val: documents drawn at random, each with the probability --val-fraction,
    whatever its length (a hash of its place in the input, so the same for any --workers and any
    machine); a drawn document is held out only while val, with it, keeps within twice the fraction of
    the tokens so far, so that one document far longer than the rest stays in train; while val is empty,
    any document that keeps so is held (a handful of documents still give a val). (Holding out the
    first document that fit kept val to the fraction but drew short documents: man pages held out
    averaged 530 tokens against 3,215 in train.) `held` says, per INPUT, which of its documents (their
    places among the documents it gave, from 0) went to val."""

    SALT = 0x9E3779B97F4A7C15  # any fixed odd number: the draw is the same for every prepare of the same inputs

    def __init__(self, fraction: float, sources: int):
        self.fraction, self.total, self.val, self.seen = fraction, 0, 0, 0
        self.per_source = [0] * sources  # documents each INPUT gave so far
        self.val_documents: list[list[int]] = [[] for _ in range(sources)]

    def draw(self, first: int, count: int) -> np.ndarray:
        """A number in [0, 1) for each of `count` documents from the `first`: splitmix64 of its place."""
        x = (np.arange(first, first + count, dtype=np.uint64) + np.uint64(1)) * np.uint64(self.SALT)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
        return (x >> np.uint64(11)).astype(np.float64) / float(2**53)

    def held(self, lengths: np.ndarray, source: int = 0) -> list[int]:
        """The documents of this chunk (indices into `lengths`), all from INPUT `source`, that go to val."""
        if not self.fraction:
            drawn = np.zeros(lengths.size, dtype=bool)
        else:
            with np.errstate(over="ignore"):  # the hash wraps around 2^64 on purpose
                drawn = self.draw(self.seen, lengths.size) < self.fraction
        ends = self.total + np.cumsum(lengths, dtype=np.int64)
        held: list[int] = []

        def consider(i: int) -> None:
            if self.val + int(lengths[i]) <= 2 * self.fraction * int(ends[i]):
                held.append(i)
                self.val += int(lengths[i])
                self.val_documents[source].append(self.per_source[source] + i)

        first = 0
        while self.fraction and not self.val and first < lengths.size:  # val empty: every document in turn
            consider(first)
            first += 1
        for i in np.flatnonzero(drawn[first:]) + first:
            consider(int(i))
        self.total = int(ends[-1]) if lengths.size else self.total
        self.seen += lengths.size
        self.per_source[source] += lengths.size
        return held


def _split(tokens: np.ndarray, lengths: np.ndarray, held: list[int], splits: dict) -> None:
    """One chunk's documents to their splits, in order: those `held` to val, the others to train."""
    train, val = splits["train"], splits["val"]
    if not held:
        train.add(tokens)
        train.documents += lengths.size
        return
    ends = np.cumsum(lengths)
    pos = 0
    for i in held:
        start = int(ends[i] - lengths[i])
        train.add(tokens[pos:start])
        val.add(tokens[start : int(ends[i])])
        pos = int(ends[i])
    train.add(tokens[pos:])
    val.documents += len(held)
    train.documents += lengths.size - len(held)
