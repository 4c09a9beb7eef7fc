"""Forward + backward of each Linear shape, compiled, in bf16 and each float8 recipe: one table.

    python scripts/bench_linear.py --flavor 1b --tokens 24576            # a preset's shapes
    python scripts/bench_linear.py --shape 24576,2048,8192 --shape 8192,4096,14336

A shape is M,K,N: M tokens (local batch × seq_len), K in_features, N out_features. Needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from titanlike.float8.measure import time_linear_ms  # noqa: E402
from titanlike.model.shape import PRESETS  # noqa: E402

RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp"]


def preset_shapes(flavor: str, tokens: int) -> list[tuple[str, int, int, int]]:
    a = PRESETS[flavor]
    kv = a.n_kv_heads * a.head_dim
    named = {"wqkv": (a.dim, a.dim + 2 * kv), "wo": (a.dim, a.dim), "w1/w3": (a.dim, a.ffn_dim),
             "w2": (a.ffn_dim, a.dim), "output": (a.dim, a.vocab_size)}
    return [(name, tokens, k, n) for name, (k, n) in named.items()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="")
    p.add_argument("--tokens", type=int, default=24576)
    p.add_argument("--shape", action="append", default=[], help="M,K,N")
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--out", default="")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: bench_linear.py needs a CUDA GPU")
    shapes = preset_shapes(args.flavor, args.tokens) if args.flavor else []
    shapes += [("custom", *map(int, s.split(","))) for s in args.shape]
    recipes = args.recipes.split(",")
    device = torch.device("cuda")
    rows = []
    head = f"{'layer':<8} {'M':>6} {'K':>6} {'N':>7} {'bf16 ms':>8} " + " ".join(f"{r:>20}" for r in recipes)
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__}\n{head}\n{'-' * len(head)}", flush=True)
    for name, m, k, n in shapes:
        bf16 = time_linear_ms(m, k, n, "none", device)
        row = {"layer": name, "M": m, "K": k, "N": n, "bf16_ms": bf16}
        cells = []
        for r in recipes:
            ms = time_linear_ms(m, k, n, r, device)
            row[f"{r}_ms"] = ms
            cells.append(f"{ms:>8.3f} ms {bf16 / ms:>5.2f}x")
        rows.append(row)
        print(f"{name:<8} {m:>6} {k:>6} {n:>7} {bf16:>8.3f} " + " ".join(f"{c:>20}" for c in cells), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
