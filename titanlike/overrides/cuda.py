"""The CUDA caching allocator's history, for profiling.memory_snapshot (not switched: torch offers it only
under these private names, which its own memory-snapshot guide uses)."""

from __future__ import annotations

import torch


def memory_history_problem() -> str | None:
    """Why the allocator's history cannot be recorded on this torch, or None."""
    missing = [n for n in ("_record_memory_history", "_dump_snapshot") if not hasattr(torch.cuda.memory, n)]
    return f"torch.cuda.memory has no {', '.join(missing)}" if missing else None


def record_memory_history(max_entries: int) -> None:
    torch.cuda.memory._record_memory_history(max_entries=max_entries)


def stop_memory_history() -> None:
    torch.cuda.memory._record_memory_history(enabled=None)


def dump_memory_snapshot(path: str) -> None:
    torch.cuda.memory._dump_snapshot(path)
