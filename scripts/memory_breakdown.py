"""Where a run's GPU memory was at its peak: a CUDA memory snapshot (`--profiling.memory_snapshot`)
replayed to the moment the most was allocated, every live block named by the code that allocated it.

    python scripts/memory_breakdown.py RUN/profile/step-2/rank0_memory_snapshot.pickle [--top 30]

The allocator's history (every alloc and free, with the Python stack) is replayed from the end backwards
to the first recorded event, then forwards to the peak. A block is named by the innermost frame in
titanlike's own code, and where a compiled graph allocated it, by the graph's line and the source nodes
inductor wrote above it (`# Topologically Sorted Source Nodes: [...]`), read from the generated file when
it is still on disk. Blocks allocated before the history began are "before the history".
"""

from __future__ import annotations

import argparse
import os
import pickle
import re
from collections import defaultdict

GIB = 1024**3
GENERATED = re.compile(r"^c[a-z0-9]{20,}\.py$")  # inductor's generated modules: c<hash>.py in its cache
SOURCE_NODES = re.compile(r"#\s*(?:Topologically Sorted )?Source Nodes?:\s*\[([^\]]*)\]")


def _generated_source(filename: str, line: int, cache: dict) -> str | None:
    """The source nodes inductor noted above `line` of its generated file, if it is on disk."""
    if filename not in cache:
        try:
            with open(filename) as f:
                cache[filename] = f.read().splitlines()
        except OSError:
            cache[filename] = None
    lines = cache[filename]
    if not lines:
        return None
    for i in range(min(line, len(lines)) - 1, max(0, line - 60), -1):
        found = SOURCE_NODES.search(lines[i])
        if found:
            return found.group(1)[:80]
    return None


def site(frames: list[dict], cache: dict) -> str:
    """A short name for where a block was allocated."""
    ours = next((f for f in frames if "/titanlike/" in f["filename"]), None)
    generated = next((f for f in frames if GENERATED.match(os.path.basename(f["filename"]))), None)
    words = []
    if ours is not None:
        words.append(f"{ours['filename'].split('/titanlike/')[-1]}:{ours['line']} {ours['name']}")
    if generated is not None:
        nodes = _generated_source(generated["filename"], generated["line"], cache)
        words.append(f"compiled[{nodes}]" if nodes else f"compiled {generated['name']}")
    if not words:
        inner = frames[0] if frames else None
        words.append(f"{os.path.basename(inner['filename'])}:{inner['line']} {inner['name']}" if inner else "?")
    return " · ".join(words)


def replay(snapshot: dict, device: int) -> tuple[int, dict[int, tuple[int, list]], int, dict | None]:
    """(peak allocated bytes, the blocks live at the peak {addr: (size, frames)}, allocated at the dump, the
    event that reached the peak)."""
    trace = snapshot["device_traces"][device]
    live: dict[int, tuple[int, list]] = {}
    for seg in snapshot["segments"]:
        if seg.get("device", device) != device:
            continue
        for block in seg["blocks"]:
            if block["state"] == "active_allocated":
                live[block["address"]] = (block["size"], block.get("frames", []))
    at_dump = sum(size for size, _ in live.values())
    # Backwards to the first recorded event: what was live before the history.
    before = dict(live)
    for event in reversed(trace):
        if event["action"] == "alloc":
            before.pop(event["addr"], None)
        elif event["action"] == "free_completed":
            before[event["addr"]] = (event["size"], [])
    # Forwards to the peak.
    current = dict(before)
    total = sum(size for size, _ in current.values())
    peak, peak_index = total, -1
    for i, event in enumerate(trace):
        if event["action"] == "alloc":
            current[event["addr"]] = (event["size"], event.get("frames", []))
            total += event["size"]
            if total > peak:
                peak, peak_index = total, i
        elif event["action"] == "free_completed" and event["addr"] in current:
            total -= current.pop(event["addr"])[0]
    current = dict(before)
    for event in trace[:peak_index + 1]:
        if event["action"] == "alloc":
            current[event["addr"]] = (event["size"], event.get("frames", []))
        elif event["action"] == "free_completed":
            current.pop(event["addr"], None)
    return peak, current, at_dump, trace[peak_index] if peak_index >= 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("snapshot")
    parser.add_argument("--device", type=int, default=0, help="the CUDA device whose trace to replay")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    with open(args.snapshot, "rb") as f:
        snapshot = pickle.load(f)
    device = args.device if len(snapshot["device_traces"]) > args.device else 0
    peak, blocks, at_dump, peak_event = replay(snapshot, device)
    reserved = sum(s["total_size"] for s in snapshot["segments"] if s.get("device", device) == device)
    cache: dict = {}
    by_site: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, frames in blocks.values():
        name = site(frames, cache) if frames else "before the history"
        by_site[name][0] += size
        by_site[name][1] += 1
    print(f"peak allocated {peak / GIB:.2f} GiB ({len(blocks)} blocks); at the dump: allocated {at_dump / GIB:.2f}, "
          f"reserved {reserved / GIB:.2f} GiB")
    if peak_event is not None:
        print(f"the peak was reached allocating {peak_event['size'] / GIB:.3f} GiB at "
              f"{site(peak_event.get('frames', []), cache)}")
    print("\n| where it was allocated | GiB at the peak | blocks |\n|---|---:|---:|")
    rows = sorted(by_site.items(), key=lambda kv: -kv[1][0])
    for name, (size, count) in rows[:args.top]:
        print(f"| {name} | {size / GIB:.2f} | {count} |")
    rest = rows[args.top:]
    if rest:
        print(f"| ({len(rest)} more sites) | {sum(r[1][0] for r in rest) / GIB:.2f} | {sum(r[1][1] for r in rest)} |")


if __name__ == "__main__":
    main()
