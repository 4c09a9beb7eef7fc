"""Causal grouped-query attention, forward + backward, per SDPA backend and kv-head strategy: one table.

    python scripts/bench_attention.py --flavor 1b --batch 6 --seq 4096

"repeat" expands the kv heads to the query heads before SDPA (what the model does); "gqa" passes
them as they are with enable_gqa=True. Each cell is the median ms of 20 runs after 5 warm-up, or
the reason the backend refused the inputs. Needs a GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from titanlike.float8.measure import median_cuda_ms  # noqa: E402
from titanlike.model.shape import PRESETS  # noqa: E402

BACKENDS = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="1b")
    p.add_argument("--batch", type=int, default=6)
    p.add_argument("--seq", type=int, default=4096)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: bench_attention.py needs a CUDA GPU")
    a = PRESETS[args.flavor]
    rep = a.n_heads // a.n_kv_heads
    shape_q = (args.batch, a.n_heads, args.seq, a.head_dim)
    shape_kv = (args.batch, a.n_kv_heads, args.seq, a.head_dim)
    q = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(shape_kv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(shape_kv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16)

    def repeat():
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1),
                                             is_causal=True)
        out.backward(grad)

    def gqa():
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(grad)

    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | {args.flavor}: batch {args.batch}, "
          f"seq {args.seq}, {a.n_heads} heads / {a.n_kv_heads} kv heads of {a.head_dim}")
    print(f"{'backend':<10} {'repeat ms':>12} {'gqa ms':>12}")
    for name, backend in BACKENDS.items():
        cells = []
        for fn in (repeat, gqa):
            try:
                if backend is None:
                    ms = median_cuda_ms(fn)
                else:
                    with sdpa_kernel(backend):
                        ms = median_cuda_ms(fn)
                cells.append(f"{ms:>12.3f}")
            except RuntimeError as e:
                cells.append(f"{'refused':>12}")
                print(f"  {name} {fn.__name__}: {str(e).splitlines()[0][:150]}", file=sys.stderr)
        print(f"{name:<10} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
