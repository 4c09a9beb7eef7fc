"""Private attention ops titanlike calls (the package docstring says how overrides are chosen and probed).

Context parallelism's causal attention (parallel/chunk_attention.py) runs on fused kernels that
return the log-sum-exp SDPA keeps to itself. Every call is by keyword, so that a reordered signature fails loudly in
the probe (and in tests/test_overrides.py), not silently here. The op names a selective-AC policy keys
on are here too: that is how a policy names SDPA's kernels.
"""

from __future__ import annotations

import torch

from titanlike.overrides import probe_for, version_outside

aten = torch.ops.aten


# ---- the kernels of the causal parts --------------------------------------------------------------


def cudnn_attention(q, k, v, causal: bool):
    """cuDNN's fused attention: (out, lse, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset)."""
    out = aten._scaled_dot_product_cudnn_attention(query=q, key=k, value=v, attn_bias=None, compute_log_sumexp=True,
                                                   dropout_p=0.0, is_causal=causal, return_debug_mask=False)
    return out[:8]


def cudnn_attention_backward(grad, q, k, v, out, lse, seed, offset, cum_q, cum_k, max_q, max_k, causal: bool):
    return aten._scaled_dot_product_cudnn_attention_backward(
        grad_out=grad, query=q, key=k, value=v, out=out, logsumexp=lse, philox_seed=seed, philox_offset=offset,
        attn_bias=None, cum_seq_q=cum_q, cum_seq_k=cum_k, max_q=max_q, max_k=max_k, dropout_p=0.0, is_causal=causal)


def cpu_attention(q, k, v, causal: bool):
    """torch's fused CPU attention (what SDPA runs on a CPU): (out, lse)."""
    return aten._scaled_dot_product_flash_attention_for_cpu(query=q, key=k, value=v, dropout_p=0.0, is_causal=causal)


def cpu_attention_backward(grad, q, k, v, out, lse, causal: bool):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out=grad, query=q, key=k, value=v, out=out, logsumexp=lse, dropout_p=0.0, is_causal=causal)


@probe_for("cp_attention_kernels")
def probe_cp_attention_kernels() -> str | None:
    """Each op, called by keyword on meta tensors (shapes only, nothing runs), and what chunk_attention takes
    from cuDNN's forward to hand its backward: the random-number seed and offset, as tensors."""
    q = torch.empty(1, 2, 8, 16, device="meta", dtype=torch.bfloat16)
    try:
        o, lse, cum_q, cum_k, max_q, max_k, seed, offset = cudnn_attention(q, q, q, True)
        cudnn_attention_backward(o, q, q, q, o, lse, seed, offset, cum_q, cum_k, max_q, max_k, True)
        q32 = q.float()
        o, lse = cpu_attention(q32, q32, q32, True)
        cpu_attention_backward(o, q32, q32, q32, o, lse, True)
    except (TypeError, RuntimeError, AttributeError) as e:
        return f"an attention op moved ({str(e).splitlines()[0][:100]})"
    if not all(isinstance(t, torch.Tensor) and t.dtype == torch.int64 for t in (seed, offset)):
        return "cuDNN attention's seed and offset are no longer int64 tensors"
    return version_outside(torch.__version__, (2, 11), (2, 14))


# ---- the op names of selective activation checkpointing (not switched: the policy names SDPA's kernels) ----


def attention_ops() -> set:
    """The ops whose outputs an op-level selective-AC policy keeps besides the matmuls: SDPA's kernels (the
    ones this torch has), flex attention, and float8's amax reductions."""
    ops: set[object] = {aten.max.default, aten.amax.default}
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention"):
        if hasattr(aten, name):
            ops.add(getattr(aten, name).default)
    if hasattr(torch.ops.higher_order, "flex_attention"):  # model.attn_mask = block_causal
        ops.add(torch.ops.higher_order.flex_attention)
    return ops


def matmul_ops() -> set:
    """A block's matmuls as the policy sees them: mm, or float8's scaled mm (where this torch has it: float8
    needs it, and a torch without it runs no float8 matmul for the policy to see)."""
    return {aten.mm.default} | ({aten._scaled_mm.default} if hasattr(aten, "_scaled_mm") else set())
