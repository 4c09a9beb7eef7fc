"""Host copies of a checkpoint's tensors for a background save whose state DCP cannot copy itself.

A background save first copies every tensor to host memory ("staging"); training goes on while a
thread writes the copy. DCP's own stager makes each copy with `new_empty` and `copy_`, which
torchao's 8-bit optimizer state (`OptimState8bit`: uint8 codes, block scales and a lookup table
behind one tensor) does not implement, so 8-bit moments were saved in the foreground: 17-23 s per
`1b` save on one H100 (docs/benchmarks/2026-11-23-one-gpu-measure-memory-124m-levers.md).

`HostCopyStager` copies through the tensor-subclass protocol instead: a wrapper subclass (8-bit state,
a DTensor around it) is taken apart into its inner tensors, each inner tensor is copied, and the
wrapper is rebuilt around the copies. The copy is what a foreground save writes (the same classes,
the same bytes), so the files, and a resume from them, do not depend on how the save was made.
Staging is synchronous: the training waits for the device-to-host copy, not for the disk. With
checkpoint.async_mode = async_with_pinned_mem the copy goes into pinned host buffers kept from one
save to the next, as DCP's pinned stager does for plain tensors.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor


def host_copy(value: Any, buffers: dict[str, torch.Tensor] | None = None, key: str = "") -> Any:
    """`value` with every tensor in it copied to host memory (dicts and lists walked); other values
    as they are. With `buffers`, tensors on a GPU are copied into pinned host buffers kept there by
    their place in `value` (`key`) and reused by the next call, because allocating them is what is slow:
    on one H100 the first `1b` 8-bit save stalled 5.1 s, the next 0.21 s (docs/benchmarks/
    2026-11-23-one-gpu-measure-memory-124m-levers.md). The caller synchronizes before using the copy."""
    if isinstance(value, dict):
        return {k: host_copy(v, buffers, f"{key}/{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [host_copy(v, buffers, f"{key}/{i}") for i, v in enumerate(value)]
    if isinstance(value, DTensor):
        # Its placement (spec) stays; only the local shard moves. DTensor.from_local would move the
        # shard back to the mesh's device.
        return DTensor(host_copy(value._local_tensor, buffers, key), value._spec, requires_grad=False)
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


class HostCopyStager:
    """A `dcp.async_save` stager (torch's AsyncStager protocol) that stages with `host_copy`, into
    pinned buffers kept between saves if `pinned` (one save is in flight at a time, so a buffer is
    free again when the next save starts)."""

    # stage() returns the finished copy: there is nothing to wait for after the upload starts.
    _synchronize_after_execute = False

    def __init__(self, pinned: bool = False):
        self.buffers: dict[str, torch.Tensor] | None = {} if pinned else None

    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._synchronize_after_execute

    def stage(self, state_dict: dict) -> dict:
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()  # the step that produced these tensors has finished
        staged = host_copy(state_dict, self.buffers)
        if cuda:
            torch.cuda.synchronize()  # the non-blocking copies into pinned buffers have landed
        return staged

    def synchronize_staging(self) -> None:
        pass  # staging completed inside stage()

    def close(self) -> None:
        self.buffers = {} if self.buffers is not None else None
