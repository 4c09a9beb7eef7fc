"""What checksumming a checkpoint's files costs: CRC-32 (what a manifest holds) against stronger hashes.

    python scripts/bench_checkpoint_hash.py [--gib 2] [--repeat 3] [--folder /tmp/titanlike-hash-bench]

Prints three tables:
  1. seconds per GiB of each hash over bytes in memory, in the 16 MiB chunks manifest.py reads;
  2. a whole save (checkpoint/writer.py StepWriter.write in the foreground: DCP's files written and
     fsynced, each file checksummed, the signed manifest, the rename) of the debug model with its AdamW
     moments, with the manifest's large-file checksum as it is (CRC-32) and as each candidate would
     make it, saves interleaved; and the checksums alone over the saved folder (what every load checks);
  3. the same for a synthetic checkpoint of --gib GiB of fp32 tensors.
The best of --repeat runs is kept (the machine may be shared). CPU only; nothing is downloaded.
xxh3_128 (the xxhash package) is measured where it is installed, as a point of reference: titanlike
does not depend on it, and it is no cryptographic hash.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CHUNK = 16 * 2**20  # manifest.py's read size


def hashers() -> dict[str, Callable[[], Callable[[bytes], None]]]:
    """name → a factory of an update function (the state kept in its closure)."""
    def crc32():
        state = [0]

        def update(b):
            state[0] = zlib.crc32(b, state[0])
        return update

    def of(factory):
        def make():
            return factory().update
        return make

    out = {"crc32 (zlib)": crc32, "blake2b": of(hashlib.blake2b), "blake2s": of(hashlib.blake2s),
           "sha256 (OpenSSL)": of(hashlib.sha256), "sha512 (OpenSSL)": of(hashlib.sha512)}
    try:
        import xxhash

        out["xxh3_128 (not a dependency)"] = of(xxhash.xxh3_128)
    except ImportError:
        pass
    return out


def per_gib(make: Callable, buffer: memoryview, repeat: int) -> float:
    """Seconds to hash 1 GiB of `buffer`'s bytes (reused), best of `repeat`."""
    best = float("inf")
    for _ in range(repeat):
        update = make()
        start = time.perf_counter()
        for _ in range(2**30 // len(buffer)):
            for i in range(0, len(buffer), CHUNK):
                update(buffer[i:i + CHUNK])
        best = min(best, time.perf_counter() - start)
    return best


def file_hash(make: Callable) -> Callable[[str], str]:
    """A file checksum in manifest.file_crc32's shape: the file read in CHUNK pieces."""
    def digest(path: str) -> str:
        update = make()
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                update(chunk)
        return "x"
    return digest


def folder_seconds(folder: str, digest: Callable[[str], str], repeat: int) -> float:
    names = sorted(n for n in os.listdir(folder) if os.path.isfile(os.path.join(folder, n)))
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for n in names:
            digest(os.path.join(folder, n))
        best = min(best, time.perf_counter() - start)
    return best


def debug_states() -> dict:
    """The debug model's weights and AdamW moments after one update, as a save holds them."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from titanlike.model.decoder import Transformer
    from titanlike.model.shape import model_args

    model = Transformer(model_args("debug"))
    model.init_weights(seed=0, seq_len=256)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)}


def synthetic_states(gib: float) -> dict:
    import torch

    n = int(gib * 2**30 // 4)
    per = 64 * 2**20  # 256 MiB tensors
    return {"model": {f"w{i}": torch.randn(min(per, n - i * per)) for i in range((n + per - 1) // per)}}


def saves(states: dict, root: Path, names: list[str], makes: dict, repeat: int) -> dict[str, float]:
    """Best whole-save seconds with the manifest's large-file checksum made by each of `names`."""
    from titanlike.checkpoint import manifest
    from titanlike.checkpoint.folder import StepFolders
    from titanlike.checkpoint.writer import StepWriter

    original = manifest.file_crc32
    best = dict.fromkeys(names, float("inf"))
    step = 0
    for _ in range(repeat):
        for name in names:  # interleaved: a drift of the machine's load falls on every variant alike
            manifest.file_crc32 = original if name.startswith("crc32") else file_hash(makes[name])
            folder = root / "ckpt"
            shutil.rmtree(folder, ignore_errors=True)
            writer = StepWriter(StepFolders(str(folder), True), keep_latest_k=0, pinned=False, rank=0, world=1,
                                group=None, save_group=None, cuda=False, eight_bit=False)
            os.makedirs(folder)
            step += 1
            start = time.perf_counter()
            writer.write(step, states, {"trainer_state.json": {"step": step}}, background=False)
            best[name] = min(best[name], time.perf_counter() - start)
    manifest.file_crc32 = original
    return best


def report(title: str, states: dict, root: Path, makes: dict, repeat: int) -> None:
    from titanlike.checkpoint.writer import tensor_bytes

    size = tensor_bytes(states) / 2**20
    names = list(makes)
    whole = saves(states, root, names, makes, repeat)
    step = max(int(n.split("-")[1]) for n in os.listdir(root / "ckpt") if n.startswith("step-"))
    folder = str(root / "ckpt" / f"step-{step}")  # the last save: its files, in the page cache as after a save
    alone = {name: folder_seconds(folder, file_hash(make), repeat) for name, make in makes.items()}
    base = whole[names[0]]
    print(f"\n{title}: {size:,.0f} MiB of tensors; a save with CRC-32 {base:.3f} s\n")
    print("| hash | whole save, s | against CRC-32 | checksums alone, s | share of the CRC-32 save |")
    print("|---|---:|---:|---:|---:|")
    for name in names:
        print(f"| {name} | {whole[name]:.3f} | {whole[name] / base - 1:+.1%} | {alone[name]:.3f} | "
              f"{alone[name] / base:.1%} |")


def checkpoint_bench_arguments(doc: str) -> argparse.Namespace:
    """The options of a checkpoint benchmark: --gib, --repeat, --folder."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=2.0, help="the synthetic checkpoint's size (default 2)")
    p.add_argument("--repeat", type=int, default=3, help="runs of each measurement; the best is kept (default 3)")
    p.add_argument("--folder", default="", help="where the checkpoints are written (default: a new folder in /tmp)")
    return p.parse_args()


def checkpoint_bench_root(folder: str, prefix: str) -> Path:
    """Where a benchmark writes its checkpoints (`folder`, or a new one in /tmp), with a throwaway signing key
    for their manifests; torch on one thread, as a save's own work is."""
    import torch

    torch.set_num_threads(1)
    root = Path(folder or tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    root.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("XDG_CONFIG_HOME", str(root / "config"))
    return root


def main() -> None:
    a = checkpoint_bench_arguments(__doc__)
    import numpy as np
    import torch

    root = checkpoint_bench_root(a.folder, "titanlike-hash-bench-")
    makes = hashers()
    print(f"python {sys.version.split()[0]}, zlib {zlib.ZLIB_RUNTIME_VERSION}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPU(s), checkpoints in {root}")
    buffer = memoryview(np.random.default_rng(0).integers(0, 256, 256 * 2**20, dtype=np.uint8).tobytes())
    print("\n| hash | s per GiB (in memory) | GiB/s | against CRC-32 |")
    print("|---|---:|---:|---:|")
    base = None
    for name, make in makes.items():
        s = per_gib(make, buffer, a.repeat)
        base = base or s
        print(f"| {name} | {s:.3f} | {1 / s:.2f} | {s / base:.2f}× |")
    del buffer
    try:
        report("debug model + AdamW moments", debug_states(), root, makes, a.repeat)
        report(f"synthetic {a.gib:g} GiB", synthetic_states(a.gib), root, makes, a.repeat)
    finally:
        if not a.folder:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
