"""What a background save costs the training thread when it is published: one table.

    python scripts/bench_save_stall.py [--gib 2] [--repeat 3] [--folder /tmp/titanlike-stall-bench]

A background save (checkpoint.async_mode = async) writes its files in DCP's thread; at a later step the
training thread publishes it: every rank's checksums gathered, the signed manifest, the rename. The table
times that publish for a synthetic checkpoint of --gib GiB of fp32 tensors (and the debug model's 38 MiB),
once the files are written, with the checksums made in the writer's thread as soon as the files are
written (as titanlike does), and with the checksums made at the publish itself (reading every file back
on the training thread). The best of --repeat runs is kept. CPU only; nothing is downloaded.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_checkpoint_hash import (  # noqa: E402
    checkpoint_bench_arguments,
    checkpoint_bench_root,
    debug_states,
    synthetic_states,
)


def stall(states: dict, root: Path, checksums_at_publish: bool, repeat: int) -> float:
    """Best seconds of the publish of a background save whose files are written."""
    from titanlike.checkpoint.folder import StepFolders
    from titanlike.checkpoint.writer import StepWriter

    best = float("inf")
    for step in range(1, repeat + 1):
        folder = root / "ckpt"
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        writer = StepWriter(StepFolders(str(folder), True), keep_latest_k=0, pinned=False, rank=0, world=1,
                            group=None, save_group=None, cuda=False, eight_bit=False)
        writer.write(step, states, {"trainer_state.json": {"step": step}}, background=True)
        assert writer.pending is not None
        writer.pending[1].result()  # written (and checksummed, titanlike's way): the save has landed
        start = time.perf_counter()
        if checksums_at_publish:
            writer.pending = None
            writer._publish(step)  # the checksums read back here, on the training thread
        else:
            writer.wait_and_publish()
        best = min(best, time.perf_counter() - start)
        writer.close()
        assert (folder / f"step-{step}").is_dir()
    return best


def main() -> None:
    a = checkpoint_bench_arguments(__doc__)
    import torch

    root = checkpoint_bench_root(a.folder, "titanlike-stall-bench-")
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, {os.cpu_count()} CPU(s), checkpoints in {root}")
    print("\n| checkpoint | publish, checksums made at it (s) | publish, checksums made in the writer's thread (s) |")
    print("|---|---:|---:|")
    try:
        for title, states in (("debug model + AdamW moments", debug_states()),
                              (f"synthetic {a.gib:g} GiB", synthetic_states(a.gib))):
            at_publish = stall(states, root, True, a.repeat)
            background = stall(states, root, False, a.repeat)
            print(f"| {title} | {at_publish:.3f} | {background:.3f} |")
    finally:
        if not a.folder:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
