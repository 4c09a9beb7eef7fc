"""Private attention ops and functional collectives titanlike calls (the package docstring says how
overrides are chosen and probed).

Context parallelism's causal attention (parallel/chunk_attention.py) runs on fused kernels that
return the log-sum-exp SDPA keeps to itself, and on collectives split into a start and a wait so that
attention runs between them. Every call is by keyword, so that a reordered signature fails loudly in
the probe (and in tests/test_overrides.py), not silently here. The op names a selective-AC policy keys
on are here too: that is how a policy names SDPA's kernels.
"""

from __future__ import annotations

import torch

from titanlike.overrides import version_outside

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


# ---- collectives split into start and wait (torch's functional collectives) ------------------------


def all_gather_start(x: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """Every rank's `x` stacked along dim 0 in rank order, once waited for."""
    return torch.ops._c10d_functional.all_gather_into_tensor(input=x, group_size=group_size, group_name=group_name)


def reduce_scatter_start(x: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """This rank's part (along dim 0) of the sum of every rank's `x`, once waited for."""
    return torch.ops._c10d_functional.reduce_scatter_tensor(input=x, reduce_op="sum", group_size=group_size,
                                                            group_name=group_name)


def wait(x: torch.Tensor) -> torch.Tensor:
    return torch.ops._c10d_functional.wait_tensor(tensor=x)


def probe_cp_attention_kernels() -> str | None:
    """Each op, called by keyword on meta tensors (shapes only, nothing runs), and the collectives' schemas."""
    q = torch.empty(1, 2, 8, 16, device="meta", dtype=torch.bfloat16)
    try:
        o, lse, cum_q, cum_k, max_q, max_k, seed, offset = cudnn_attention(q, q, q, True)
        cudnn_attention_backward(o, q, q, q, o, lse, seed, offset, cum_q, cum_k, max_q, max_k, True)
        q32 = q.float()
        o, lse = cpu_attention(q32, q32, q32, True)
        cpu_attention_backward(o, q32, q32, q32, o, lse, True)
    except (TypeError, RuntimeError, AttributeError) as e:
        return f"an attention op moved ({str(e).splitlines()[0][:100]})"
    functional = getattr(torch.ops, "_c10d_functional", None)
    for name, args in (("all_gather_into_tensor", ["input", "group_size", "group_name"]),
                       ("reduce_scatter_tensor", ["input", "reduce_op", "group_size", "group_name"]),
                       ("wait_tensor", ["tensor"])):
        op = getattr(functional, name, None)
        if op is None or [a.name for a in op.default._schema.arguments] != args:
            return f"torch's functional collective {name} moved"
    return version_outside(torch.__version__, (2, 11), (2, 14))


# ---- the op names of selective activation checkpointing (not switched: the policy names SDPA's kernels) ----


def attention_ops() -> set:
    """The ops whose outputs an op-level selective-AC policy keeps besides the matmuls: SDPA's kernels (the
    ones this torch has), flex attention, and float8's amax reductions."""
    ops = {aten.max.default, aten.amax.default}
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention"):
        if hasattr(aten, name):
            ops.add(getattr(aten, name).default)
    if hasattr(torch.ops.higher_order, "flex_attention"):  # model.attn_mask = block_causal
        ops.add(torch.ops.higher_order.flex_attention)
    return ops


def matmul_ops() -> set:
    """A block's matmuls as the policy sees them: mm, or float8's scaled mm."""
    return {aten.mm.default, aten._scaled_mm.default}
