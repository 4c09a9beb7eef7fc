"""Does inductor fold an amax into the float8 cast kernel that reads the same tensor? Times one
compiled function per way of writing it, on a 1b-sized activation (24576 x 8192 bf16) and on the
SwiGLU backward (gate, up and incoming gradient to two float8 gradients, each also transposed).
Written 2026-11-22 (sixth session) for fp8.scaling = delayed; prints a table."""

import torch

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
dev = "cuda"


def cast(x, scale, dtype):
    fmax = torch.finfo(dtype).max
    return (x.float() * scale).clamp(-fmax, fmax).to(dtype)


def full_amax(x):
    return x.abs().max().float()


def row_amax(x):
    return x.abs().amax(dim=-1).max().float()


def act_cast_only(x, s, sink):
    return cast(x, s, E4)


def act_cast_full(x, s, sink):
    sink.copy_(full_amax(x))
    return cast(x, s, E4)


def act_cast_row(x, s, sink):
    sink.copy_(row_amax(x))
    return cast(x, s, E4)


def act_dynamic(x, s, sink):
    return cast(x, 448.0 / full_amax(x).clamp(min=1e-12), E4)


def swiglu_bwd(g, a, b):
    sa = torch.sigmoid(a.float())
    silu = a.float() * sa
    da = g.float() * b.float() * (sa * (1 + a.float() * (1 - sa)))
    db = g.float() * silu
    return da, db


def bwd_cast_only(g, a, b, s, sink):
    da, db = swiglu_bwd(g, a, b)
    da8, db8 = cast(da, s, E5), cast(db, s, E5)
    return da8, da8.t().contiguous(), db8, db8.t().contiguous()


def bwd_cast_full(g, a, b, s, sink):
    da, db = swiglu_bwd(g, a, b)
    sink.copy_(torch.stack([full_amax(da), full_amax(db)]))
    da8, db8 = cast(da, s, E5), cast(db, s, E5)
    return da8, da8.t().contiguous(), db8, db8.t().contiguous()


def bwd_cast_row(g, a, b, s, sink):
    da, db = swiglu_bwd(g, a, b)
    sink.copy_(torch.stack([row_amax(da), row_amax(db)]))
    da8, db8 = cast(da, s, E5), cast(db, s, E5)
    return da8, da8.t().contiguous(), db8, db8.t().contiguous()


def bwd_dynamic(g, a, b, s, sink):
    da, db = swiglu_bwd(g, a, b)
    sa, sb = 57344.0 / full_amax(da).clamp(min=1e-12), 57344.0 / full_amax(db).clamp(min=1e-12)
    da8, db8 = cast(da, sa, E5), cast(db, sb, E5)
    return da8, da8.t().contiguous(), db8, db8.t().contiguous()


def time_ms(fn, *args, iters=50):
    for _ in range(3):
        fn(*args)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn(*args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main():
    T, H = 24576, 8192
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    g, a, b = (torch.randn(T, H, device=dev, dtype=torch.bfloat16) for _ in range(3))
    s = torch.tensor(100.0, device=dev)
    rows = []
    for name, fn in [("act: cast only", act_cast_only), ("act: cast + full amax", act_cast_full),
                     ("act: cast + row-then-full amax", act_cast_row), ("act: dynamic (amax, then cast)", act_dynamic)]:
        sink = torch.zeros((), device=dev)
        rows.append((name, time_ms(torch.compile(fn), x, s, sink)))
    for name, fn in [("swiglu bwd: cast only", bwd_cast_only), ("swiglu bwd: cast + full amax", bwd_cast_full),
                     ("swiglu bwd: cast + row-then-full amax", bwd_cast_row), ("swiglu bwd: dynamic", bwd_dynamic)]:
        sink = torch.zeros(2, device=dev)
        rows.append((name, time_ms(torch.compile(fn), g, a, b, s, sink)))
    print(f"\n{'function (24576 x 8192 bf16)':<40} {'ms':>7}")
    for name, ms in rows:
        print(f"{name:<40} {ms:>7.3f}")


if __name__ == "__main__":
    main()
