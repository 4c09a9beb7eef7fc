"""What mixtures and document masks cost: tokens/s of the real trainer, one run after the other.

    python scripts/bench_data.py                          # 124m and 1b on one GPU
    python scripts/bench_data.py --models 124m --steps 50
    python scripts/bench_data.py --device cpu --models debug --steps 3    # a smoke run, no GPU

For each model, three runs of `torchrun run_train.sh` (scripts/bench_train.py's runner), in bf16 with
the model's config (train_configs/rtx5090_124m.toml, llama3_1b.toml: compiled, their batch and
seq_len), on data prepared here from this Python's standard library, cut into documents of about --doc-bytes
bytes (1,500 by default: byte tokens, so about 1,500-token documents):

    one source    --data.path all/train                         (causal attention: the baseline)
    3 sources     --data.mix "a=..:0.5,b=..:0.3,c=..:0.2"        the same files dealt into three folders
    block_causal  --data.path all/train --model.attn_mask block_causal

Each is trained --steps steps; tokens/s per GPU is the median over the logged windows after the first
two (the first step compiles). The model's vocabulary is kept at the preset's (byte tokens would
shrink it to 320 and the output layer with it). The table comes last; a speed ratio is against the
one-source run of the same model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))  # bench_readme's loader of bench_train, the runner

CONFIGS = {"124m": "train_configs/rtx5090_124m.toml", "1b": "train_configs/llama3_1b.toml",
           "debug": "train_configs/debug_model.toml"}
WEIGHTS = {"a": 0.5, "b": 0.3, "c": 0.2}


def documents(files: list[str], doc_bytes: int) -> list[str]:
    """The files' text cut into documents of about `doc_bytes` bytes (whole lines; byte tokens, so about
    as many tokens), the length that decides what block_causal masks; 0 = a file is a document."""
    docs: list[str] = []
    for f in files:
        text = Path(f).read_text(encoding="utf-8", errors="replace")
        if not doc_bytes:
            docs.append(text)
            continue
        piece: list[str] = []
        size = 0
        for line in text.splitlines(keepends=True):
            piece.append(line)
            size += len(line)
            if size >= doc_bytes:
                docs.append("".join(piece))
                piece, size = [], 0
        if piece:
            docs.append("".join(piece))
    return docs


def prepare_sources(folder: Path, limit: int = 0, doc_bytes: int = 0) -> dict[str, str]:
    """The standard library's .py files as one prepared folder ("all") and dealt round-robin into three
    ("a", "b", "c"): the same text, as one source or as a mixture. `limit`: that many files (0 = all);
    `doc_bytes`: documents of about that many bytes (0 = a file is a document)."""
    from titanlike.data.corpus import stdlib_files
    from titanlike.data.prepare.driver import prepare

    files = [str(f) for f in stdlib_files()]
    files = files[:limit] if limit else files
    docs = documents(files, doc_bytes)
    out = {}
    for name, part in (("all", docs), *((n, docs[i::3]) for i, n in enumerate(WEIGHTS))):
        target = folder / name
        if not (target / "dataset.json").exists():
            jsonl = folder / f"{name}.jsonl"
            folder.mkdir(parents=True, exist_ok=True)
            jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in part))
            prepare(str(target), [str(jsonl)], val_fraction=0.01)
        out[name] = str(target)
    return out


def variants(data: dict[str, str]) -> dict[str, list[str]]:
    mix = ",".join(f"{n}={data[n]}:{w}" for n, w in WEIGHTS.items())
    one = ["--data.path", f"{data['all']}/train"]
    return {"one source": one, "3 sources": ["--data.mix", mix],
            "block_causal": [*one, "--model.attn_mask", "block_causal"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="124m,1b", help=f"comma-separated, of: {', '.join(CONFIGS)}")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a smoke run of the script")
    p.add_argument("--steps", type=int, default=30, help="steps per run (tokens/s: median after the first 2 windows)")
    p.add_argument("--log-freq", type=int, default=0, help="log every this many steps (default: steps / 6)")
    p.add_argument("--doc-bytes", type=int, default=1500,
                   help="cut the text into documents of about this many bytes = byte tokens (0 = a file each)")
    p.add_argument("--workdir", default="", help="keep the prepared data, run folders and logs here")
    p.add_argument("--variants", default="", help="comma-separated, of: one source, 3 sources, block_causal "
                   "(default: all; a variant may repeat, to see the noise)")
    p.add_argument("--out", default="", help="write the results as JSON here")
    a = p.parse_args(argv)
    models = [m for m in a.models.split(",") if m]
    unknown = [m for m in models if m not in CONFIGS]
    if unknown:
        p.error(f"--models {','.join(unknown)}: not one of {', '.join(CONFIGS)}")
    names = ("one source", "3 sources", "block_causal")
    wrong = [n for n in a.variants.split(",") if n.strip() and n.strip() not in names]
    if wrong:
        p.error(f"--variants {','.join(wrong)}: not one of {', '.join(names)}")
    from titanlike.model.shape import PRESETS

    workdir = Path(a.workdir or tempfile.mkdtemp(prefix="bench_data_"))
    workdir.mkdir(parents=True, exist_ok=True)
    cpu = a.device == "cpu"
    data = prepare_sources(workdir / "data", limit=300 if cpu else 0, doc_bytes=a.doc_bytes)
    print(f"data: {', '.join(f'{n} {f}' for n, f in data.items())}", flush=True)
    from bench_readme import _bench_train

    bench = _bench_train()
    log_freq = a.log_freq or max(1, a.steps // 6)
    results = []
    for model in models:
        common = ["--fp8.recipe", "none", "--model.vocab_size", str(PRESETS[model].vocab_size)]
        if cpu:
            common += ["--training.device", "cpu", "--data.seq_len", "128", "--training.local_batch_size", "4"]
        args = argparse.Namespace(config=str(ROOT / CONFIGS[model]), steps=a.steps, log_freq=log_freq, ngpu=1,
                                  corpus="", common=common)
        runs = variants(data)
        chosen = [n.strip() for n in a.variants.split(",") if n.strip()] or list(runs)
        for i, name in enumerate(chosen):
            overrides = runs[name]
            result = bench.run_variant(f"{model}-{name.replace(' ', '_')}-{i}", overrides, args, workdir, {})
            result.update(model=model, variant=name)
            results.append(result)
            shown = f"{result['tps']:,.0f} tok/s" if result.get("tps") else f"failed: {result.get('error', '')}"
            print(f"{model} {name}: {shown}", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"device": a.device, "steps": a.steps, "doc_bytes": a.doc_bytes,
                                           "results": results}, indent=1))
    print()
    print(table(results))
    return 0 if all(r.get("tps") for r in results) else 1


def table(results: list[dict]) -> str:
    lines = ["| model | data | attention | tok/s/GPU | vs one source | loss at the end |",
             "|---|---|---|---:|---:|---:|"]
    # The baseline: the mean of the model's one-source runs (--variants may repeat it, to see the noise).
    ones: dict[str, list[float]] = {}
    for r in results:
        if r["variant"] == "one source" and r.get("tps"):
            ones.setdefault(r["model"], []).append(r["tps"])
    base = {model: statistics.fmean(tps) for model, tps in ones.items()}
    for r in results:
        data = "3 sources (0.5/0.3/0.2)" if r["variant"] == "3 sources" else "one source"
        attention = "block_causal" if r["variant"] == "block_causal" else "causal"
        if not r.get("tps"):
            lines.append(f"| {r['model']} | {data} | {attention} | failed: {r.get('error', '')} | | |")
            continue
        ratio = f"{r['tps'] / base[r['model']]:.3f}×" if base.get(r["model"]) else "-"
        lines.append(f"| {r['model']} | {data} | {attention} | {r['tps']:,.0f} | {ratio} | {r['loss']:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
