"""Speed of titanlike-prepare against the bare tokenizer: prints a table.

    python scripts/bench_prepare.py --mb 200 --workers 1,2,4,8,16 [--tokenizer tokenizer.json]

Builds a corpus of --mb MB of JSON lines from this Python's standard library sources (no download),
trains a byte-level BPE tokenizer on a sample of it with the `tokenizers` package unless one is given,
then measures
  - the baseline: one process calling bare `Tokenizer.encode_batch` on the same documents, in
    batches of about 1 MB, with the tokenizers package's own threads off (one core);
  - titanlike-prepare (reading, splitting, writing included) at each --workers.
The target is tokens/s >= 0.9 × workers × baseline. Needs the `data` extra (tokenizers).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the baseline is one core: no hidden thread pool

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from titanlike.data.corpus import stdlib_files  # noqa: E402
from titanlike.data.prepare.driver import prepare  # noqa: E402


def build_corpus(folder: Path, mb: float, files_out: int = 8) -> list[str]:
    """About `mb` MB of JSON lines (one stdlib source file a line, repeated as needed) in `files_out` files."""
    sources = []
    for f in stdlib_files():
        try:
            sources.append(f.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            pass
    target = int(mb * 1e6)
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"part-{i:02d}.jsonl" for i in range(files_out)]
    handles = [open(p, "w", encoding="utf-8") for p in paths]
    written, i = 0, 0
    while written < target:
        line = json.dumps({"text": sources[i % len(sources)]}) + "\n"
        handles[i % files_out].write(line)
        written += len(line)
        i += 1
    for h in handles:
        h.close()
    return [str(p) for p in paths]


def train_tokenizer(texts: list[str], vocab: int, out: Path) -> str:
    import tokenizers

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
                                             show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.save(str(out))
    return str(out)


def read_docs(paths: list[str]) -> list[str]:
    return [json.loads(line)["text"] for p in paths for line in open(p, encoding="utf-8")]


def baseline(tokenizer: str, docs: list[str]) -> tuple[float, int]:
    """(tokens/s, tokens) of bare encode_batch over ~1 MB batches, one process, one core."""
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(tokenizer)
    batches, batch, size = [], [], 0
    for d in docs:
        batch.append(d)
        size += len(d)
        if size >= 1 << 20:
            batches.append(batch)
            batch, size = [], 0
    batches.append(batch)
    tok.encode_batch(batches[0][:10], add_special_tokens=False)  # warm-up
    start = time.perf_counter()
    tokens = 0
    for b in batches:
        tokens += sum(len(e) for e in tok.encode_batch(b, add_special_tokens=False))
    return tokens / (time.perf_counter() - start), tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=50, help="corpus size in MB (default 50)")
    p.add_argument("--workers", default="1,2", help="comma-separated worker counts (default 1,2)")
    p.add_argument("--tokenizer", default="", help="a tokenizer.json (default: train one on the corpus)")
    p.add_argument("--vocab", type=int, default=16384, help="vocabulary of the trained tokenizer (default 16384)")
    p.add_argument("--baseline-mb", type=float, default=0,
                   help="measure the bare encoder on the first this many MB only (default: all of it); its "
                        "rate per token does not depend on the size, the pool's start-up cost does")
    p.add_argument("--repeats", type=int, default=1, help="runs per worker count; the best is reported")
    p.add_argument("--keep", default="", help="build the corpus here and keep it (default: a temporary folder)")
    a = p.parse_args()
    root = Path(a.keep or tempfile.mkdtemp(prefix="bench_prepare_"))
    try:
        t0 = time.perf_counter()
        paths = build_corpus(root / "corpus", a.mb)
        docs = read_docs(paths)
        tokenizer = a.tokenizer
        if not tokenizer:
            sample, size = [], 0
            for d in docs:  # about 10 MB is plenty to learn the merges
                sample.append(d)
                size += len(d)
                if size > 10e6:
                    break
            tokenizer = train_tokenizer(sample, a.vocab, root / "tokenizer.json")
        print(f"corpus {a.mb:g} MB in {len(paths)} .jsonl files, {len(docs):,} documents; tokenizer {tokenizer} "
              f"(setup {time.perf_counter() - t0:.0f}s); {os.cpu_count()} cores visible")
        if a.baseline_mb:
            size = 0
            for i, d in enumerate(docs):
                size += len(d)
                if size > a.baseline_mb * 1e6:
                    docs = docs[: i + 1]
                    break
        base, tokens = baseline(tokenizer, docs)
        del docs
        print(f"bare encode_batch, one process: {base:,.0f} tok/s ({tokens:,} tokens)\n")
        print(f"{'workers':>7} | {'seconds':>8} | {'tok/s':>12} | {'target 0.9×N×base':>18} | {'ratio to N×base':>15}")
        print("-" * 72)
        for n in [int(x) for x in a.workers.split(",")]:
            best = float("inf")
            for _ in range(a.repeats):
                out = root / f"out-{n}"
                start = time.perf_counter()
                info = prepare(str(out), paths, tokenizer=tokenizer, workers=n, overwrite=True)
                best = min(best, time.perf_counter() - start)
            total = info["splits"]["train"]["tokens"] + info["splits"]["val"]["tokens"]
            rate = total / best
            print(f"{n:>7} | {best:>8.2f} | {rate:>12,.0f} | {0.9 * n * base:>18,.0f} | {rate / (n * base):>15.2f}")
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
