"""Turn text into token shards that `--data.path` reads.

    python scripts/prepare_data.py OUT_DIR INPUT [INPUT ...] [--tokenizer tokenizer.json]
        [--shard-tokens 100000000] [--val-fraction 0.01] [--text-field text]

INPUT is a .txt file (one document), a .jsonl file (one document per line, in --text-field),
or a folder (every .txt / .jsonl / .md / .py file in it, recursively). Documents are separated by
the tokenizer's end-of-text id. Without --tokenizer, the built-in byte tokenizer is used
(vocabulary 258: set --model.vocab_size 258 or more); with a Hugging Face tokenizer.json, the
`tokenizers` package is needed (`pip install tokenizers`). Every Nth document (N = 1 /
--val-fraction) goes to OUT_DIR/val/, the rest to OUT_DIR/train/:

    ./run_train.sh --data.path OUT_DIR/train --data.val_path OUT_DIR/val --model.vocab_size ...
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from titanlike.data import ByteTokenizer, write_shard  # noqa: E402

TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst"}


def documents(paths: list[Path], text_field: str):
    for path in paths:
        if path.is_dir():
            yield from documents(sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES | {".jsonl"}), text_field)
        elif path.suffix == ".jsonl":
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            yield json.loads(line)[text_field]
                        except (json.JSONDecodeError, KeyError, TypeError):
                            sys.exit(f"error: {path}:{n} is not a JSON object with a {text_field!r} field")
        elif path.is_file():
            yield path.read_text(encoding="utf-8", errors="replace")
        else:
            sys.exit(f"error: input {path} does not exist")


class HFTokenizer:
    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            sys.exit("error: --tokenizer needs the tokenizers package: pip install tokenizers")
        self.tok = Tokenizer.from_file(path)
        self.vocab_size = self.tok.get_vocab_size()
        eos = next((t for t in ("<|end_of_text|>", "</s>", "<|endoftext|>", "<eos>") if self.tok.token_to_id(t) is not None), None)
        self.eos_id = self.tok.token_to_id(eos) if eos else None

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok.encode(text, add_special_tokens=False).ids, dtype=np.uint32)


class ShardWriter:
    def __init__(self, folder: Path, shard_tokens: int):
        self.folder, self.shard_tokens = folder, shard_tokens
        folder.mkdir(parents=True, exist_ok=True)
        self.parts: list[np.ndarray] = []
        self.size = 0
        self.index = 0
        self.total = 0

    def add(self, tokens: np.ndarray) -> None:
        self.parts.append(tokens)
        self.size += tokens.size
        if self.size >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if self.size:
            write_shard(self.folder / f"shard-{self.index:05d}.bin", np.concatenate(self.parts))
            self.index, self.total = self.index + 1, self.total + self.size
            self.parts, self.size = [], 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", type=Path)
    p.add_argument("inputs", type=Path, nargs="+")
    p.add_argument("--tokenizer", default="", help="a Hugging Face tokenizer.json (default: byte tokenizer)")
    p.add_argument("--shard-tokens", type=int, default=100_000_000)
    p.add_argument("--val-fraction", type=float, default=0.01)
    p.add_argument("--text-field", default="text")
    args = p.parse_args()
    tok = HFTokenizer(args.tokenizer) if args.tokenizer else ByteTokenizer()
    sep = np.array([tok.eos_id] if tok.eos_id is not None else [], dtype=np.uint32)
    every = round(1 / args.val_fraction) if args.val_fraction > 0 else 0
    train, val = ShardWriter(args.out_dir / "train", args.shard_tokens), ShardWriter(args.out_dir / "val", args.shard_tokens)
    for i, text in enumerate(documents(args.inputs, args.text_field)):
        ids = np.concatenate([tok.encode(text).astype(np.uint32), sep])
        (val if every and i % every == every - 1 else train).add(ids)
    train.flush()
    val.flush()
    print(f"train: {train.total:,} tokens in {train.index} shard(s); val: {val.total:,} tokens in {val.index} shard(s); "
          f"vocabulary {tok.vocab_size} (use --model.vocab_size {tok.vocab_size} or more)")


if __name__ == "__main__":
    main()
