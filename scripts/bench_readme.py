"""Reproduce the README's performance table on the GPUs at hand: one command, one table.

    python scripts/bench_readme.py                 # every row this machine has the GPUs for
    python scripts/bench_readme.py --rows 124m,1b  # some rows
    python scripts/bench_readme.py --list          # the rows and their exact commands

Each row trains one model in bf16 and in its best float8 mode with the real trainer
(scripts/bench_train.py: `torchrun run_train.sh ...`, one run after the other on the same machine)
and prints steady-state tokens/s per GPU, MFU, peak reserved memory and the float8/bf16 ratio, as a
Markdown table that can replace the README's. A row needs as many GPUs as it names; rows that need
more than this machine has are listed as skipped.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _bench_train():
    spec = importlib.util.spec_from_file_location("bench_train", ROOT / "scripts" / "bench_train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class Row:
    name: str
    model: str
    """The README's model cell."""
    config: str
    ngpu: int
    bf16: str
    """Overrides of the bf16 run."""
    float8: str
    """Overrides of the float8 run (the row's best float8 mode)."""
    float8_mode: str
    """The README's float8-mode cell."""
    common: list[str] = field(default_factory=list)


ROWS = [
    Row("124m", "`124m`, seq 2048, batch 64", "train_configs/rtx5090_124m.toml", 1,
        bf16="--fp8.recipe none", float8="",
        float8_mode="tensorwise, delayed scaling (amaxes every 4 steps), `measure`",
        common=["--training.local_batch_size", "64"]),
    Row("1b", "`1b`, seq 4096, batch 6", "train_configs/llama3_1b.toml", 1,
        bf16="--fp8.recipe none", float8="--fp8.scaling delayed --fp8.amax_every 4",
        float8_mode="tensorwise, delayed scaling (amaxes every 4 steps)"),
    Row("1b-32gb", "`1b` in 32 GB (`rtx5090_1b_8bit.toml`, capped at 31 GiB)", "train_configs/rtx5090_1b_8bit.toml", 1,
        bf16="--fp8.recipe none --training.local_batch_size 2", float8="",
        float8_mode="tensorwise, 8-bit AdamW moments, micro-batch 3 (bf16: 2)",
        common=["--training.gpu_memory_limit_gib", "31"]),
    # Measured before llama3_8b.toml computed its loss in chunks: without them, as the row was.
    Row("8b", "`8b`, seq 8192, batch 2, FSDP, selective AC", "train_configs/llama3_8b.toml", 4,
        bf16="--fp8.recipe none", float8="", float8_mode="tensorwise, float8 all-gather",
        common=["--training.loss_chunk_tokens", "0"]),
    Row("1b-2gpu", "`1b`, seq 4096, batch 6, FSDP", "train_configs/llama3_1b.toml", 2,
        bf16="--fp8.recipe none", float8="", float8_mode="tensorwise, float8 all-gather"),
    Row("8b-2gpu", "`8b`, seq 8192, batch 2, FSDP, selective AC (`llama3_8b.toml`)", "train_configs/llama3_8b.toml", 2,
        bf16="--fp8.recipe none", float8="", float8_mode="tensorwise, float8 all-gather"),
]


def command(row: Row, variant: str, steps: int) -> str:
    overrides = row.bf16 if variant == "bf16" else row.float8
    return (f"torchrun --nproc_per_node={row.ngpu} run_train.sh --job.config_file {row.config} "
            f"--training.steps {steps} {' '.join(row.common)} {overrides}").replace("  ", " ").strip()


def cell(result: dict, base: dict | None = None) -> str:
    if result.get("tps") is None:
        return f"failed: {result.get('error', '')}"
    mfu = f"{result['mfu']:.1f} %" if result.get("mfu") is not None else "MFU n/a"
    ratio = f" ({result['tps'] / base['tps']:.2f}×)" if base and base.get("tps") else ""
    return f"{result['tps']:,.0f}{ratio} · {mfu} · {result['mem_gib']:.1f} GiB"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="", help=f"comma-separated, of: {', '.join(r.name for r in ROWS)}")
    p.add_argument("--steps", type=int, default=25, help="steps per run (tokens/s: median of windows after the first)")
    p.add_argument("--ngpu", type=int, default=0, help="GPUs on this machine (default: as many as torch sees)")
    p.add_argument("--out", default="", help="write the results as JSON here")
    p.add_argument("--workdir", default="", help="keep the runs' folders and logs here")
    p.add_argument("--list", action="store_true", help="print each row's commands and stop")
    a = p.parse_args(argv)
    wanted = [r for r in ROWS if not a.rows or r.name in a.rows.split(",")]
    if a.list:
        for row in wanted:
            print(f"{row.name}:\n  bf16:   {command(row, 'bf16', a.steps)}")
            print(f"  float8: {command(row, 'float8', a.steps)}")
        return 0
    import torch

    ngpu = a.ngpu or torch.cuda.device_count()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    bench = _bench_train()
    workdir = Path(a.workdir or tempfile.mkdtemp(prefix="bench_readme_"))
    workdir.mkdir(parents=True, exist_ok=True)
    lines = [f"| model | GPUs ({gpu}) | bf16 tok/s/GPU · MFU · peak memory | best float8 | float8 mode |",
             "|---|---|---:|---:|---|"]
    results = []
    for row in wanted:
        if row.ngpu > ngpu:
            print(f"{row.name}: skipped, needs {row.ngpu} GPUs ({ngpu} here)", flush=True)
            continue
        runs = {}
        for variant in ("bf16", "float8"):
            overrides = row.bf16 if variant == "bf16" else row.float8
            args = argparse.Namespace(config=str(ROOT / row.config), steps=a.steps, log_freq=5, ngpu=row.ngpu,
                                      corpus="", common=list(row.common))
            runs[variant] = bench.run_variant(f"{row.name}-{variant}", shlex.split(overrides), args, workdir, {})
            print(f"{row.name} {variant}: {cell(runs[variant])}  [{command(row, variant, a.steps)}]", flush=True)
        results.append({"row": row.name, "command": {v: command(row, v, a.steps) for v in runs}, **runs})
        lines.append(f"| {row.model} | {row.ngpu} | {cell(runs['bf16'])} | {cell(runs['float8'], runs['bf16'])} "
                     f"| {row.float8_mode} |")
    if a.out:
        Path(a.out).write_text(json.dumps({"gpu": gpu, "ngpu": ngpu, "steps": a.steps, "rows": results}, indent=1))
    print()
    print("\n".join(lines))
    return 0 if all(r[v].get("tps") for r in results for v in ("bf16", "float8")) else 1


if __name__ == "__main__":
    sys.exit(main())
