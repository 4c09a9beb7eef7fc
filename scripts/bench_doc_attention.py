"""Document-masked attention, forward + backward, per kernel and kernel options: one table.

    python scripts/bench_doc_attention.py                    # 124m and 1b shapes
    python scripts/bench_doc_attention.py --flavors 124m --doc-bytes 600

The baseline is what a causal run uses (cuDNN's SDPA with is_causal). Against it: flex attention
with the block_causal BlockMask (titanlike/model/masks.py), compiled, with torch's default kernel
options and with each option set of VARIANTS; and torch's varlen attention (flash attention over
documents given as cumulative lengths) where this torch has it. Document boundaries come from this
Python's standard library cut as scripts/bench_data.py cuts it (documents of about --doc-bytes byte
tokens), laid end to end into the batch's windows. Each cell is the median ms of 20 runs after 5
warm-up, per layer; a variant torch refuses shows the reason. Needs a GPU.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from titanlike.float8.measure import median_cuda_ms  # noqa: E402
from titanlike.model.masks import document_mask  # noqa: E402
from titanlike.model.shape import PRESETS  # noqa: E402

# Batch and window of the model's training config (train_configs/rtx5090_124m.toml, llama3_1b.toml).
SHAPES = {"124m": (24, 2048), "1b": (6, 4096)}
END = 257  # the byte tokenizer's end-of-document id

# Flex attention kernel options (torch.nn.attention.flex_attention.FlexKernelOptions): fwd_ and bwd_
# prefixes send an option to one kernel only; BLOCK_M/BLOCK_N tile the forward kernel, BLOCK_M1/N1
# (dK, dV) and BLOCK_M2/N2 (dQ) the backward one. ROWS_GUARANTEED_SAFE: every query row attends to
# at least one key (true here: a token sees itself), which drops a guard in the kernels.


def forward(block_m: int, block_n: int, stages: int, warps: int, **more) -> dict:
    """Options of the forward kernel alone: its tile and pipeline (the backward keeps torch's)."""
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "fwd_num_stages": stages, "fwd_num_warps": warps, **more}


def backward(block_m1: int, block_n1: int, stages: int, warps: int) -> dict:
    """Options of the backward kernel alone: the dK/dV tile (M1 x N1), the dQ tile its transpose."""
    return {"BLOCK_M1": block_m1, "BLOCK_N1": block_n1, "BLOCK_M2": block_n1, "BLOCK_N2": block_m1,
            "bwd_num_stages": stages, "bwd_num_warps": warps}


VARIANTS: dict[str, dict] = {
    "default": {},
    "rows_safe": {"ROWS_GUARANTEED_SAFE": True},
    **{f"fwd {m}x{n} s{s} w{w}": forward(m, n, s, w)
       for m, n, s, w in [(128, 64, 3, 4), (128, 128, 2, 8), (128, 64, 4, 4), (128, 64, 3, 8), (64, 128, 3, 4),
                          (128, 128, 3, 8)]},
    "fwd tma": {"USE_TMA": True},
    **{f"fwd {m}x{n} s{s} w{w}": forward(m, n, s, w) for m, n, s, w in [(128, 64, 5, 4), (128, 32, 4, 4),
                                                                        (64, 64, 4, 4)]},
    "fwd 128x64 s4 w4 prescale": forward(128, 64, 4, 4, PRESCALE_QK=True),
    "fwd 128x64 s4 w4 ws": forward(128, 64, 4, 4, num_consumer_groups=2, num_buffers_warp_spec=3),
    **{f"bwd {m}/{n} s{s} w{w}": backward(m, n, s, w)
       for m, n, s, w in [(64, 128, 3, 4), (64, 128, 2, 8), (64, 128, 4, 8), (32, 128, 3, 4), (64, 64, 3, 4),
                          (32, 64, 3, 4), (128, 128, 2, 8)]},
}

def document_tokens(batch: int, seq: int, doc_bytes: int) -> torch.Tensor:
    """(batch, seq) tokens whose end ids fall where the stdlib's documents of about `doc_bytes` bytes
    end when laid end to end (the other ids do not matter to attention's cost)."""
    from bench_data import documents

    from titanlike.data.corpus import stdlib_files

    lengths: list[int] = []
    for doc in documents([str(f) for f in stdlib_files()[:400]], doc_bytes):
        lengths.append(len(doc.encode("utf-8")) + 1)
        if sum(lengths) > batch * seq:  # some tens of documents
            break
    tokens = torch.zeros(batch * seq, dtype=torch.long)
    ends = torch.tensor(lengths).cumsum(0) - 1
    tokens[ends[ends < batch * seq]] = END
    return tokens.view(batch, seq)


def cu_seqlens(tokens: torch.Tensor) -> torch.Tensor:
    """Cumulative document starts over the flattened batch, windows cutting documents."""
    batch, seq = tokens.shape
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = tokens[:, :-1] == END
    idx = starts.flatten().nonzero().flatten()
    return torch.cat([idx, torch.tensor([batch * seq], device=idx.device)]).to(torch.int32)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavors", default="124m,1b")
    p.add_argument("--doc-bytes", type=int, default=1500)
    p.add_argument("--variants", default="", help="comma-separated names of VARIANTS (default: all)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: bench_doc_attention.py needs a CUDA GPU")
    names = [n for n in args.variants.split(",") if n] or list(VARIANTS)
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | documents of about {args.doc_bytes} tokens")
    rows = []
    for flavor in args.flavors.split(","):
        rows += bench_shape(flavor, names, args.doc_bytes)
    print()
    print("| shape | kernel | fwd ms | fwd+bwd ms | fwd+bwd vs cuDNN causal |")
    print("|---|---|---:|---:|---:|")
    for flavor, name, fwd, both, base in rows:
        if isinstance(fwd, str):
            print(f"| {flavor} | {name} | {fwd} | | |")
        else:
            ratio = f"{base[1] / both:.3f}×" if both == both else "-"
            print(f"| {flavor} | {name} | {fwd:.3f} | {both:.3f} | {ratio} |")


def bench_shape(flavor: str, names: list[str], doc_bytes: int) -> list[tuple]:
    """The table's rows for one preset's attention shape."""
    from torch.nn.attention.flex_attention import flex_attention

    rows: list[tuple] = []
    a = PRESETS[flavor]
    batch, seq = SHAPES[flavor]
    tokens = document_tokens(batch, seq, doc_bytes).cuda()
    mask = document_mask(tokens, END, flex=True)
    sparsity = mask.sparsity()  # the share of (query, key) blocks skipped
    # The training layout: projections give (B, S, H, D); SDPA takes the transposed view, flex the
    # contiguous (B, H, S, D) copy (masks.py), varlen the flat (B·S, H, D) view.
    q = torch.randn(batch, seq, a.n_heads, a.head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(batch, seq, a.n_kv_heads, a.head_dim, device="cuda", dtype=torch.bfloat16,
                    requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    grad = torch.randn_like(q)

    def sdpa(backward: bool = True):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, enable_gqa=True)
        if backward:
            out.transpose(1, 2).backward(grad)

    base = (median_cuda_ms(lambda: sdpa(False)), median_cuda_ms(sdpa))
    rows.append((flavor, "cuDNN SDPA causal (the causal runs' kernel)", *base, base))
    print(f"{flavor}: batch {batch}, seq {seq}, {a.n_heads}/{a.n_kv_heads} heads of {a.head_dim}; "
          f"BlockMask sparsity {sparsity:.1f} %", flush=True)
    print(f"  cuDNN causal: {base[0]:.3f} / {base[1]:.3f} ms", flush=True)
    timed: dict[str, tuple[float, float]] = {}
    for name in [*names, "combined"]:
        if name == "combined":  # the fastest forward options with the fastest backward ones
            opts = combined(timed)
            if not opts:
                continue
            print(f"  combined: {opts}", flush=True)
        else:
            opts = VARIANTS[name]
        torch._dynamo.reset()

        @torch.compile
        def attend(q, k, v, opts=opts or None):  # as inside a compiled block: the contiguous copies, then flex
            q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
            return flex_attention(q, k, v, block_mask=mask, enable_gqa=True, kernel_options=opts).transpose(1, 2)

        def flex(backward: bool = True, attend=attend):
            out = attend(q, k, v)
            if backward:
                out.backward(grad)

        try:
            fwd = median_cuda_ms(lambda flex=flex: flex(False))
            # Forward-only option sets keep torch's backward: its time is the default's.
            both = median_cuda_ms(flex) if not name.startswith("fwd") else float("nan")
        except Exception as e:  # a refused option set: its reason in the table
            reason = f"refused: {type(e).__name__}: {str(e).splitlines()[0][:90]}"
            rows.append((flavor, f"flex {name}", reason, float("nan"), base))
            print(f"  flex {name}: {reason}", flush=True)
            continue
        timed[name] = (fwd, both)
        rows.append((flavor, f"flex {name}", fwd, both, base))
        print(f"  flex {name}: {fwd:.3f} / {both:.3f} ms", flush=True)
    rows.append((flavor, "varlen (flash)", *varlen_ms(q, k, v, grad, tokens, a), base))
    print(f"  varlen: {rows[-1][2]} / {rows[-1][3]}", flush=True)
    rows.append((flavor, "varlen (cuDNN, private aten op)", *cudnn_varlen_ms(q, k, v, grad, tokens, a), base))
    print(f"  cuDNN varlen: {rows[-1][2]} / {rows[-1][3]}", flush=True)
    return rows


def combined(timed: dict[str, tuple[float, float]]) -> dict:
    """The options of the fastest forward variant merged with those of the fastest backward one (by
    fwd+bwd time; the default and rows_safe count on both sides)."""
    fwd = min((n for n in timed if not n.startswith("bwd")), key=lambda n: timed[n][0], default=None)
    bwd = min((n for n in timed if not n.startswith("fwd")), key=lambda n: timed[n][1], default=None)
    if fwd is None or bwd is None:
        return {}
    return {**VARIANTS[fwd], **VARIANTS[bwd]}


def varlen_ms(q, k, v, grad, tokens, a):
    """Flash attention over documents as cumulative lengths, where this torch has varlen_attn."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as e:
        return f"not in this torch ({e})", float("nan")
    cu = cu_seqlens(tokens)
    batch, seq = tokens.shape
    params = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    gqa = "enable_gqa" in params
    rep = a.n_heads // a.n_kv_heads

    def run(backward: bool = True):
        kk, vv = (k, v) if gqa else (k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2))
        out = varlen_attn(q.view(batch * seq, a.n_heads, a.head_dim), kk.reshape(batch * seq, -1, a.head_dim),
                          vv.reshape(batch * seq, -1, a.head_dim), cu, cu, seq, seq, **causal,
                          **({"enable_gqa": True} if gqa else {}))
        if backward:
            out.view_as(q).backward(grad)

    try:
        return median_cuda_ms(lambda: run(False)), median_cuda_ms(run)
    except Exception as e:
        return f"refused: {type(e).__name__}: {str(e).splitlines()[0][:90]}", float("nan")



def cudnn_varlen_ms(q, k, v, grad, tokens, a):
    """cuDNN's attention over documents as cumulative lengths through aten's private op (what torch's
    varlen_attn would call with its cuDNN switch on; backward through its autograd formula): kv heads
    as they are if cuDNN takes them, else repeated to the query heads (the log says which)."""
    cu = cu_seqlens(tokens)
    batch, seq = tokens.shape
    rep = a.n_heads // a.n_kv_heads
    q3, k3, v3 = (t.detach().reshape(batch * seq, -1, a.head_dim).requires_grad_() for t in (q, k, v))
    g3 = grad.reshape(batch * seq, -1, a.head_dim)

    def attend(repeat: bool) -> torch.Tensor:
        kk, vv = (k3.repeat_interleave(rep, 1), v3.repeat_interleave(rep, 1)) if repeat else (k3, v3)
        return torch.ops.aten._cudnn_attention_forward(q3, kk, vv, None, cu, cu, seq, seq, True, 0.0, True)[0]

    for repeat in (False, True):
        how = "kv repeated" if repeat else "kv heads as they are"

        def run(backward: bool = True, repeat: bool = repeat) -> None:
            out = attend(repeat)
            if backward:
                out.backward(g3)

        try:
            # Correctness first: the first document's output against SDPA's on that document alone.
            out = attend(repeat)
            n = int(cu[1])
            ref = F.scaled_dot_product_attention(*(t[:n].transpose(0, 1)[None] for t in (q3, k3, v3)),
                                                 is_causal=True, enable_gqa=True)
            err = (out[:n] - ref[0].transpose(0, 1)).abs().max().item()
            times = median_cuda_ms(lambda run=run: run(False)), median_cuda_ms(run)
            print(f"  cuDNN varlen ({how}): max error against SDPA on the first document {err:.2e}", flush=True)
            return times
        except Exception as e:
            print(f"  cuDNN varlen ({how}) refused: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
    return "refused (both ways; reasons above)", float("nan")

if __name__ == "__main__":
    main()
