"""FSDP2's reduce-scatter with its gradients in the compute stream's memory (the package docstring says how
overrides are chosen and probed). FSDP's `set_custom_reduce_scatter` is public but experimental, and this
relies on how FSDP uses it: that it allocates the reduce-scatter's output through the custom
collective's `allocate`, on the reduce-scatter stream."""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist

from titanlike.overrides import probe_for, version_outside


@probe_for("gradients_in_compute_pool")
def probe_gradients_in_compute_pool() -> str | None:
    from torch.distributed.fsdp import FSDPModule

    setter = getattr(FSDPModule, "set_custom_reduce_scatter", None)
    if setter is None:
        return "FSDP takes no custom reduce-scatter"
    if list(inspect.signature(setter).parameters) != ["self", "comm"]:
        return f"FSDP's set_custom_reduce_scatter takes {inspect.signature(setter)}, not (self, comm)"
    return version_outside(torch.__version__, (2, 11), (2, 14))


class GradientsInComputePool:
    """FSDP2's reduce-scatter, with its output (which becomes the sharded gradients) allocated from the
    compute stream's memory instead of the reduce-scatter stream's.

    The caching allocator keeps the memory of each stream apart. FSDP reduce-scatters on a stream of
    its own, so the gradients (an fp32 shard of every weight: 15 GiB a GPU for 8b on two GPUs) come
    from a pool that the activations backward frees can never refill: the peak held both. From the
    compute stream's pool they reuse that memory. Two rules keep it safe: the reduce-scatter stream
    waits for the compute stream's work queued so far (the block may have been freed by a kernel
    still queued there), and the block records the reduce-scatter stream (not reused before the
    reduce-scatter's own work on it is done)."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        current, compute = torch.cuda.current_stream(device), torch.cuda.default_stream(device)
        if current == compute:  # FSDP's input buffer, filled on the compute stream
            return torch.empty(*size, dtype=dtype, device=device)
        with torch.cuda.stream(compute):
            out = torch.empty(*size, dtype=dtype, device=device)
        current.wait_stream(compute)
        out.record_stream(current)
        return out

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op, async_op: bool = False):
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def gradients_in_compute_pool(modules: list) -> None:
    """Every FSDP module of `modules` reduce-scatters through one GradientsInComputePool."""
    comm = GradientsInComputePool()
    for module in modules:
        module.set_custom_reduce_scatter(comm)
