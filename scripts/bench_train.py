"""Run the real trainer over a list of variants and print one table of steady-state numbers.

    python scripts/bench_train.py --config train_configs/llama3_1b.toml --steps 30 --ngpu 1 \\
        --variant "bf16=--fp8.recipe none" --variant "tensorwise=--fp8.recipe tensorwise" \\
        -- --data.seq_len 4096 --training.local_batch_size 6

Each variant is `name=overrides` (overrides split like a shell would); arguments after `--` apply
to every variant. Leading `NAME=value` words set environment variables for that variant only, as
in a shell: `--variant "ctas16=NCCL_MAX_CTAS=16 --fp8.recipe tensorwise"`. `TITANLIKE_TREE=DIR` runs that
variant on another checkout's code (its run_train.sh, package and copy of the config), to set two commits
side by side on one machine: `git archive COMMIT | tar -x -C DIR`, then `--variant "before=TITANLIKE_TREE=DIR"`.
Each run is
`torchrun --nproc_per_node=N run_train.sh ...`, one after the other on the same machine. Tokens/s
is the median over the logged windows after the first window (the first step, with compilation,
is reported separately as "first step").

`--levers` runs one config through each memory lever in turn (LEVERS: the default, then one lever a
run) and the table says what each saves against the first and at what speed:

    python scripts/bench_train.py --config train_configs/llama3_1b.toml --ngpu 1 --steps 8 --log-freq 1 --levers
    python scripts/bench_train.py --config train_configs/llama3_8b.toml --ngpu 2 --steps 6 --log-freq 1 \
        --levers default,ac_op_wqkv_wo_w1,ac_op_wqkv_w1,cpu_offload

`--levers NAME,NAME` runs only those (the first is what the others are compared with).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# The memory levers, one a run, against the config as it is. cpu_offload turns float8 all-gather off,
# which it cannot do (a tensorwise config gathers in float8 on more than one GPU); a no-op otherwise.
SELECTIVE = "--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option"
LEVERS = [
    ("default", ""),
    ("loss_chunk_4096", "--training.loss_chunk_tokens 4096"),
    ("adamw_8bit", "--optimizer.state_dtype 8bit"),
    ("ac_full", "--activation_checkpoint.mode full"),
    ("ac_op_wqkv_wo_w1", f"{SELECTIVE} op:wqkv,wo,w1"),
    ("ac_op_wqkv_w1", f"{SELECTIVE} op:wqkv,w1"),
    ("reshard_always", "--parallel.reshard_after_forward always"),
    ("cpu_offload", "--parallel.cpu_offload --fp8.enable_fsdp_float8_all_gather false"),
]


def split_env(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """Leading `NAME=value` words (NAME in capitals, as environment variables are) and the rest."""
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return env, words


def run_variant(name: str, overrides: list[str], args, workdir: Path, extra_env: dict[str, str]) -> dict:
    dump = workdir / name
    tree = Path(extra_env.get("TITANLIKE_TREE", ROOT)).resolve()
    config = Path(args.config).resolve()
    if tree != ROOT and config.is_relative_to(ROOT) and (tree / config.relative_to(ROOT)).is_file():
        config = tree / config.relative_to(ROOT)  # that checkout's own copy of the config, in its own keys
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ngpu}",
           str(tree / "run_train.sh"), "--job.config_file", str(config), "--job.dump_folder", str(dump),
           "--training.steps", str(args.steps), "--metrics.log_freq", str(args.log_freq),
           "--validation.enable", "false", "--checkpoint.enable", "false", *args.common, *overrides]
    # A variant may set PYTHONPATH itself; the tree's root goes first either way.
    env = {**os.environ, **extra_env}
    env["PYTHONPATH"] = f"{tree}{os.pathsep}{env.get('PYTHONPATH', '')}"
    if args.corpus:  # the folder that holds an already-built corpus is the cache the runs read
        env["TITANLIKE_CACHE"] = str(Path(args.corpus).resolve())
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    log = proc.stdout + proc.stderr
    (workdir / f"{name}.log").write_text(" ".join(map(shlex.quote, cmd)) + "\n\n" + log)
    result = {"variant": name, "env": extra_env, "overrides": " ".join(overrides), "rc": proc.returncode,
              "wall_s": wall}
    records = []
    metrics_file = dump / "metrics.jsonl"
    if metrics_file.exists():
        records = [r for r in map(json.loads, metrics_file.read_text().splitlines()) if r.get("kind") == "train"]
    if proc.returncode != 0 or not records:
        errors = [line for line in log.splitlines() if line.startswith("error:") or "Error" in line]
        result["error"] = (errors[-1] if errors else log.strip().splitlines()[-1] if log.strip() else "no output")[:200]
        return result
    steady = [r for r in records[2:] if r.get("tps")] or [r for r in records[1:] if r.get("tps")]
    result.update(
        tps=statistics.median(r["tps"] for r in steady) if steady else None,
        mfu=statistics.median(r["mfu"] for r in steady) if steady and steady[0].get("mfu") is not None else None,
        tflops=statistics.median(r["tflops"] for r in steady) if steady else None,
        mem_gib=max((r.get("mem_reserved_gib") or 0) for r in records),
        first_step_s=records[0].get("first_step_s"),
        loss=records[-1]["loss"],
        float8_share=records[-1].get("float8_matmul_share"),
    )
    return result


def table(results: list[dict]) -> str:
    base = next((r["tps"] for r in results if r.get("tps")), None)
    base_mem = next((r["mem_gib"] for r in results if r.get("tps")), None)
    head = (f"{'variant':<24} {'tok/s/GPU':>10} {'vs first':>8} {'MFU%':>6} {'TFLOPS':>7} {'fp8 share':>9} "
            f"{'mem GiB':>8} {'GiB saved':>9} {'first step s':>12} {'loss':>7}")
    lines = [head, "-" * len(head)]
    for r in results:
        if r.get("tps") is None:
            lines.append(f"{r['variant']:<24} FAILED rc={r['rc']}: {r.get('error', '')}")
            continue
        ratio = f"{r['tps'] / base:.2f}x" if base else "-"
        mfu = f"{r['mfu']:.1f}" if r.get("mfu") is not None else "n/a"
        share = f"{r['float8_share']:.0%}" if r.get("float8_share") is not None else "-"
        lines.append(
            f"{r['variant']:<24} {r['tps']:>10,.0f} {ratio:>8} {mfu:>6} {r['tflops']:>7.1f} {share:>9} "
            f"{r['mem_gib']:>8.1f} {base_mem - r['mem_gib']:>9.1f} {r['first_step_s']:>12.1f} {r['loss']:>7.3f}"
        )
    return "\n".join(lines)


def main() -> None:
    argv = sys.argv[1:]
    common: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, common = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "train_configs" / "llama3_1b.toml"))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--log-freq", type=int, default=5)
    p.add_argument("--ngpu", type=int, default=1)
    p.add_argument("--variant", action="append", default=[], help="name=overrides")
    p.add_argument("--levers", nargs="?", const="all", default="",
                   help="run the memory levers (LEVERS) after any --variant: all, or a comma-separated list of "
                        "their names (the first is what the others are compared with)")
    p.add_argument("--corpus", default="",
                   help="a cache folder ($TITANLIKE_CACHE) holding an already-built corpus to reuse")
    p.add_argument("--out", default="", help="write the results as JSON here")
    p.add_argument("--workdir", default="", help="keep run folders and logs here (default: a temp dir)")
    args = p.parse_args(argv)
    args.common = common
    if args.levers:
        levers = dict(LEVERS)
        names = list(levers) if args.levers == "all" else [n.strip() for n in args.levers.split(",") if n.strip()]
        unknown = [n for n in names if n not in levers]
        if unknown:
            p.error(f"--levers: no lever {', '.join(unknown)}; the levers are {', '.join(levers)}")
        args.variant += [f"{name}={levers[name]}" for name in names]
    if not args.variant:
        p.error("name at least one --variant, or --levers")
    variants = []
    for spec in args.variant:
        name, _, overrides = spec.partition("=")
        env, words = split_env(shlex.split(overrides))
        tree = env.get("TITANLIKE_TREE")
        if tree is not None and not (Path(tree) / "run_train.sh").is_file():
            p.error(f"--variant {name}: TITANLIKE_TREE={tree} holds no run_train.sh (not a titanlike checkout)")
        variants.append((name, words, env))
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_train_"))
    workdir.mkdir(parents=True, exist_ok=True)
    results = []
    for name, words, env in variants:
        results.append(run_variant(name, words, args, workdir, env))
        print(table(results[-1:]).splitlines()[-1], flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"config": args.config, "steps": args.steps, "ngpu": args.ngpu,
                                              "common": common, "results": results}, indent=1))
    print()
    print(table(results))


if __name__ == "__main__":
    main()
