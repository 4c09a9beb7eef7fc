"""Host copies of a checkpoint's tensors for a background save ("staging").

A background save first copies every tensor to host memory; training goes on while a thread writes
the copy. `HostCopyStager` makes that copy for checkpoint.async_mode = async_with_pinned_mem (and for
8-bit optimizer state in any background mode), for two reasons:

- DCP's own stager copies each tensor with `new_empty` and `copy_`, which torchao's 8-bit optimizer
  state (`OptimState8bit`: uint8 codes, block scales and a lookup table behind one tensor) does not
  implement. `host_copy` goes through the tensor-subclass protocol instead: a wrapper subclass
  (8-bit state, a DTensor around it) is taken apart into its inner tensors, each inner tensor is
  copied, and the wrapper is rebuilt around the copies. The copy is what a foreground save writes
  (the same classes, the same bytes), so the files, and a resume from them, do not depend on how the
  save was made.
- DCP's pinned-memory stager fails on its second save under torch 2.11 (`KeyError: <class 'type'>`
  inside its deep copy; measured on one H100, docs/benchmarks/2026-11-24-gpu-test-tier.md).

On a GPU the copies go into pinned host buffers kept from one save to the next (allocating them is
what is slow: on one H100 the first `1b` 8-bit save stalled 5.1 s, the next 0.21 s,
docs/benchmarks/2026-11-23-one-gpu-measure-memory-124m-levers.md), on a side stream that starts
after the step that produced the tensors; `stage` returns at once with a future that completes when
the copies have landed. The next forward and backward overlap the copy; only the next optimizer
step, which overwrites the tensors, must wait for it (the checkpointer's staging future).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from titanlike.overrides.dtensor import with_local


def host_copy(value: Any, buffers: dict[str, torch.Tensor] | None = None, key: str = "") -> Any:
    """`value` with every tensor in it copied to host memory (dicts and lists walked); other values
    as they are. With `buffers`, tensors on a GPU are copied into pinned host buffers kept there by
    their place in `value` (`key`) and reused by the next call, without waiting (non-blocking): the
    caller synchronizes before using the copy."""
    if isinstance(value, dict):
        return {k: host_copy(v, buffers, f"{key}/{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [host_copy(v, buffers, f"{key}/{i}") for i, v in enumerate(value)]
    if isinstance(value, DTensor):
        # Its placement stays; only the local shard moves (titanlike/overrides/dtensor.py says why).
        return with_local(value, host_copy(value.to_local(), buffers, key))
    if isinstance(value, torch.Tensor) and type(value) is not torch.Tensor and hasattr(value, "__tensor_flatten__"):
        names, context = value.__tensor_flatten__()
        inner = {name: host_copy(getattr(value, name), buffers, f"{key}.{name}") for name in names}
        return type(value).__tensor_unflatten__(inner, context, value.shape, value.stride())  # type: ignore[attr-defined]
    if isinstance(value, torch.Tensor):
        if buffers is None or value.device.type != "cuda":
            return value.detach().to("cpu", copy=True)
        buffer = buffers.get(key)
        if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
            buffer = buffers[key] = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
        return buffer.copy_(value.detach(), non_blocking=True)
    return value


def _on_cuda(value: Any) -> bool:
    if isinstance(value, dict):
        return any(_on_cuda(v) for v in value.values())
    if isinstance(value, list):
        return any(_on_cuda(v) for v in value)
    return isinstance(value, torch.Tensor) and value.device.type == "cuda"


class HostCopyStager:
    """A `dcp.async_save` stager (torch's AsyncStager protocol) that stages with `host_copy`: into
    pinned buffers kept between saves if `pinned` (one save is in flight at a time, so a buffer is
    free again when the next save starts), asynchronously for tensors on a GPU."""

    # stage() hands DCP a future that completes when the copies have landed; DCP's upload waits for it.
    _synchronize_after_execute = False

    def __init__(self, pinned: bool = False):
        self.buffers: dict[str, torch.Tensor] | None = {} if pinned else None
        self._stream: torch.cuda.Stream | None = None

    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._synchronize_after_execute

    def stage(self, state_dict: dict) -> dict | Future:
        if not (self.buffers is not None and torch.cuda.is_available() and _on_cuda(state_dict)):
            return host_copy(state_dict, self.buffers)  # plain host memory: each copy completes before it returns
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        # The copies start once the work queued so far (the step that produced these tensors) is done.
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            staged = host_copy(state_dict, self.buffers)
            landed = torch.cuda.Event()
            landed.record(self._stream)
        future: Future = Future()

        def complete() -> None:
            try:
                landed.synchronize()
                future.set_result(staged)
            except BaseException as e:  # a CUDA error: the save fails with it, training is told
                future.set_exception(e)

        threading.Thread(target=complete, name="checkpoint-staging", daemon=True).start()
        return future

    def synchronize_staging(self) -> None:
        pass  # the future stage() returns is what to wait for

    def close(self) -> None:
        self.buffers = {} if self.buffers is not None else None
