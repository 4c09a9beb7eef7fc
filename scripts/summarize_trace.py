"""Top GPU kernels of a torch.profiler chrome trace: total time, share, calls, grouped by kind, and
where the recorded steps' time went on the GPU timeline (compute, idle, exposed communication).

    python scripts/summarize_trace.py outputs/run/profile/step-10/rank0_trace.json [--top 25]
    python scripts/summarize_trace.py two_gpus/rank0_trace.json --against one_gpu/rank0_trace.json

--against prints, kernel by kernel, what the first trace spends more or less than the second (per
step): e.g. what FSDP adds to a step, or what a change did to each kernel. --against-scale 0.5 halves
the second's times first: one cp 2 rank against half of one GPU's step over the whole window.

--gaps prints what the compute kernels waited for, gap by gap (over 50 µs): the CPU, when the kernel
after the gap was launched just before it ran (the GPU had nothing queued); a collective, when one ran
through the gap (named by its collective and the kernel that waited for it); else "a stream wait".

--launched-by TEXT prints, for the kernels whose name holds TEXT, the CPU ops they were launched from
(outermost to innermost, the innermost with its input shapes when the trace recorded them): which
copy, say, is the one that costs 7 ms a step.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict


def kind(name: str) -> str:
    n = name.lower()
    if "nccl" in n:
        return "communication"
    if any(k in n for k in ("flash", "fmha", "attention", "sdpa")):  # before matmul: these use wgmma too
        return "attention"
    if "triton" in n:  # inductor's fusions (a fused name may mention scaled_mm: it is the cast around it)
        return "fused (triton)"
    if any(k in n for k in ("gemm", "sm90_xmma", "cutlass", "matmul", "nvjet", "wgmma")):
        return "matmul"
    if "optimizer" in n or "multi_tensor_apply" in n:
        return "optimizer"
    if "memcpy" in n or "memset" in n:
        return "memory"
    return "other"


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def timeline(kernels: list[dict], windows: list[tuple[float, float]]) -> None:
    """Where the recorded steps' wall time on the GPU went: kernels summed over streams overstate a
    step when streams overlap (communication beside compute), so measure unions of intervals."""
    span = sum(b - a for a, b in windows)

    def spans(ks):
        return [(e["ts"], e["ts"] + e["dur"]) for e in ks]

    comm = [e for e in kernels if kind(e["name"]) == "communication"]
    compute = [e for e in kernels if kind(e["name"]) != "communication"]
    busy, compute_busy = union_us(spans(kernels)), union_us(spans(compute))
    steps = len(windows)
    print(f"\nper step on the GPU timeline: {span / 1e3 / steps:.1f} ms wall, compute kernels busy "
          f"{compute_busy / 1e3 / steps:.1f} ms, idle (no kernel at all) {(span - busy) / 1e3 / steps:.1f} ms")
    if comm:
        print(f"communication {union_us(spans(comm)) / 1e3 / steps:.1f} ms, of which exposed (no compute "
              f"beside it) {(busy - compute_busy) / 1e3 / steps:.1f} ms")


def read_events(path: str) -> list[dict]:
    """A trace's events (a profiled step's trace is large: read it once)."""
    with open(path) as f:
        return json.load(f)["traceEvents"]


def load(path: str, events: list[dict] | None = None) -> tuple[list[dict], list[tuple[float, float]]]:
    """The GPU kernels of a trace's recorded steps, and those steps' spans on the GPU timeline."""
    events = read_events(path) if events is None else events
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    if not kernels:
        raise SystemExit(f"error: no GPU kernels in {path} (was it recorded on a GPU?)")
    # The CPU runs ahead of the GPU, so a trace also holds kernels of the step before the recorded
    # one; keep those inside the recorded steps' span on the GPU timeline.
    windows = [(e["ts"], e["ts"] + e["dur"]) for e in events
               if e.get("cat") == "gpu_user_annotation" and str(e.get("name", "")).startswith("ProfilerStep")]
    if windows:
        kernels = [e for e in kernels if any(a <= e["ts"] < b for a, b in windows)]
    return kernels, windows


GAP_US = 50  # shorter gaps are launch latency, not waiting
CPU_LATE_US = 30  # a kernel that started this soon after its launch returned was waiting for the CPU


def gaps(events: list[dict], kernels: list[dict], steps: int, top: int) -> None:
    """Each gap over GAP_US in the compute kernels of the recorded steps, by what it waited for."""
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    comm = [e for e in kernels if kind(e["name"]) == "communication"]
    compute = sorted((e for e in kernels if kind(e["name"]) != "communication"), key=lambda e: e["ts"])
    waits: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    end = compute[0]["ts"] + compute[0]["dur"] if compute else 0.0
    for e in compute[1:]:
        gap = e["ts"] - end
        if gap > GAP_US:
            launch = launches.get(e.get("args", {}).get("correlation"))
            running = [c for c in comm if c["ts"] < e["ts"] and c["ts"] + c["dur"] > end]
            if launch is not None and e["ts"] - (launch["ts"] + launch.get("dur", 0)) < CPU_LATE_US:
                cause = "the CPU"
            elif running:
                cause = running[0].get("args", {}).get("Collective name") or stable_name(running[0]["name"])[:40]
            else:
                cause = "a stream wait"
            row = waits[f"{cause:<32} before {stable_name(e['name'])[:70]}"]
            row[0] += gap
            row[1] += 1
        end = max(end, e["ts"] + e["dur"])
    total = sum(us for us, _ in waits.values())
    print(f"\ncompute kernels waiting (gaps over {GAP_US} µs): {total / 1e3 / steps:.1f} ms per step")
    print(f"{'ms/step':>9} {'gaps':>5}  waited for")
    for what, (us, count) in sorted(waits.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{us / 1e3 / steps:>9.2f} {count // steps:>5}  {what}")


def launched_by(events: list[dict], kernels: list[dict], steps: int, texts: list[str], top: int) -> None:
    """For each of `texts`, the kernels whose name holds it, grouped by the chain of CPU ops that launched
    them."""
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    ops: dict[tuple, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation") and "dur" in e:
            ops[(e["pid"], e["tid"])].append(e)

    def chain(kernel: dict) -> str:
        launch = launches.get(kernel.get("args", {}).get("correlation"))
        if launch is None:
            return "(its launch is not in the trace)"
        start, end = launch["ts"], launch["ts"] + launch.get("dur", 0)
        around = sorted((o for o in ops[(launch["pid"], launch["tid"])]
                         if o["ts"] <= start and o["ts"] + o["dur"] >= end), key=lambda o: (o["ts"], -o["dur"]))
        if not around:
            return "(no CPU op around its launch)"
        dims = around[-1].get("args", {}).get("Input Dims")
        return " > ".join(str(o["name"])[:60] for o in around[-4:]) + (f" {dims}" if dims else "")

    for text in texts:
        rows: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        for k in kernels:
            if text in k["name"]:
                row = rows[chain(k)]
                row[0] += k["dur"]
                row[1] += 1
        total = sum(us for us, _ in rows.values())
        print(f"\nkernels holding {text!r}: {total / 1e3 / steps:.2f} ms per step, by the CPU ops that launched them")
        print(f"{'ms/step':>9} {'calls':>5}  launched from")
        for name, (us, count) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:top]:
            print(f"{us / 1e3 / steps:>9.2f} {count // steps:>5}  {name}")


def stable_name(name: str) -> str:
    # Inductor numbers its kernels per graph (..._view_4 here, ..._view_3 there): drop the number
    # so that the same fusion in two traces compares.
    return re.sub(r"_\d+$", "", name) if name.startswith("triton_") else name


def per_step(kernels: list[dict], steps: int) -> dict[str, tuple[float, int]]:
    """stable kernel name -> (ms per step, calls per step)."""
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in kernels:
        row = out[stable_name(e["name"])]
        row[0] += e["dur"] / 1e3 / steps
        row[1] += 1
    return {name: (ms, int(calls) // steps) for name, (ms, calls) in out.items()}


def compare(kernels: list[dict], steps: int, other_path: str, top: int, scale: float = 1.0) -> None:
    other, other_windows = load(other_path)
    mine = per_step(kernels, steps)
    theirs = {n: (ms * scale, calls) for n, (ms, calls) in per_step(other, max(1, len(other_windows))).items()}
    rows = [(mine.get(n, (0.0, 0))[0] - theirs.get(n, (0.0, 0))[0], n) for n in set(mine) | set(theirs)]
    total = sum(ms for ms, _ in mine.values()) - sum(ms for ms, _ in theirs.values())
    times = f" × {scale:g}" if scale != 1 else ""
    print(f"\nagainst {other_path}{times}: {total:+.2f} ms of GPU time per step")
    print(f"{'ms/step':>9} {'this':>8} {'calls':>5} {'other':>8} {'calls':>5}  kernel")
    for diff, name in sorted(rows, key=lambda r: -abs(r[0]))[:top]:
        (a, ac), (b, bc) = mine.get(name, (0.0, 0)), theirs.get(name, (0.0, 0))
        print(f"{diff:>+9.2f} {a:>8.2f} {ac:>5} {b:>8.2f} {bc:>5}  {name[:100]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--against", default="", help="another trace: print the per-kernel differences")
    p.add_argument("--against-scale", type=float, default=1.0, metavar="X",
                   help="multiply the other trace's times by X: 0.5 sets one cp 2 rank against half of one GPU's step")
    p.add_argument("--gaps", action="store_true", help="print what the compute kernels waited for, gap by gap")
    p.add_argument("--launched-by", action="append", default=[], metavar="TEXT",
                   help="print the CPU ops that launched the kernels whose name holds TEXT (may repeat)")
    args = p.parse_args()
    events = read_events(args.trace)
    kernels, windows = load(args.trace, events)
    total = sum(e["dur"] for e in kernels)
    by_kind: dict[str, float] = defaultdict(float)
    for e in kernels:
        by_kind[kind(e["name"])] += e["dur"]
    steps = max(1, len(windows))
    print(f"{len(kernels)} kernels, {total / 1e3:.1f} ms of GPU time over {steps} profiled step(s)\n")
    print(f"{'kind':<16} {'ms/step':>9} {'share':>6}")
    for k, us in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"{k:<16} {us / 1e3 / steps:>9.2f} {us / total:>6.1%}")
    if windows:
        timeline(kernels, windows)
    print(f"\n{'ms/step':>9} {'share':>6} {'calls':>6}  kernel")
    for name, (ms, calls) in sorted(per_step(kernels, steps).items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"{ms:>9.2f} {ms * 1e3 * steps / total:>6.1%} {calls:>6}  {name[:110]}")
    if args.against:
        compare(kernels, steps, args.against, args.top, args.against_scale)
    if args.gaps:
        gaps(events, kernels, steps, args.top)
    if args.launched_by:
        launched_by(events, kernels, steps, args.launched_by, args.top)


if __name__ == "__main__":
    main()
