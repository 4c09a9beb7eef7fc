"""FSDP2 internals titanlike overrides (the package docstring says how overrides are chosen and probed)."""

from __future__ import annotations

import inspect

import torch

from titanlike.overrides import version_outside


def probe_reduce_scatter_frees_input() -> str | None:
    from torch.distributed.fsdp import FSDPModule

    if not hasattr(FSDPModule, "set_custom_reduce_scatter"):
        return "this FSDP takes no custom reduce-scatter"
    return version_outside(torch.__version__, (2, 11), (2, 14))


def free_reduce_scatter_input(input_tensor: torch.Tensor) -> None:
    """Give back FSDP's reduce-scatter input (one module's unsharded fp32 gradients) as soon as a
    synchronous collective on it is queued, where FSDP would hold it until the next module's
    reduce-scatter: through that module's whole backward (the output layer's is 2 GiB on 8b, held
    through the last block's backward, at the peak). Safe because the calling stream has waited for
    the collective, the block records that stream (reused only once the collective is done), and FSDP
    never reads the input after the call (checked in the versions OVERRIDES names)."""
    input_tensor.record_stream(torch.cuda.current_stream(input_tensor.device))
    input_tensor.untyped_storage().resize_(0)


def probe_gathers_on_compute_stream() -> str | None:
    from torch.distributed.fsdp import FSDPModule

    setter = getattr(FSDPModule, "_set_unshard_async_op", None)
    if setter is None:
        return "FSDP has no _set_unshard_async_op"
    if list(inspect.signature(setter).parameters) != ["self", "async_op"]:
        return f"FSDP's _set_unshard_async_op takes {inspect.signature(setter)}, not (self, async_op)"
    return version_outside(torch.__version__, (2, 11), (2, 14))


def gather_on_compute_stream(module) -> None:
    """FSDP gathers `module`'s weights into memory from the compute stream's pool, and frees it as soon
    as they are copied out (FSDP's async unshard). By default FSDP gathers every module from a side
    stream's pool and keeps each gathered buffer until the next module's gather is done; the
    embedding and the output layer are a vocabulary × dim matrix each (1 GiB in bf16 on 8b, where a
    block gathers 0.2 GiB in float8), and the side pool grew to fit one more of those beside the
    blocks' buffers. The cast of their shard to bf16 then runs on the compute stream too."""
    module._set_unshard_async_op(async_op=True)
