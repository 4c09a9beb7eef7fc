"""titanlike-prepare --mix-report: what prepared folders hold, and what a mixture would make of them.

    titanlike-prepare --mix-report data/*
    titanlike-prepare --mix-report --mix "web=data/web:0.7,code=data/code:0.3" --steps 9000 --tokens-per-step 524288

Each folder's training and validation tokens, documents and tokenizer, from its dataset.json. With
--mix and a training length (--tokens, or --steps × --tokens-per-step: global batch × seq_len), the
tokens each source would give and the epochs that makes ("code would repeat 3.2 times"), before a
GPU hour is spent on a mixture that repeats a small source 40 times. Plain Python: no torch.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from titanlike import fs
from titanlike.config.dataset import DatasetError, dataset_info_path, read_dataset_info, shared_dataset_info
from titanlike.config.sources import parse_mix
from titanlike.errors import ArgumentParser, UserError, error_exit, say_error


def folder_record(path: str) -> dict:
    """The dataset.json record of a prepared folder (or of the folder above its train/)."""
    where = dataset_info_path(path)
    if where is None:
        raise UserError(f"{path} has no dataset.json: give folders titanlike-prepare wrote")
    read_dataset_info(path)  # its checks: a record training would refuse is refused here too
    return fs.read_json(where, "the dataset record")


def check_train_tokens(path: str, record: dict) -> None:
    """The record's training tokens against its train/ shards' headers: the epochs are computed from it,
    and an edited count would make a source that repeats 40 times look read once."""
    from titanlike.data.shards import find_shards

    where = str(dataset_info_path(path))
    train = os.path.join(os.path.dirname(where), "train")
    splits = record.get("splits") if isinstance(record, dict) else None
    recorded = splits.get("train", {}).get("tokens") if isinstance(splits, dict) and isinstance(
        splits.get("train"), dict) else None
    held = sum(s.count for s in find_shards(train)) if os.path.isdir(train) else 0
    if not isinstance(recorded, int) or isinstance(recorded, bool) or recorded != held:
        shown = f"{recorded:,}" if isinstance(recorded, int) and not isinstance(recorded, bool) else repr(recorded)
        raise UserError(f"{where} records {shown} training tokens but its train/ shards hold {held:,}: the record "
                        f"was edited or the shards changed; re-make the data with titanlike-prepare")


def token_count(text: str) -> float:
    """--tokens: a finite number >= 0 (2e9 is how people write it)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number >= 0 (e.g. 2e9)")
    return value


def epochs_phrase(name: str, epochs: float) -> str:
    if epochs > 1:
        return f"{name} would repeat {epochs:.1f} times"
    return f"{name} would be read once, {epochs:.0%} of it"


def report(folders: list[str], mix: str, tokens: int) -> list[str]:
    """The report's lines; a UserError for a folder or mixture that cannot be read."""
    sources = parse_mix(mix) if mix else []
    named = [(s.name, s.path) for s in sources] or [(os.path.basename(os.path.normpath(f)), f) for f in folders]
    named += [(os.path.basename(os.path.normpath(f)), f) for f in folders if sources and f not in dict(named).values()]
    records = {name: folder_record(path) for name, path in named}
    width = max([len("source")] + [len(n) for n, _ in named])
    lines = [f"{'source':<{width}}  {'train tokens':>15}  {'val tokens':>12}  {'documents':>11}  tokenizer"]
    for name, path in named:
        r = records[name]
        splits = r.get("splits", {})
        tokenizer = r.get("tokenizer", {})
        kind = tokenizer.get("kind", "?") if isinstance(tokenizer, dict) else tokenizer
        lines.append(f"{name:<{width}}  {splits.get('train', {}).get('tokens', 0):>15,}  "
                     f"{splits.get('val', {}).get('tokens', 0):>12,}  {r.get('documents', 0):>11,}  "
                     f"{kind}, {r.get('vocab_size')} ids ({path})")
    if sources:
        shared_dataset_info(sources)  # two tokenizers: the line training would stop with
    for name, path in named:
        check_train_tokens(path, records[name])
    if sources and tokens:
        total = sum(s.weight for s in sources)
        lines.append(f"training on {tokens:,} tokens:")
        for s in sources:
            share = s.weight / total
            have = records[s.name].get("splits", {}).get("train", {}).get("tokens", 0)
            epochs = share * tokens / max(have, 1)
            lines.append(f"  {s.name:<{width}}  weight {share:.3f}  {share * tokens:>15,.0f} tokens  "
                         f"{epochs:8.2f} epochs: {epochs_phrase(s.name, epochs)}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="titanlike-prepare --mix-report", description=__doc__.split("\n\n")[0],
                       epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folders", nargs="*", help="folders titanlike-prepare wrote")
    p.add_argument("--mix", default="", help="a mixture as --data.mix spells it: NAME=FOLDER:WEIGHT,...")
    p.add_argument("--tokens", type=token_count, default=0, help="tokens the run trains on (e.g. 2e9)")
    p.add_argument("--steps", type=int, default=0, help="optimizer steps (with --tokens-per-step)")
    p.add_argument("--tokens-per-step", type=int, default=0, help="global batch × data.seq_len")
    a = p.parse_args(argv)
    if not a.folders and not a.mix:
        p.error("name prepared folders, or a mixture with --mix")
    if a.tokens < 0 or a.steps < 0 or a.tokens_per_step < 0:
        p.error("--tokens, --steps and --tokens-per-step must be >= 0")
    if bool(a.steps) != bool(a.tokens_per_step):
        p.error("--steps and --tokens-per-step go together (their product is the tokens trained on)")
    tokens = int(a.tokens) or a.steps * a.tokens_per_step
    try:
        for line in report(a.folders, a.mix, tokens):
            print(line)
    except ValueError as e:
        say_error(f"error: --mix {a.mix!r}: {e}")
        return 2
    except (UserError, DatasetError) as e:
        return error_exit(e)
    if a.mix and not tokens:
        print("give --tokens (or --steps and --tokens-per-step) for the epochs each source would make",
              file=sys.stderr)
    return 0
