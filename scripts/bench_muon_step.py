"""Muon's optimizer step on one GPU for a preset's block matrices, in parts: one table.

    python scripts/bench_muon_step.py --flavor 1b
    python scripts/bench_muon_step.py --flavor 1b --flavor 8b --steps 10

On one rank Muon orthogonalises every block matrix each step, whatever the batch, so its cost is a fixed
time per step. The table splits it: the whole Muon step (momentum, Newton–Schulz, the weight update),
Newton–Schulz alone (orthogonalize_local), and Newton–Schulz compiled, each with the TFLOP/s its
multiply-adds reach (ns_flops). What a training step pays on top of AdamW's is Muon's step less AdamW's
fused step on the same matrices (the last column). Needs a GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from titanlike.model.shape import PRESETS, block_matrix_pieces  # noqa: E402
from titanlike.optim import orthogonalize  # noqa: E402
from titanlike.optim.muon import MUON, Muon  # noqa: E402


def block_params(flavor: str) -> tuple[list[torch.Tensor], list[int]]:
    """fp32 parameters shaped as the preset's block matrices (wqkv stacked), with gradients; wqkv's widths."""
    a = PRESETS[flavor]
    widths = a.qkv_widths
    shapes = [(sum(widths), a.dim), (a.dim, a.n_heads * a.head_dim), (a.ffn_dim, a.dim), (a.ffn_dim, a.dim),
              (a.dim, a.ffn_dim)] * a.n_layers
    params = []
    for rows, cols in shapes:
        p = torch.randn(rows, cols, device="cuda") * 0.02
        p.grad = torch.randn(rows, cols, device="cuda") * 1e-3
        params.append(p)
    return params, widths


def timed_ms(fn, steps: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def measure(flavor: str, steps: int) -> str:
    """One row of the table for one preset."""
    params, widths = block_params(flavor)
    flops = sum(orthogonalize.ns_flops(r, c) for r, c in block_matrix_pieces(PRESETS[flavor])) \
        * PRESETS[flavor].n_layers
    stacked = [q for i, q in enumerate(params) if i % 5 == 0]
    others = [q for i, q in enumerate(params) if i % 5]
    muon = Muon([{"kind": MUON, "params": others, "row_splits": []},
                 {"kind": MUON, "params": stacked, "row_splits": widths}], lr=1e-4)
    step_ms = timed_ms(muon.step, steps)
    matrices = [muon._matrix(g, q, q.grad, muon.state[q]["momentum_buffer"])
                for g in muon.param_groups for q in g["params"]]
    ns_ms = timed_ms(lambda: orthogonalize.orthogonalize_local(matrices), steps)
    eager = orthogonalize.newton_schulz
    orthogonalize.newton_schulz = torch.compile(eager, dynamic=False)
    try:
        compiled_ms = timed_ms(lambda: orthogonalize.orthogonalize_local(matrices), steps)
    finally:
        orthogonalize.newton_schulz = eager
    del muon
    matrices.clear()  # the momentum buffers go before AdamW's moments come
    adamw = torch.optim.AdamW(params, lr=1e-4, fused=True)
    adamw_ms = timed_ms(adamw.step, steps)
    return (f"{flavor:>6} {flops / 1e12:>9.1f} {step_ms:>13.1f} {ns_ms:>8.1f} {flops / ns_ms / 1e9:>11.0f} "
            f"{compiled_ms:>15.1f} {flops / compiled_ms / 1e9:>8.0f} {adamw_ms:>14.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", action="append", default=[])
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'flavor':>6} {'NS TFLOP':>9} {'Muon step ms':>13} {'NS ms':>8} {'NS TFLOP/s':>11} "
          f"{'NS compiled ms':>15} {'TFLOP/s':>8} {'AdamW step ms':>14}")
    for flavor in args.flavor or ["1b"]:
        print(measure(flavor, args.steps))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
