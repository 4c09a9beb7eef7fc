"""What this machine has, read without torch (the preflight runs before any worker): its CPU cores,
the memory its host can give, and whether a CUDA GPU is visible at all."""

from __future__ import annotations

import glob
import os
from typing import Any


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


def runs_on_cpu(cfg: Any) -> bool:
    """A run that trains on the CPU: training.device = cpu, or auto with no GPU visible."""
    return cfg.training.device == "cpu" or (cfg.training.device == "auto" and not gpu_visible())
