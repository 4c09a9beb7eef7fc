"""titanlike-prepare: turn text into the token shards that `--data.path` reads.

    titanlike-prepare OUT INPUT [INPUT ...] [--tokenizer tokenizer.json] [--workers N]
        [--text-field FIELD ...] [--val-fraction 0.01] [--shard-tokens 100000000] [--overwrite]
    titanlike-prepare --mix-report FOLDER [FOLDER ...] [--mix MIX --steps N --tokens-per-step T]

INPUT is a file, a folder (its files of the formats below, recursively) or a glob ('data/*.parquet'):
  .txt .md .rst .py       one document per file
  .jsonl .jsonl.gz .jsonl.zst   one JSON object per line, the text in --text-field
  .parquet                one row per document, the text in column --text-field
--text-field is given once (every input) or once per input; without it, each file's text is the
first of text, content, raw_content, body, document, code that it has. A dotted name reaches into
nested objects or struct columns (request.context), unless a record has it as a key of its own. With several inputs, the
summary gives each one's documents and tokens (what a mixture's weights are set from).

Every document becomes [BOS] tokens [EOS] (no BOS when the tokenizer has none). Whole documents go to
OUT/val/ at random, each with the probability --val-fraction, while val keeps within twice that share of the
tokens so far; the others go to OUT/train/. OUT/dataset.json records the
tokenizer (a copy of its tokenizer.json sits next to it), its vocabulary and bos/eos ids, the token
counts and the inputs; training reads it to size the model's vocabulary, and the export copies the
tokenizer into the Hugging Face folder. The shards are the same bytes for any --workers.

    titanlike-train --data.path OUT/train --data.val_path OUT/val
"""

from __future__ import annotations

import argparse
import sys

from titanlike.data.prepare.driver import prepare
from titanlike.data.prepare.readers import ALL_SUFFIXES, TEXT_FIELDS
from titanlike.errors import ArgumentParser, Stopped, UserError, error_exit, stopped_exit, stops_unwind


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--mix-report" in argv:  # another command under the same name: what prepared folders hold
        from titanlike.data.prepare import mix_report

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
                   help="the JSON field / parquet column holding the text, a dotted one for a nested field "
                        "(request.context): once for every input, or once per input in their order (default: the "
                        f"first of {', '.join(TEXT_FIELDS)} a file has)")
    p.add_argument("--val-fraction", type=float, default=0.01,
                   help="share of the tokens held out for validation, at most, as whole documents "
                        "(default 0.01; 0 = none)")
    p.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard file (default 1e8)")
    p.add_argument("--eos-token", default="", help="the token that ends a document (default: found by name)")
    p.add_argument("--bos-token", default="", help="the token that begins a document (default: found by name, or none)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier output of titanlike-prepare in OUT: only its own files, once the "
                        "new data is complete")
    # Two commands under one name: the usage argparse writes for this one, then --mix-report's.
    p.usage = (p.format_usage().removeprefix("usage: ").rstrip("\n")
               + "\n       titanlike-prepare --mix-report FOLDER [FOLDER ...] [--mix MIX] [--tokens T] [--steps N "
               "--tokens-per-step T]")
    a = p.parse_args(argv)
    if a.workers < 0:
        p.error(f"--workers {a.workers} must be >= 0")
    if not a.out.strip():
        p.error("OUT is empty: name the folder to write the dataset into")
    # SIGTERM (a scheduler, `kill`) or SIGHUP (a closed terminal) unwinds like Ctrl-C: the workers stop and
    # OUT.tmp-<pid> is removed, where the default action would end the process and leave both behind.
    try:
        with stops_unwind():
            info = prepare(a.out, a.inputs, a.tokenizer, a.workers, a.text_field or "", a.val_fraction,
                           a.shard_tokens, a.overwrite, a.bos_token, a.eos_token,
                           progress=sys.stderr is not None and sys.stderr.isatty())  # None: stderr closed
    except UserError as e:
        return error_exit(e)
    except (KeyboardInterrupt, Stopped) as e:
        return stopped_exit(e, "nothing was written")
    tr, va = info["splits"]["train"], info["splits"]["val"]
    rate = (tr["tokens"] + va["tokens"]) / max(info["seconds"], 1e-9)
    dropped = f" ({info['empty_documents_dropped']:,} empty ones dropped)" if info["empty_documents_dropped"] else ""
    print(f"{a.out}: {info['documents']:,} documents{dropped}, {info['text_bytes'] / 1e6:,.1f} MB of text "
          f"in {info['seconds']:.1f}s "
          f"({rate:,.0f} tok/s) | train {tr['tokens']:,} tokens in {tr['shards']} shard(s) | "
          f"val {va['tokens']:,} tokens ({va['tokens'] / max(1, tr['tokens'] + va['tokens']):.2%}) in {va['shards']} "
          f"shard(s) | "
          f"{info['tokenizer']['kind']} tokenizer, vocabulary {info['vocab_size']}")
    total = max(1, tr["tokens"] + va["tokens"])
    for source, given in zip(info["sources"], a.inputs) if len(a.inputs) > 1 else ():
        field = f", text from {'/'.join(source['text_fields'])}" if source["text_fields"] else ""
        print(f"  {given}: {source['documents']:,} documents, {source['tokens']:,} tokens "
              f"({source['tokens'] / total:.1%}){field}")
    if va["tokens"]:
        print(f"train with: --data.path {a.out}/train --data.val_path {a.out}/val")
    else:
        why = ("--val-fraction is 0" if not info["val_fraction"] else
               f"no document was held out at --val-fraction {info['val_fraction']:g} (each is drawn with that "
               f"chance, and held while val keeps within twice that share of the tokens); there are "
               f"{info['documents']}")
        more = "give more documents (a text file is one document, a .jsonl line or parquet row one)"
        if info["documents"] >= 2:
            more = f"pass --val-fraction {min(0.5, max(0.01, 2 / info['documents'])):g} or {more}"
        print(f"no validation data ({why}): {more}; train with: "
              f"--data.path {a.out}/train --validation.enable false", file=sys.stderr)
    return 0


def cli() -> None:
    """The `titanlike-prepare` console script: same as `python -m titanlike.data.prepare`."""
    sys.exit(main())
