"""titanlike-prepare: turn text into the token shards that `--data.path` reads.

    titanlike-prepare OUT INPUT [INPUT ...] [--tokenizer tokenizer.json] [--workers N]
        [--text-field FIELD ...] [--val-fraction 0.01] [--shard-tokens 100000000] [--overwrite]
    titanlike-prepare --mix-report FOLDER [FOLDER ...] [--mix MIX --steps N --tokens-per-step T]

INPUT is a file, a folder (its files of the formats below, recursively) or a glob ('data/*.parquet'):
  .txt .md .rst .py       one document per file
  .jsonl .jsonl.gz .jsonl.zst   one JSON object per line, the text in --text-field
  .parquet                one row per document, the text in column --text-field
--text-field is given once (every input) or once per input; without it, each file's text is the
first of text, content, raw_content, body, document, code that it has. With several inputs, the
summary gives each one's documents and tokens (what a mixture's weights are set from).

Every document becomes [BOS] tokens [EOS] (no BOS when the tokenizer has none). Every k-th document
(k = 1 / --val-fraction) goes to OUT/val/, the others to OUT/train/. OUT/dataset.json records the
tokenizer (a copy of its tokenizer.json sits next to it), its vocabulary and bos/eos ids, the token
counts and the inputs; training reads it to size the model's vocabulary, and the export copies the
tokenizer into the Hugging Face folder. The shards are the same bytes for any --workers.

    titanlike-train --data.path OUT/train --data.val_path OUT/val
"""

from __future__ import annotations

import argparse
import collections
import datetime
import multiprocessing
import os
import re
import shutil
import signal
import sys
import time
from dataclasses import dataclass

import numpy as np

from titanlike import fs
from titanlike.data.dataset_info import DATASET_FORMAT, DATASET_JSON
from titanlike.data.shards import ShardWriter, shard_name, token_dtype
from titanlike.data.sources import ALL_SUFFIXES, TEXT_FIELDS, Chunk, expand, plan, read_chunk
from titanlike.errors import ArgumentParser, UserError

# ---- the worker side: a chunk of input in, its documents' tokens out ----------------------------------

_tokenizer = None


def _init_worker(spec: str, bos: str, eos: str, pool_worker: bool = True) -> None:
    global _tokenizer
    if pool_worker:  # Ctrl-C is the main process's to handle (it stops the pool): no traceback per worker
        signal.signal(signal.SIGINT, signal.SIG_IGN)
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


# ---- the main side: shards, splits, progress ---------------------------------------------------------


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


def _tokenized(chunks, workers: int, spec: str, bos: str, eos: str):
    """Tokenized chunks in input order; with several workers, computed in parallel."""
    if workers == 1:
        _init_worker(spec, bos, eos, pool_worker=False)
        yield from map(tokenize_chunk, chunks)
        return
    # fork where there is one: the workers start at once, with the parsed modules already imported.
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
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


# What titanlike-prepare writes into OUT; --overwrite replaces these and nothing else.
SPLITS = ("train", "val")
WRITTEN = (*SPLITS, DATASET_JSON, "tokenizer.json")
_SHARD = re.compile(r"shard-(\d+)\.bin")


def check_output(out: str, files: list[str], overwrite: bool) -> None:
    """Refuse an OUT that would cost the user data: one that holds an input, or one that exists and
    is not a dataset this tool wrote, or whose train/ or val/ hold files it did not write
    (--overwrite replaces only its own files)."""
    real_out = os.path.realpath(out)
    for f in files:
        real = os.path.realpath(f)
        if real == real_out or real.startswith(real_out + os.sep):
            raise UserError(f"input {f} lies inside the output folder {out}; write the dataset elsewhere")
    if not os.path.lexists(out):
        return
    if not overwrite:
        raise UserError(f"{out} exists; choose another output folder or pass --overwrite to replace it")
    if not os.path.isdir(out) or os.path.islink(out) or not os.path.isfile(os.path.join(out, DATASET_JSON)):
        raise UserError(f"{out} is not a dataset titanlike-prepare wrote (no {DATASET_JSON}); --overwrite replaces "
                        f"only such a folder: choose another output folder")
    check_foreign(out, recorded_shards(out))


def recorded_shards(out: str) -> dict[str, int]:
    """How many shards OUT/dataset.json says each split holds: the shards this tool wrote there."""
    where = os.path.join(out, DATASET_JSON)
    record = fs.read_json(where, "the dataset record")
    splits = record.get("splits") if isinstance(record, dict) else None
    counts = {}
    for split in SPLITS:
        entry = splits.get(split) if isinstance(splits, dict) else None
        count = entry.get("shards") if isinstance(entry, dict) else None
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise UserError(f"{where} does not record how many shards titanlike-prepare wrote to {split}/, so "
                            f"--overwrite cannot tell them from other files: choose another output folder")
        counts[split] = count
    return counts


def _own_shard(name: str, count: int) -> bool:
    m = _SHARD.fullmatch(name)
    return m is not None and int(m.group(1)) < count and name == shard_name(int(m.group(1)))


def check_foreign(out: str, counts: dict[str, int]) -> None:
    """Refuse when OUT/train or OUT/val hold anything but the shards recorded in dataset.json: replacing
    the split would lose it, and a .bin file left beside the new shards would be read as training data."""
    foreign = []
    for split in SPLITS:
        folder = os.path.join(out, split)
        if os.path.islink(folder):  # the link itself is replaced; where it points is not ours to empty
            continue
        if os.path.isdir(folder):
            foreign += sorted(e.path for e in os.scandir(folder)
                              if e.is_dir(follow_symlinks=False) or not _own_shard(e.name, counts[split]))
        elif os.path.lexists(folder):
            foreign.append(folder)
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise UserError(f"{out}: --overwrite replaces train/ and val/, which hold {len(foreign)} file(s) "
                        f"titanlike-prepare did not write: {shown}; move them elsewhere (a shard left there would "
                        f"be read as training data) or choose another output folder")


def prepare(out: str, inputs: list[str], tokenizer: str = "", workers: int = 0, text_field: str | list[str] = "",
            val_fraction: float = 0.01, shard_tokens: int = 100_000_000, overwrite: bool = False,
            bos_token: str = "", eos_token: str = "", progress: bool = False) -> dict:
    """Tokenize `inputs` into OUT/train, OUT/val and OUT/dataset.json; returns the dataset.json record.
    `text_field`: one for all inputs or one per input; "" = the first of sources.TEXT_FIELDS a file has."""
    from titanlike.data.tokenizer import load_tokenizer

    out = os.path.normpath(out)
    if not 0 <= val_fraction < 1:
        raise UserError(f"--val-fraction {val_fraction} must be in [0, 1)")
    if shard_tokens < 1:
        raise UserError(f"--shard-tokens {shard_tokens} must be >= 1")
    given = text_field if isinstance(text_field, list) else [text_field]
    if len(given) not in (1, len(inputs)):
        raise UserError(f"--text-field is given {len(given)} times for {len(inputs)} inputs: give it once (for "
                        f"every input) or once per input, in their order")
    per_input = [expand([i]) for i in inputs]
    files = [f for group in per_input for f in group]
    file_source = [n for n, group in enumerate(per_input) for _ in group]
    file_field = [given[n] if len(given) > 1 else given[0] for n in file_source]
    check_output(out, files, overwrite)
    tok = load_tokenizer(tokenizer, bos_token, eos_token)  # a bad tokenizer.json stops here, before any work
    total_bytes = sum(os.path.getsize(f) for f in files)
    # Every core this process may use (a container or taskset may allow fewer than the machine has).
    workers = workers or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()) or 1
    every = round(1 / val_fraction) if val_fraction > 0 else 0
    dtype = token_dtype(tok.vocab_size)

    tmp = f"{out}.tmp-{os.getpid()}"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        splits = {"train": ShardWriter(os.path.join(tmp, "train"), shard_tokens, dtype),
                  "val": ShardWriter(os.path.join(tmp, "val"), shard_tokens, dtype)}
        bar = Progress(total_bytes, progress)
        start = time.perf_counter()
        n_docs = text_bytes = empty = 0
        chunks = plan(files, file_field, file_source)
        spec = getattr(tok, "path", "byte")
        sources: list[dict] = [{"input": os.path.abspath(i), "documents": 0, "tokens": 0, "text_fields": set()}
                               for i in inputs]
        for tokens, lengths, counts in _tokenized(chunks, workers, spec, tok.bos_token or "", tok.eos_token or ""):
            _split(tokens, lengths, n_docs, every, splits)
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
            what = "no documents" if n_docs == 0 else f"{n_docs} document(s), all held out for validation"
            raise UserError(f"{', '.join(inputs)}: {what} (every input was empty); nothing to train on")
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
            "val_every": every,
            "inputs": [os.path.abspath(i) for i in inputs],
            "sources": [{**s, "text_fields": sorted(s["text_fields"])} for s in sources],
            "files": len(files),
            "input_bytes": total_bytes,
            "text_bytes": text_bytes,
            "text_field": ", ".join(sorted({f for s in sources for f in s["text_fields"]})),
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        fs.write_text(os.path.join(tmp, "tokenizer.json"), tok.to_json())
        fs.write_json(os.path.join(tmp, DATASET_JSON), info, indent=1)
        _publish(tmp, out)
    except OSError as e:  # a read-only or full disk, a folder we may not write: one line, nothing left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"cannot write the dataset: {fs.describe_os_error(e, tmp)}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    info["seconds"] = seconds
    return info


def _publish(tmp: str, out: str) -> None:
    """Move the finished dataset in `tmp` to `out`. Over an earlier output (--overwrite), only the entries
    prepare writes are replaced, and the old ones go only once the new ones are in place."""
    if not os.path.exists(out):
        os.rename(tmp, out)
        return
    counts = recorded_shards(out)
    check_foreign(out, counts)  # again: the user may have added files while the inputs were tokenized
    old = os.path.join(tmp, ".replaced")
    os.mkdir(old)
    for name in WRITTEN:
        if os.path.lexists(os.path.join(out, name)):
            os.rename(os.path.join(out, name), os.path.join(old, name))
    for name in WRITTEN:
        if os.path.lexists(os.path.join(tmp, name)):  # no val/ when nothing was held out
            os.rename(os.path.join(tmp, name), os.path.join(out, name))
    _remove_replaced(old, counts)
    try:
        os.rmdir(old)
        os.rmdir(tmp)
    except OSError:  # something of the user's came into train/ or val/ after the last check: it stays
        print(f"note: kept {old}: it holds files that came into {out}/train or {out}/val while prepare ran",
              file=sys.stderr)


def _remove_replaced(old: str, counts: dict[str, int]) -> None:
    """Delete the entries --overwrite replaced: a file or link itself (never a link's target), and of a
    split folder only the shards dataset.json recorded, then the folder once that empties it."""
    for name in os.listdir(old):
        path = os.path.join(old, name)
        if os.path.islink(path) or not os.path.isdir(path):
            os.unlink(path)
        elif name in counts:
            for entry in os.scandir(path):
                if not entry.is_dir(follow_symlinks=False) and _own_shard(entry.name, counts[name]):
                    os.unlink(entry.path)
            try:
                os.rmdir(path)
            except OSError:
                pass  # not empty: what is left is not ours to delete


def _split(tokens: np.ndarray, lengths: np.ndarray, first_doc: int, every: int, splits: dict) -> None:
    """Documents first_doc, first_doc + 1, ... to their splits: every `every`-th to val, in order."""
    train, val = splits["train"], splits["val"]
    if not every:
        train.add(tokens)
        train.documents += lengths.size
        return
    ends = np.cumsum(lengths)
    # Global index g goes to val when (g + 1) % every == 0.
    held = [i for i in range((every - 1 - first_doc) % every, lengths.size, every)]
    pos = 0
    for i in held:
        start = int(ends[i] - lengths[i])
        train.add(tokens[pos:start])
        val.add(tokens[start : int(ends[i])])
        pos = int(ends[i])
    train.add(tokens[pos:])
    val.documents += len(held)
    train.documents += lengths.size - len(held)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--mix-report" in argv:  # another command under the same name: what prepared folders hold
        from titanlike.data import mix_report

        return mix_report.main([a for a in argv if a != "--mix-report"])
    p = ArgumentParser(prog="titanlike-prepare", description=__doc__.split("\n\n")[0],
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="output folder (train/, val/, dataset.json, tokenizer.json)")
    p.add_argument("inputs", nargs="+", help=f"files, folders or globs ({' '.join(ALL_SUFFIXES)})")
    p.add_argument("--tokenizer", default="byte",
                   help="'byte' (the built-in byte tokenizer, 258 ids) or a Hugging Face tokenizer.json "
                        "(or its folder)")
    p.add_argument("--workers", type=int, default=0, help="tokenizing processes (default: every core)")
    p.add_argument("--text-field", action="append", default=None,
                   help="the JSON field / parquet column holding the text: once for every input, or once per "
                        f"input in their order (default: the first of {', '.join(TEXT_FIELDS)} a file has)")
    p.add_argument("--val-fraction", type=float, default=0.01,
                   help="share of documents held out for validation: every round(1/f)-th (default 0.01; 0 = none)")
    p.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard file (default 1e8)")
    p.add_argument("--eos-token", default="", help="the token that ends a document (default: found by name)")
    p.add_argument("--bos-token", default="", help="the token that begins a document (default: found by name, or none)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier output of titanlike-prepare in OUT: only its own files, once the "
                        "new data is complete")
    a = p.parse_args(argv)
    if a.workers < 0:
        p.error(f"--workers {a.workers} must be >= 0")
    try:
        info = prepare(a.out, a.inputs, a.tokenizer, a.workers, a.text_field or "", a.val_fraction, a.shard_tokens,
                       a.overwrite, a.bos_token, a.eos_token, progress=sys.stderr.isatty())
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted; nothing was written", file=sys.stderr)
        return 130
    tr, va = info["splits"]["train"], info["splits"]["val"]
    rate = (tr["tokens"] + va["tokens"]) / max(info["seconds"], 1e-9)
    dropped = f" ({info['empty_documents_dropped']:,} empty ones dropped)" if info["empty_documents_dropped"] else ""
    print(f"{a.out}: {info['documents']:,} documents{dropped}, {info['text_bytes'] / 1e6:,.1f} MB of text "
          f"in {info['seconds']:.1f}s "
          f"({rate:,.0f} tok/s) | train {tr['tokens']:,} tokens in {tr['shards']} shard(s) | "
          f"val {va['tokens']:,} tokens in {va['shards']} shard(s) | "
          f"{info['tokenizer']['kind']} tokenizer, vocabulary {info['vocab_size']}")
    total = max(1, tr["tokens"] + va["tokens"])
    for source, given in zip(info["sources"], a.inputs) if len(a.inputs) > 1 else ():
        field = f", text from {'/'.join(source['text_fields'])}" if source["text_fields"] else ""
        print(f"  {given}: {source['documents']:,} documents, {source['tokens']:,} tokens "
              f"({source['tokens'] / total:.1%}){field}")
    if va["tokens"]:
        print(f"train with: --data.path {a.out}/train --data.val_path {a.out}/val")
    else:
        why = ("--val-fraction is 0" if not info["val_every"] else
               f"every {info['val_every']}th document goes to validation and there are {info['documents']}")
        more = "give more documents (a text file is one document, a .jsonl line or parquet row one)"
        if info["documents"] >= 2:
            more = f"pass --val-fraction {min(0.5, max(0.01, 2 / info['documents'])):g} or {more}"
        print(f"no validation data ({why}): {more}; train with: "
              f"--data.path {a.out}/train --validation.enable false", file=sys.stderr)
    return 0


def cli() -> None:
    """The `titanlike-prepare` console script: same as `python -m titanlike.prepare`."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
