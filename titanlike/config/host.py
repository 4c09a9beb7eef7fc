"""What this machine has, read without torch (the preflight runs before any worker): its CPU cores,
the memory its host can give, and whether a CUDA GPU is visible at all."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def host_available_bytes(meminfo: str = "/proc/meminfo") -> int:
    """Memory the host can give without swapping: MemAvailable, or all physical memory where the
    kernel does not say (not Linux)."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def gpu_visible() -> bool:
    """Whether a CUDA GPU could be visible to this process, as far as the machine says without torch:
    an NVIDIA device file, and CUDA_VISIBLE_DEVICES not hiding every one."""
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if hidden is not None and hidden.strip() in ("", "-1"):
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def smallest_gpu(timeout_s: float = 10.0) -> tuple[str, float] | None:
    """(name, memory in GiB) of the smallest GPU this process may use, from nvidia-smi (torch would start
    CUDA in the launcher), or None where it cannot say."""
    smi = shutil.which("nvidia-smi")
    if smi is None or not gpu_visible():
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=timeout_s, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    wanted = {i.strip() for i in visible.split(",")} if visible else None
    cards = []
    for line in out.strip().splitlines():
        parts = [part.strip() for part in line.split(",")]
        if len(parts) != 3 or not parts[2].isdigit() or (wanted is not None and parts[0] not in wanted):
            continue
        cards.append((parts[1], int(parts[2]) / 1024))
    return min(cards, key=lambda card: card[1]) if cards else None


def runs_on_cpu(device: str) -> bool:
    """Whether a run whose training.device is `device` trains on the CPU: cpu, or auto with no GPU visible."""
    return device == "cpu" or (device == "auto" and not gpu_visible())
