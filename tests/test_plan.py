"""titanlike/plan: the memory estimate against recorded GPU peaks, titanlike-plan as a user runs it, and
training.fit_gib's choices and refusals."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT
from titanlike.config import load_config, to_toml
from titanlike.errors import UserError
from titanlike.model.shape import model_args
from titanlike.plan import cli
from titanlike.plan.estimate import estimate_run
from titanlike.plan.fit import fit_to_target, gib, given_keys

H200, H100 = 140.4, 79.65  # GiB torch reports for the card
C = "train_configs/"
B = "docs/benchmarks/"
FIX = f"{B}2026-11-26-8b-memory-breakdown.md"
FUSED = f"{B}2026-11-23-one-gpu-fused-chunked-loss-1b-32gb.md"
HEAD = f"{B}2026-11-23-one-gpu-124m-compiled-head-1b-32gb.md"
TIER = f"{B}2026-11-24-gpu-test-tier.md"
LEVERS = f"{B}2026-11-26-memory-levers-and-estimator.md"
LEVERS8B = f"{B}2026-11-26-8b-levers-chunked-loss-context-parallel.md"
FIT = f"{B}2026-11-26-cp-kernels-fit-to-target.md"
LONG = f"{B}2026-11-26-cp-prefetch-offload-long-windows.md"
L1B = f"{B}2026-11-26-cp-long-windows-1b-levers.md"
UNDER = f"{B}2026-11-26-8b-under-the-peer.md"
WALL = f"{B}2026-11-28-cp-long-window-memory.md"
AFTER = f"{B}2026-11-28-cp-speed-and-memory-after-the-fixes.md"
ONE_OP = f"{B}2026-11-28-cp-attention-as-one-op.md"
FENCE = f"{B}2026-11-28-cp-step-fence-in-the-forward.md"
PREFIX_ORDER = f"{B}2026-11-28-cp-gather-in-prefix-order.md"
BF16_SUMS = f"{B}2026-11-29-bf16-gradient-sums-one-rank.md"
CP4 = f"{B}2026-11-28-cp4-262k-and-what-cp2-waits-for.md"
TWO_H200 = f"{B}2026-11-29-two-h200s-cp2-bf16-sums-8b-fused-cast.md"
SYNC_ONCE = f"{B}2026-11-29-gradient-sync-once-a-step.md"
FITS = f"{B}2026-12-02-one-gpu-8b-fits-bf16-moments.md"
MUON = f"{B}2026-12-02-muon-one-gpu.md"
OFFLOAD = ("--parallel.cpu_offload --fp8.enable_fsdp_float8_all_gather false --activation_checkpoint.mode full "
           "--training.loss_chunk_tokens 4096 --training.local_batch_size 1")
ONE = C + "llama3_1b.toml"
WHOLE = "--training.loss_chunk_tokens 0"  # llama3_8b.toml's loss over whole logits, as measured before it chunked
CAP = "--training.gpu_memory_limit_gib 31"
WINDOW = "--training.local_batch_size 1 --training.global_batch_size 1"
FOUR = "--training.local_batch_size 1 --training.global_batch_size 4"  # four windows a step
LONG_CP = ("--training.local_batch_size 1 --training.global_batch_size 1 --activation_checkpoint.mode full "
           "--training.loss_chunk_tokens 4096 --parallel.cp 2")

# (config file, overrides, world, card GiB, measured peak reserved GiB from metrics.jsonl, where it is recorded).
# One row a measurement: a new one is one more line.
MEASURED = [
    (C + "llama3_8b.toml", f"{WHOLE} --fp8.recipe none", 2, H200, 103.5, FIX),
    (C + "llama3_8b.toml", WHOLE, 2, H200, 104.1, FIX),  # tensorwise, float8 all-gather
    (C + "llama3_1b.toml", "--fp8.recipe none", 2, H200, 55.6, FIX),
    (C + "llama3_1b.toml", "", 2, H200, 46.1, FIX),
    (C + "llama3_1b.toml", "--fp8.recipe none", 1, H100, 56.9, FUSED),
    (C + "llama3_1b.toml", "", 1, H100, 46.3, FUSED),
    (C + "rtx5090_1b_8bit.toml", CAP, 1, H100, 29.7, FUSED),
    (C + "rtx5090_1b_8bit.toml", f"{CAP} --fp8.recipe none --training.local_batch_size 2 "
     "--training.global_batch_size 8", 1, H100, 30.6, FUSED),
    (C + "rtx5090_1b.toml", CAP, 1, H100, 28.2, FUSED),  # full recompute
    (C + "rtx5090_1b.toml", f"{CAP} --fp8.recipe none", 1, H100, 28.3, FUSED),
    (C + "rtx5090_124m.toml", "--fp8.recipe none --training.local_batch_size 32", 1, H100, 26.8, HEAD),
    (C + "rtx5090_124m.toml", "--fp8.recipe none --training.local_batch_size 32 --training.loss_chunk_tokens 16384",
     1, H100, 23.0, FUSED),
    (C + "rtx5090_124m.toml", "--fp8.recipe none --training.local_batch_size 64", 1, H100, 52.8, TIER),
    (C + "rtx5090_124m.toml", "--training.local_batch_size 64", 1, H100, 38.6, TIER),
    (C + "rtx5090_124m.toml", CAP, 1, H100, 15.6, FUSED),  # as shipped: delayed tensorwise, `measure`
    (C + "llama3_1b.toml", "--fp8.scaling delayed --fp8.amax_every 4", 1, H100, 47.0, TIER),
    (C + "llama3_8b.toml", f"{WHOLE} --fp8.recipe none", 2, H200, 103.8, LEVERS),
    (C + "llama3_8b.toml", "--fp8.recipe none --training.loss_chunk_tokens 4096", 2, H200, 99.7, LEVERS),
    (C + "llama3_8b.toml", WHOLE, 2, H200, 103.7, LEVERS),
    (C + "llama3_8b.toml", "--training.loss_chunk_tokens 4096", 2, H200, 100.3, LEVERS),
    (ONE, "--model.flavor 3b --fp8.recipe none --training.local_batch_size 4", 1, H200, 93.3, LEVERS),
    (ONE, "--model.flavor 3b --training.local_batch_size 4 --training.loss_chunk_tokens 4096", 1, H200, 75.4, LEVERS),
    (ONE, "--training.loss_chunk_tokens 4096", 1, H200, 43.6, LEVERS),
    (ONE, "--activation_checkpoint.mode full --optimizer.state_dtype 8bit", 1, H200, 20.3, LEVERS),
    (ONE, "--model.flavor 3b --fp8.recipe none --training.local_batch_size 4", 2, H200, 79.1, LEVERS),
    (ONE, "--fp8.recipe none --training.loss_chunk_tokens 4096", 2, H200, 47.3, LEVERS),
    (C + "llama3_8b.toml", "--training.loss_chunk_tokens 1024", 2, H200, 99.3, LEVERS8B),
    (C + "llama3_8b.toml", "--training.loss_chunk_tokens 4096 --optimizer.state_dtype 8bit", 2, H200, 77.0, LEVERS8B),
    (C + "llama3_8b.toml", "--training.loss_chunk_tokens 4096 --activation_checkpoint.selective_ac_option "
     "op:wqkv,wo,w1", 2, H200, 85.3, LEVERS8B),
    (ONE, "--data.seq_len 16384 --training.local_batch_size 1 --training.global_batch_size 1", 1, H200, 37.0,
     LEVERS8B),
    (C + "llama3_8b.toml", WHOLE, 2, H200, 104.0, FIT),
    (C + "llama3_8b.toml", "--training.loss_chunk_tokens 4096", 2, H200, 99.3, FIT),
    (C + "llama3_8b.toml", "--training.loss_chunk_tokens 1024 --optimizer.state_dtype 8bit "
     "--training.gpu_memory_limit_gib 78", 2, H200, 77.0, FIT),  # what --training.fit_gib 78 chose
    (ONE, "", 1, H200, 46.3, FIT),
    (ONE, "--training.loss_chunk_tokens 1024 --activation_checkpoint.mode budget "
     "--activation_checkpoint.memory_budget 0.5", 1, H200, 33.5, FIT),
    (ONE, "--training.local_batch_size 3 --training.global_batch_size 6 --optimizer.state_dtype 8bit "
     "--training.loss_chunk_tokens 4096 --training.gpu_memory_limit_gib 31", 1, H200, 28.7, FIT),
    (ONE, "--model.flavor 3b --optimizer.state_dtype 8bit --activation_checkpoint.mode full "
     "--training.gpu_memory_limit_gib 31", 2, H200, 28.8, FIT),
    (ONE, "--data.seq_len 32768 --training.local_batch_size 1 --training.global_batch_size 1", 1, H200, 55.8, LONG),
    (C + "llama3_8b.toml", f"{OFFLOAD} --training.global_batch_size 1 --optimizer.state_dtype 8bit", 1, H200, 8.8,
     LONG),  # 8b on one GPU
    (C + "llama3_8b.toml", f"{OFFLOAD} --training.global_batch_size 2", 2, H200, 10.2, LONG),
    # Every lever on 1b over two GPUs, and cp 2 at 65,536 tokens.
    (ONE, "--optimizer.state_dtype 8bit", 2, H200, 41.8, L1B),
    (ONE, "--activation_checkpoint.mode full", 2, H200, 25.3, L1B),
    (ONE, "--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op:wqkv,wo,w1", 2,
     H200, 37.5, L1B),
    (ONE, "--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op:wqkv,w1", 2, H200,
     36.0, L1B),
    (ONE, "--parallel.reshard_after_forward always", 2, H200, 44.8, L1B),
    (ONE, "--parallel.cpu_offload --fp8.enable_fsdp_float8_all_gather false", 2, H200, 38.6, L1B),
    (ONE, "--data.seq_len 65536 --training.local_batch_size 1 --training.global_batch_size 1", 1, H200, 93.4, L1B),
    (C + "llama3_8b.toml", "--training.loss_chunk_tokens 4096 --activation_checkpoint.selective_ac_option "
     "op:wqkv,wo,w1 --activation_checkpoint.selective_ac_blocks 4", 2, H200, 97.2, L1B),
    # The gathers of the embedding and the output layer on the compute stream, reduce-scatter inputs freed at once,
    # AdamW's moments made before step 1; llama3_8b.toml with its chunked loss.
    (C + "llama3_8b.toml", "", 2, H200, 97.7, UNDER),
    (C + "llama3_8b.toml", "--fp8.recipe none", 2, H200, 98.4, UNDER),
    (C + "llama3_8b.toml", WHOLE, 2, H200, 103.2, UNDER),
    (ONE, "", 2, H200, 45.9, UNDER),
    # Long windows under cp 2 with full recompute, checkpointed around the compiled blocks; peak at the first
    # recomputed block of backward.
    (ONE, f"{LONG_CP} --data.seq_len 131072", 2, H200, 24.5, WALL),
    (C + "llama3_8b.toml", f"{LONG_CP} --data.seq_len 131072", 2, H200, 81.1, WALL),
    (C + "llama3_8b.toml", f"{LONG_CP} --data.seq_len 131072 --training.gpu_memory_limit_gib 78", 2, H200, 78.0,
     WALL),
    (C + "llama3_8b.toml", f"{LONG_CP} --data.seq_len 131072 --training.gpu_memory_limit_gib 78", 2, H200, 77.8,
     FENCE),
    (ONE, f"{LONG_CP} --data.seq_len 262144 --model.max_seq_len 262144", 2, H200, 37.2, WALL),
    (ONE, f"{LONG_CP} --data.seq_len 262144 --model.max_seq_len 262144", 2, H200, 36.4, ONE_OP),
    (ONE, f"{LONG_CP} --data.seq_len 65536", 2, H200, 18.6, AFTER),
    (C + "llama3_8b.toml", f"{LONG_CP} --data.seq_len 65536", 2, H200, 70.3, AFTER),
    # One window a step, no recompute: one GPU, and cp 2 with causal attention as one op each way, keeping the
    # rank's own keys and values for backward (the rows measured before, with the window or the q/k/v
    # projection's output kept, went).
    (ONE, f"{WINDOW} --data.seq_len 16384", 1, H200, 36.9, AFTER),
    (ONE, f"{WINDOW} --data.seq_len 16384 --parallel.cp 2", 2, H200, 22.5, ONE_OP),
    (ONE, f"{WINDOW} --data.seq_len 32768 --parallel.cp 2", 2, H200, 33.1, ONE_OP),
    # The same with the step fence held in the forward under cp (a quarter of the forward queued early).
    (ONE, f"{WINDOW} --data.seq_len 16384 --parallel.cp 2", 2, H200, 22.9, FENCE),
    (ONE, f"{WINDOW} --data.seq_len 32768 --parallel.cp 2", 2, H200, 33.4, FENCE),
    (ONE, f"{WINDOW} --data.seq_len 65536 --parallel.cp 2", 2, H200, 54.3, ONE_OP),
    # The same with the gather in prefix order (no copy of the window into window order).
    (ONE, f"{WINDOW} --data.seq_len 16384 --parallel.cp 2", 2, H200, 22.6, PREFIX_ORDER),
    (ONE, f"{WINDOW} --data.seq_len 32768 --parallel.cp 2", 2, H200, 33.2, PREFIX_ORDER),
    (ONE, f"{WINDOW} --data.seq_len 65536 --parallel.cp 2", 2, H200, 54.9, PREFIX_ORDER),
    (ONE, f"{WINDOW} --data.seq_len 32768", 1, H200, 55.6, PREFIX_ORDER),
    (ONE, f"{WINDOW} --data.seq_len 65536", 1, H200, 93.0, PREFIX_ORDER),
    (C + "llama3_8b.toml", f"{LONG_CP} --data.seq_len 131072 --training.gpu_memory_limit_gib 78", 2, H200, 78.0,
     PREFIX_ORDER),
    # 262,144 tokens over four GPUs (cp 4) and, on the same machine, over two.
    (ONE, f"{LONG_CP} --data.seq_len 262144 --model.max_seq_len 262144 --parallel.cp 4", 4, H200, 20.7, CP4),
    (ONE, f"{LONG_CP} --data.seq_len 262144 --model.max_seq_len 262144", 2, H200, 36.4, CP4),
    # One rank of cp 2 alone on one GPU (its collectives stood in by copies), gradients summed in fp32 and bf16.
    (ONE, f"{WINDOW} --data.seq_len 32768 --parallel.cp 2", 2, H200, 33.4, BF16_SUMS),
    (ONE, f"{WINDOW} --data.seq_len 32768 --parallel.cp 2 --training.mixed_precision_reduce bf16", 2, H200, 36.0,
     BF16_SUMS),
    # The same two on two GPUs, beside one GPU; and the 8b config with the float8 all-gather's cast fused.
    (ONE, f"{WINDOW} --data.seq_len 32768", 1, H200, 55.6, TWO_H200),
    (ONE, f"{WINDOW} --data.seq_len 32768 --parallel.cp 2", 2, H200, 33.2, TWO_H200),
    (ONE, f"{WINDOW} --data.seq_len 32768 --parallel.cp 2 --training.mixed_precision_reduce bf16", 2, H200, 36.1,
     TWO_H200),
    (C + "llama3_8b.toml", "", 2, H200, 98.9, TWO_H200),
    # Four micro-batches a step, the gradients summed after each (the default) or once a step.
    (ONE, f"{FOUR} --data.seq_len 32768", 1, H200, 61.4, SYNC_ONCE),
    (ONE, f"{FOUR} --data.seq_len 32768 --parallel.cp 2", 2, H200, 37.0, SYNC_ONCE),
    (ONE, f"{FOUR} --data.seq_len 32768 --parallel.cp 2 --parallel.gradient_sync step", 2, H200, 38.9, SYNC_ONCE),
    (ONE, f"{FOUR} --data.seq_len 16384", 1, H200, 42.6, SYNC_ONCE),
    (ONE, f"{FOUR} --data.seq_len 16384 --parallel.cp 2", 2, H200, 26.3, SYNC_ONCE),
    (ONE, f"{FOUR} --data.seq_len 16384 --parallel.cp 2 --parallel.gradient_sync step", 2, H200, 28.3, SYNC_ONCE),
    (ONE, "--training.global_batch_size 48", 2, H200, 50.4, SYNC_ONCE),
    (ONE, "--training.global_batch_size 48 --parallel.gradient_sync step", 2, H200, 51.8, SYNC_ONCE),
    # The 8b config on one GPU: what fit_gib = auto chose there (w3's output recomputed, chunks of 1,024), the
    # peer's rule (wo's and w3's), and selective `op` with bf16 moments; 1b with bf16 moments; 124m in bf16.
    (C + "llama3_8b.toml", "--activation_checkpoint.selective_ac_option op:wqkv,wo,w1 --training.loss_chunk_tokens "
     "1024", 1, H200, 126.7, FITS),
    (C + "llama3_8b.toml", "--activation_checkpoint.selective_ac_option op:wqkv,w1 --training.loss_chunk_tokens 1024",
     1, H200, 125.6, FITS),
    (C + "llama3_8b.toml", "--optimizer.state_dtype bf16", 1, H200, 115.6, FITS),
    (ONE, "--optimizer.state_dtype bf16", 1, H200, 40.5, FITS),
    (ONE, "", 1, H200, 46.2, FITS),
    (C + "rtx5090_124m.toml", "--fp8.recipe none --training.local_batch_size 8", 1, H200, 7.2, FITS),
    # Two stages: 1b at 2,048 tokens, then 8,192 from step 6 (the run's peak is the second's; the first alone
    # reserved 27.5 GiB). Muon on one GPU: 1b, and the 8b config kept as configured (its step is the peak).
    (ONE, "--data.seq_len 2048 --training.local_batch_size 4 --training.steps 10 --data.phase 6:seq_len=8192", 1,
     H200, 55.5, MUON),
    (ONE, "--data.seq_len 2048 --training.local_batch_size 4 --training.steps 10", 1, H200, 27.5, MUON),
    (ONE, "--optimizer.name muon", 1, H200, 42.4, MUON),
    (ONE, "--optimizer.name muon --training.global_batch_size 48", 1, H200, 48.2, MUON),
    (ONE, "--training.global_batch_size 48", 1, H200, 52.0, MUON),
    (C + "llama3_8b.toml", "--optimizer.name muon", 1, H200, 123.1, MUON),
]


@pytest.mark.parametrize("config, overrides, world, card, measured, source", MEASURED,
                         ids=[f"{r[0].split('/')[-1]}|{r[1]}|{r[2]}gpu" for r in MEASURED])
def test_the_estimate_is_within_10_percent_of_every_recorded_peak(config, overrides, world, card, measured, source):
    assert (ROOT / source).is_file(), f"the measurement's record {source} is gone"
    cfg = load_config(["--job.config_file", str(ROOT / config), *overrides.split()])
    estimate = estimate_run(cfg, world, card).reserved_gib
    assert abs(estimate / measured - 1) <= 0.10, f"estimate {estimate:.1f} GiB against {measured} measured ({source})"


def test_the_measurements_span_models_world_sizes_and_levers():
    assert {r[0] for r in MEASURED} >= {C + "llama3_8b.toml", C + "llama3_1b.toml"}
    assert any("--model.flavor 3b" in r[1] and r[2] == 1 for r in MEASURED)
    assert any("--model.flavor 3b" in r[1] and r[2] == 2 for r in MEASURED)
    assert {r[2] for r in MEASURED} == {1, 2, 4}
    assert any("8bit" in r[0] for r in MEASURED) and any("loss_chunk" in r[1] for r in MEASURED)
    assert any("--data.phase" in r[1] for r in MEASURED)  # a run whose later stage is its peak
    assert any("--optimizer.name muon" in r[1] for r in MEASURED)


def test_the_categories_add_up_and_the_8b_breakdown_is_recognisable():
    cfg = load_config(["--job.config_file", str(ROOT / C / "llama3_8b.toml"), "--fp8.recipe", "none"])
    e = estimate_run(cfg, 2, H200)
    assert sum(g for _, g in e.rows) == pytest.approx(e.reserved_gib)
    assert e.row("parameters") == pytest.approx(14.96, abs=0.01)  # measured: 14.96
    assert e.row("optimizer") == pytest.approx(29.92, abs=0.01)  # measured: 29.92
    assert e.row("activations") == pytest.approx(46.06, rel=0.01)  # measured: 32 × 1.443 + the embedding's


def test_selective_ac_blocks_moves_the_estimate_a_block_at_a_time():
    """op:NAMES in k of the blocks keeps k/n_layers of the way from op's activations to op:NAMES's; the
    lever's flags name the count for this model (a quarter of 8b's 32 blocks: 8)."""
    from titanlike.plan.levers import CHOICES, flags

    eight_b = ["--job.config_file", str(ROOT / C / "llama3_8b.toml")]
    names = ["--activation_checkpoint.selective_ac_option", "op:wqkv,wo,w1"]

    def kept(*extra: str) -> float:
        return estimate_run(load_config(eight_b + list(extra)), 2, H200).row("activations")

    op, every, four = kept(), kept(*names), kept(*names, "--activation_checkpoint.selective_ac_blocks", "4")
    assert four == pytest.approx(op - (op - every) * 4 / 32)
    assert op - four == pytest.approx(4 * 0.4375, rel=0.01)  # w3's output: 0.4375 GiB a block, measured
    quarter = next(c for c in CHOICES if c.value == "selective:op:wqkv,wo,w1@1/4")
    assert flags(load_config(eight_b), (quarter,), 4) == [
        "--activation_checkpoint.mode selective", "--activation_checkpoint.selective_ac_option op:wqkv,wo,w1",
        "--activation_checkpoint.selective_ac_blocks 8"]


def test_under_cp_only_attention_that_keeps_the_gathered_window_is_charged_for_it():
    """Causal attention on the cp kernels keeps a rank's own keys and values (as one op, beside its merged
    output, and no longer through a view of the q/k/v projection's output); on stock torch
    (`--parallel.overrides off`) and under document masks the gathered window stays for backward: cp window
    tokens' keys and values (kv heads, bf16) per local token in every layer, and no more under document masks
    (flex takes the kv heads as they are)."""
    one_b = ["--job.config_file", str(ROOT / C / "llama3_1b.toml"), "--data.seq_len", "32768", "--parallel.cp",
             "2", "--training.local_batch_size", "1", "--training.global_batch_size", "1"]

    def kept(*extra: str) -> float:
        return estimate_run(load_config(one_b + list(extra)), 2, H200).row("activations")

    a = model_args("1b")
    local = 32768 // 2
    window_gib = a.n_layers * local * 2 * 2 * a.n_kv_heads * a.head_dim * 2 / 2**30  # k and v of 2 ranks, bf16
    merged_gib = a.n_layers * local * 2 * a.n_heads * a.head_dim / 2**30  # the kernels' merged output, bf16
    # The projection's output (values were a view of it), less the values the op stacks beside its keys.
    unpinned_gib = a.n_layers * local * 2 * (a.dim + a.n_kv_heads * a.head_dim) / 2**30
    assert kept("--parallel.overrides", "off") - kept() == pytest.approx(window_gib - merged_gib + unpinned_gib,
                                                                          rel=1e-6)
    assert kept("--model.attn_mask", "block_causal") == pytest.approx(kept("--parallel.overrides", "off"), rel=1e-6)


def test_levers_lower_the_estimate():
    base = ["--job.config_file", str(ROOT / C / "llama3_1b.toml")]
    now = estimate_run(load_config(base), 1, H100).reserved_gib
    for lever in (["--training.loss_chunk_tokens", "4096"], ["--optimizer.state_dtype", "8bit"],
                  ["--activation_checkpoint.mode", "full"], ["--training.local_batch_size", "3",
                                                             "--training.global_batch_size", "6"]):
        assert estimate_run(load_config(base + lever), 1, H100).reserved_gib < now, lever


def test_hsdp_keeps_the_gradients_in_the_reduce_scatter_pool_and_offload_keeps_the_state_on_the_host():
    import dataclasses

    from titanlike.config.dims import parallel_dims
    from titanlike.config.resolve import resolve_model
    from titanlike.plan.estimate import estimate, shape_of

    eight_b = ["--job.config_file", str(ROOT / C / "llama3_8b.toml")]
    fsdp = estimate_run(load_config(eight_b), 2, H200)
    hsdp = estimate_run(load_config(eight_b + ["--parallel.dp_shard", "2", "--parallel.dp_replicate", "2"]), 4, H200)
    assert hsdp.row("gradients in the reduce-scatter") == pytest.approx(14.96, abs=0.01)
    assert hsdp.reserved_gib == pytest.approx(fsdp.reserved_gib + hsdp.row("gradients in the reduce-scatter"))
    cfg = load_config(eight_b)
    shape = shape_of(cfg, resolve_model(cfg).args, parallel_dims(cfg, 2), H200)
    offloaded = estimate(dataclasses.replace(shape, cpu_offload=True))
    assert offloaded.row("parameters") == offloaded.row("optimizer") == offloaded.row("gradients") == 0
    # Offloaded, the embedding and the output layer are gathered through FSDP's side pool again (parallel/fsdp.py).
    side_pool = offloaded.row("FSDP all-gather") - fsdp.row("FSDP all-gather")
    assert side_pool > 0
    assert fsdp.reserved_gib - offloaded.reserved_gib + side_pool > 14.96 + 29.92
    assert any("host memory" in note for note in offloaded.notes)


def test_the_plan_counts_fsdps_own_gradient_buffers_where_the_override_is_off():
    """Without the override gradients_in_compute_pool (--parallel.overrides off, or a list without it), FSDP
    keeps the gradients in its reduce-scatter stream's pool (8b on two GPUs: 14.96 GiB more, measured before
    the override); with it, or with one rank, they are in the compute stream's."""
    eight_b = ["--job.config_file", str(ROOT / C / "llama3_8b.toml")]
    pool = "gradients in the reduce-scatter stream's pool"
    on = estimate_run(load_config(eight_b), 2, H200)
    off = estimate_run(load_config(eight_b + ["--parallel.overrides", "off"]), 2, H200)
    others = estimate_run(load_config(eight_b + ["--parallel.overrides", "cp_attention_kernels"]), 2, H200)
    kept = estimate_run(load_config(eight_b + ["--parallel.overrides", "gradients_in_compute_pool"]), 2, H200)
    assert on.row(pool) == kept.row(pool) == 0 and on.reserved_gib == kept.reserved_gib
    assert off.row(pool) == others.row(pool) == pytest.approx(14.96, abs=0.01)
    assert off.reserved_gib > on.reserved_gib
    one = ["--job.config_file", str(ROOT / C / "llama3_1b.toml")]
    assert (estimate_run(load_config(one + ["--parallel.overrides", "off"]), 1, H200).row(pool)
            == estimate_run(load_config(one), 1, H200).row(pool) == 0)


def test_bf16_sums_move_the_gradients_to_the_reduce_scatter_pool_where_ranks_sum():
    """training.mixed_precision_reduce bf16: FSDP casts each summed bf16 shard to the fp32 gradient on its
    reduce-scatter stream, so the gradients sit in that stream's pool, which backward's freed activations do
    not refill (measured: 2.6 GiB more for 1b with cp 2 on a rank alone, 2.9 on two GPUs); one rank sums nothing
    and keeps fp32."""
    eight_b = ["--job.config_file", str(ROOT / C / "llama3_8b.toml")]
    bf16 = eight_b + ["--training.mixed_precision_reduce", "bf16"]
    fp32_sums, bf16_sums = estimate_run(load_config(eight_b), 2, H200), estimate_run(load_config(bf16), 2, H200)
    pool = "gradients in the reduce-scatter stream's pool"
    assert fp32_sums.row(pool) == 0
    assert bf16_sums.row(pool) == pytest.approx(fp32_sums.row("parameters"))  # an fp32 shard of every weight
    assert bf16_sums.reserved_gib > fp32_sums.reserved_gib
    one = ["--job.config_file", str(ROOT / C / "llama3_1b.toml")]
    assert (estimate_run(load_config(one + ["--training.mixed_precision_reduce", "bf16"]), 1, H200).reserved_gib
            == estimate_run(load_config(one), 1, H200).reserved_gib)


def test_summing_once_a_step_holds_the_whole_models_gradients_between_micro_batches():
    """parallel.gradient_sync = step: from the second micro-batch on, each rank holds its micro-batches' gradients
    unsharded (fp32 sums: 4 bytes a parameter), where micro_batch holds its shard of them; with one micro-batch
    a step, or one rank, nothing changes."""
    one_b = ["--job.config_file", str(ROOT / C / "llama3_1b.toml")]
    two_micro = one_b + ["--training.local_batch_size", "2", "--training.global_batch_size", "8"]
    step = ["--parallel.gradient_sync", "step"]
    each, once = estimate_run(load_config(two_micro), 2, H200), estimate_run(load_config(two_micro + step), 2, H200)
    assert each.row("gradients (fp32)") == pytest.approx(each.row("parameters"))  # a shard of every weight, fp32
    assert once.row("gradients (the micro-batches' unsharded sums)") == pytest.approx(2 * each.row("parameters"))
    assert once.reserved_gib > each.reserved_gib
    for same in (one_b, one_b + ["--training.global_batch_size", "12"]):  # one micro-batch a step
        assert (estimate_run(load_config(same + step), 2, H200).reserved_gib
                == estimate_run(load_config(same), 2, H200).reserved_gib)
    assert (estimate_run(load_config(two_micro[:2] + ["--training.global_batch_size", "12"] + step), 1, H200)
            .reserved_gib == estimate_run(load_config(two_micro[:2] + ["--training.global_batch_size", "12"]), 1,
                                          H200).reserved_gib)


# ---- titanlike-plan ------------------------------------------------------------------------------------


def plan(*args: str) -> subprocess.CompletedProcess:
    code = ("import sys; from titanlike.plan import cli; rc = cli.main(sys.argv[1:]); "
            "print('torch loaded' if 'torch' in sys.modules else 'no torch', file=sys.stderr); sys.exit(rc)")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT, timeout=60)


def test_plan_prints_the_categories_the_cards_and_the_levers_without_torch():
    out = plan("--job.config_file", "train_configs/llama3_1b.toml", "--world", "1")
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip() == "no torch"
    text = out.stdout
    for category in ("parameters", "optimizer state", "activations kept for backward", "logits", "allocator slack",
                     "peak reserved"):
        assert category in text
    assert "80 GB (H100): fits, with room" in text
    assert "24 GB (RTX 4090): does not fit" in text and "--training.fit_gib auto chooses --" in text


def test_plan_what_fits_and_fit_gib_give_one_answer_for_a_card():
    """8b on two 80 GB GPUs: titanlike-plan's line for the card, scripts/what_fits.py's row and what
    `--training.fit_gib auto` logs on that card name the same levers, inside 95 % of what torch can allocate."""
    import importlib.util

    from titanlike.plan.cli import CARDS
    from titanlike.plan.fit import AUTO_MARGIN, usable_gib

    argv = ["--job.config_file", "train_configs/llama3_8b.toml"]
    card = next(gib for size, _, gib in CARDS if size == 80)
    usable = usable_gib(card, 2)
    assert usable == pytest.approx(78.15)  # 79.65 GiB less the context (1) and NCCL (0.5)
    line = next(x for x in plan(*argv, "--world", "2").stdout.splitlines() if x.strip().startswith("80 GB"))
    chosen = line.split("--training.fit_gib auto chooses ")[1].split(" →")[0]
    on_gpu = [*argv, "--training.device", "cuda"]
    _, logged = fit_to_target(load_config(on_gpu, 2), on_gpu, 2, card=("NVIDIA H100 80GB HBM3", card))
    assert logged.startswith("training.fit_gib = auto (this host's NVIDIA H100 80GB HBM3: 78.2 GiB usable")
    assert f"chose {chosen} (estimate" in logged
    spec = importlib.util.spec_from_file_location("what_fits", ROOT / "scripts" / "what_fits.py")
    what_fits = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(what_fits)
    best = what_fits.fits(argv + what_fits.ANY_WORLD, 2, card)
    assert " ".join(best.flags) == chosen and best.reserved_gib <= usable * (1 - AUTO_MARGIN)


def test_the_configs_shipped_for_a_card_fit_it_in_the_plan():
    """Each rtx5090 config fits a 32 GB card by the plan (one ran in 28.2 GiB, another in 28.7, under a 31 GiB
    cap); the 8b config, which does not fit one H200 as set, is fitted there by the auto fit its TOML asks for,
    with fp32 moments (which its TOML keeps), to what was measured in 126.7 GiB."""
    for name in ("rtx5090_124m", "rtx5090_1b", "rtx5090_1b_8bit"):
        out = plan("--job.config_file", f"train_configs/{name}.toml", "--world", "1")
        line = next(x for x in out.stdout.splitlines() if x.strip().startswith("32 GB"))
        assert line.strip().startswith("32 GB (RTX 5090): fits"), (name, line)
    out = plan("--job.config_file", "train_configs/llama3_8b.toml", "--world", "1").stdout
    line = next(x for x in out.splitlines() if x.strip().startswith("141 GB"))
    assert "does not fit (147.8 GiB" in line and "--training.fit_gib auto chooses --training.loss_chunk_tokens 1024 " \
        "--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op:wqkv,wo,w1 →" in line
    assert "levers you set are kept: optimizer.state_dtype" in line


def test_smaller_micro_batches_come_before_offload():
    """A micro-batch of 3 halves to nothing: its divisors are the lever (1, here), before CPU offload."""
    from titanlike.plan.levers import micro_batch_choices

    assert [c.value for c in micro_batch_choices(3)] == ["1/3"]
    assert [c.value for c in micro_batch_choices(12)] == ["1/2", "1/3", "1/4", "1/6", "1/12"]
    assert len(micro_batch_choices(960)) == 12  # a dozen at most, whatever the micro-batch
    costs = [c.cost for c in micro_batch_choices(8)]
    assert costs == sorted(costs) and costs[:3] == [0.03, 0.07, 0.12]
    argv = ["--job.config_file", str(ROOT / C / "rtx5090_1b_8bit.toml"), "--training.fit_gib", "23"]
    cfg, line = fit(argv, 1)
    assert cfg.training.local_batch_size == 1 and cfg.training.global_batch_size == 6, line
    assert not cfg.parallel.cpu_offload and cfg.optimizer.state_dtype == "8bit"  # the TOML's moments kept


def test_plan_keeps_what_the_command_line_sets():
    out = plan("--job.config_file", "train_configs/llama3_1b.toml", "--world", "1", "--optimizer.state_dtype", "fp32")
    assert out.returncode == 0, out.stderr
    assert "8bit" not in out.stdout and "bf16" not in out.stdout


@pytest.mark.parametrize("args, says", [
    (["--model.flavor", "9b"], "model.flavor = '9b' is not a preset"),
    (["--job.config_file", "train_configs/llama3_1b.toml", "--training.global_batch_size", "12", "--world", "4"],
     "must be a multiple of training.local_batch_size"),
    (["--training.nope", "1"], "unknown config key training.nope"),
    (["--world", "zero"], "--world 'zero'"),
])
def test_plan_refuses_bad_input_in_one_line(args, says):
    out = plan(*args)
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line != "no torch"]
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], out.stderr


def test_plan_refuses_an_amax_history_that_would_overflow_its_storage(capsys):
    """--fp8.amax_history 10^18 with delayed scaling overflowed the history's storage at the first step, while
    the plan and the preflight passed it: the config check bounds it, for both."""
    rc = cli.main(["--fp8.recipe", "tensorwise", "--fp8.scaling", "delayed", "--fp8.amax_history", str(10**18)])
    assert rc == 2
    assert capsys.readouterr().err == ("error: fp8.amax_history = 1000000000000000000 must be in [1, 1024] "
                                       "(default 16)\n")


def test_plan_help():
    assert cli.main(["--help"]) == 0


# ---- training.fit_gib ---------------------------------------------------------------------------------------


def fit(argv: list[str], world: int):
    """training.fit_gib's choice for `argv`, as on a GPU (on the CPU a number of GiB is refused)."""
    argv = [*argv, "--training.device", "cuda"]
    return fit_to_target(load_config(argv), argv, world)


ONE_B = ["--job.config_file", str(ROOT / C / "llama3_1b.toml")]


@pytest.mark.parametrize("target, chosen", [
    (70, {}),
    (40, {"training.loss_chunk_tokens": 4096, "optimizer.state_dtype": "bf16"}),
    # The micro-batch the TOML file sets is a lever (the same global batch in more micro-batches).
    (30, {"optimizer.state_dtype": "bf16", "training.local_batch_size": 2}),
    (20, {"training.loss_chunk_tokens": 4096, "optimizer.state_dtype": "bf16", "activation_checkpoint.mode": "full"}),
])
def test_fit_picks_the_fastest_levers_that_fit(target, chosen):
    argv = ONE_B + ["--training.fit_gib", str(target)]
    cfg, line = fit(argv, 1)
    assert line and line.startswith(f"training.fit_gib = {target}")
    got = {"training.loss_chunk_tokens": cfg.training.loss_chunk_tokens,
           "optimizer.state_dtype": cfg.optimizer.state_dtype,
           "activation_checkpoint.mode": cfg.activation_checkpoint.mode,
           "training.local_batch_size": cfg.training.local_batch_size}
    base = load_config(ONE_B)
    want = {"training.loss_chunk_tokens": base.training.loss_chunk_tokens,
            "optimizer.state_dtype": base.optimizer.state_dtype, "activation_checkpoint.mode": "none",
            "training.local_batch_size": base.training.local_batch_size, **chosen}
    assert got == want
    assert estimate_run(cfg, 1, target).reserved_gib <= target
    # The choice is in the config the run saves, so a resume trains the same.
    toml = to_toml(cfg)
    for key, value in chosen.items():
        assert f"{key.split('.')[1]} = {value!r}".replace("'", '"') in toml


def test_fit_keeps_the_levers_the_user_set():
    argv = ONE_B + ["--training.fit_gib", "40", "--optimizer.state_dtype", "fp32", "--training.local_batch_size", "6"]
    assert "optimizer.state_dtype" in given_keys(argv) and "training.local_batch_size" in given_keys(argv)
    cfg, _ = fit(argv, 1)
    assert cfg.optimizer.state_dtype == "fp32" and cfg.training.local_batch_size == 6
    assert estimate_run(cfg, 1, 40).reserved_gib <= 40


def test_fit_off_changes_nothing():
    cfg = load_config(ONE_B)
    assert fit_to_target(cfg, ONE_B, 1) == (cfg, None)


def test_fit_refuses_a_target_nothing_reaches_naming_the_closest():
    with pytest.raises(UserError) as e:
        fit(ONE_B + ["--training.fit_gib", "2"], 1)
    msg = str(e.value)
    assert "\n" not in msg and "the smallest estimate is" in msg and "comes closest alone is --" in msg


def test_a_line_says_gib_in_figures_a_reader_takes_in():
    """Three figures below 1,000 GiB; whole GiB with thousands separated above (a million-token window's
    estimate read 1.81e+03 GiB)."""
    assert [gib(x) for x in (0.4321, 77.84, 248.4, 999.4, 999.6, 1810.2, 23456.7)] == [
        "0.432", "77.8", "248", "999", "1,000", "1,810", "23,457"]


def test_the_preflight_refuses_an_unreachable_target_before_any_work():
    out = subprocess.run([sys.executable, "-m", "titanlike.preflight", "--job.config_file",
                          "train_configs/llama3_1b.toml", "--training.fit_gib", "2"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "training.fit_gib = 2" in out.stderr


def test_the_trainer_refuses_a_fit_in_gib_on_the_cpu_before_any_work(tmp_path, capsys):
    """`python -m titanlike.train --training.fit_gib 0.1` on the CPU (no launcher, so no preflight): the trainer's
    own fit says the one line the preflight says, exit 2, and leaves no run folder behind. It trained with levers
    chosen for a GPU it did not have. (The GPU tier's test_fit_gib_chooses_levers_that_fit_on_the_gpu trains with
    the chosen levers and finds them in config.toml.)"""
    from titanlike.train import main

    folder = tmp_path / "run"
    assert main(["--training.steps", "1", "--training.fit_gib", "0.1", "--training.device", "cpu",
                 "--job.dump_folder", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: training.fit_gib = 0.1 fits a run into GPU memory"), err
    assert not folder.exists()


def test_what_fits_prints_each_card_and_gpu_count_without_torch():
    """scripts/what_fits.py (the README's "what fits" table): a row for each card and GPU count, each
    naming a preset and a window that fit by the estimate, with no torch imported."""
    code = ("import runpy, sys; sys.argv = ['what_fits.py']; runpy.run_path('scripts/what_fits.py', "
            "run_name='__main__'); print('torch loaded' if 'torch' in sys.modules else 'no torch')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[-1] == "no torch"
    rows = [line for line in lines if line.startswith("| ") and "GB (" in line]
    assert len(rows) == 6 and all(" GiB, " in row for row in rows), rows
    # More GPUs never fit a smaller preset on the same card.
    order = ["`124m`", "`1b`", "`3b`", "`8b`", "`70b`"]
    for card in ("32 GB", "80 GB"):
        sizes = [max(i for i, name in enumerate(order) if name in row) for row in rows if row.startswith(f"| {card}")]
        assert sizes == sorted(sizes), (card, rows)


def test_a_gpu_config_on_a_machine_without_a_gpu_is_refused_in_the_preflight(monkeypatch, capsys):
    """`NGPU=2 ./run_train.sh --job.config_file train_configs/llama3_8b.toml` where no GPU is visible: the run
    would build 8b in host memory and be killed minutes later; the preflight says what it needs and has."""
    from titanlike import preflight
    from titanlike.config import host

    monkeypatch.setattr(host, "gpu_visible", lambda: False)
    monkeypatch.setattr(host, "host_available_bytes", lambda: 24 * 2**30)
    monkeypatch.setenv(preflight.WORLD_ENV, "2")
    monkeypatch.setenv(preflight.LOCAL_ENV, "2")
    assert preflight.main(["--job.config_file", str(ROOT / C / "llama3_8b.toml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: this run trains on the CPU (no GPU is visible")
    assert "each of the 2 processes of this host needs at least" in err and "24.0 GiB available" in err
    assert "a smaller model (--model.flavor debug)" in err
    # The debug model with a window too long for the host: the advice is the window, not the model it has.
    monkeypatch.setenv(preflight.WORLD_ENV, "1")
    monkeypatch.setenv(preflight.LOCAL_ENV, "1")
    assert preflight.main(["--data.seq_len", "131072", "--model.max_seq_len", "131072"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "it needs at least" in err and "--model.flavor" not in err, err
    assert "fewer tokens a step (now --training.local_batch_size" in err and "--data.seq_len 131072)" in err, err
    monkeypatch.setattr(host, "gpu_visible", lambda: True)  # the same config where a GPU is: the GPUs' business
    assert preflight.main(["--job.config_file", str(ROOT / C / "llama3_8b.toml")]) == 0


def test_the_cpu_memory_refusal_advises_what_fits_the_run(monkeypatch):
    """It said "run it where its GPUs are" for the debug model, the CPU's own: GPUs only for a GPU config that
    found none (not for training.device = cpu either), a smaller model where there is one, fewer processes."""
    from titanlike.config import host
    from titanlike.config.resolve import resolve_model
    from titanlike.plan.estimate import cpu_host_problem

    monkeypatch.setattr(host, "host_available_bytes", lambda: 2**20)  # 1 MiB: nothing fits

    def advice(*argv: str, processes: int = 1) -> str:
        cfg = load_config(list(argv))
        problem = cpu_host_problem(cfg, processes, processes, resolve_model(cfg).args)
        assert problem is not None
        return problem.partition("GiB available; ")[2]

    assert advice() == "choose fewer tokens a step (now --training.local_batch_size 16 of --data.seq_len 256)"
    assert advice("--model.dim", "4096", processes=2) == (
        "choose smaller --model.* sizes (now dim 4096) or fewer processes on this host (now 2: NGPU) or fewer tokens "
        "a step (now --training.local_batch_size 16 of --data.seq_len 256)")
    eight = ["--job.config_file", str(ROOT / C / "llama3_8b.toml")]
    assert advice(*eight).startswith("run it where its GPUs are, or choose a smaller model (--model.flavor debug) or "
                                     "fewer tokens a step")
    assert advice(*eight, "--training.device", "cpu").startswith("choose a smaller model (--model.flavor debug)")


def test_a_cp_that_cannot_split_the_ranks_is_said_before_the_windows_rules(monkeypatch, capsys):
    """cp 3 on two ranks with a window that is no multiple of 6: both are wrong, and the window's rule follows
    from cp, so the line names cp (fixing the window first would only lead to it). Printing needs no world."""
    from titanlike import preflight
    from titanlike.plan import cli

    monkeypatch.setenv(preflight.WORLD_ENV, "2")
    for main, argv in ((preflight.main, ["--parallel.cp", "3"]),
                       (cli.main, ["--world", "2", "--parallel.cp", "3"])):
        assert main(argv) == 2
        assert capsys.readouterr().err == "error: parallel.cp = 3 does not divide the 2 ranks\n"
    assert preflight.main(["--parallel.cp", "3", "--data.seq_len", "264", "--job.print_config"]) == preflight.PRINTED


def test_a_window_no_lever_fits_is_refused_before_any_work(monkeypatch, capsys, tmp_path):
    """`8b` with cp 2 at 2,097,152 tokens fits no 80 GB card whatever the levers: the preflight says so in one
    line with the smallest estimate, against the cap the user set or the smallest card nvidia-smi shows; the
    same at 131,072 tokens fits with levers (measured: 78.0 GiB under a 78 GiB cap) and goes on."""
    from titanlike import preflight
    from titanlike.config import host

    monkeypatch.setattr(host, "gpu_visible", lambda: True)
    monkeypatch.setenv(preflight.WORLD_ENV, "2")
    monkeypatch.setenv(preflight.LOCAL_ENV, "2")
    # The config's own fit (auto) refuses such a window as a target it cannot reach; without a fit, the
    # preflight's own check.
    auto = ["--job.config_file", str(ROOT / C / "llama3_8b.toml"), "--parallel.cp", "2"]
    eight_b = [*auto, "--training.fit_gib", "0"]
    far = ["--data.seq_len", "2097152", "--model.max_seq_len", "2097152"]
    cap = ["--training.gpu_memory_limit_gib", "78"]
    assert preflight.main(auto + far + cap) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        "error: training.fit_gib = auto (training.gpu_memory_limit_gib = 78: 78 GiB usable, less 5% for the estimate's "
        "error): no combination")
    assert preflight.main(eight_b + far + cap) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: this run does not fit in training.gpu_memory_limit_gib = 78")
    assert "the smallest estimate is" in err and "--activation_checkpoint.mode full" in err
    assert preflight.main(eight_b + ["--data.seq_len", "131072"] + cap) == 0
    assert preflight.main(eight_b + far + ["--training.fit_gib", "70"]) == 2  # fit_gib's own refusal
    assert "training.fit_gib = 70: no combination of levers fits" in capsys.readouterr().err

    # No cap: the smallest card this process may use, as nvidia-smi reports it.
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho '0, NVIDIA H200, 143771'\necho '1, NVIDIA H100 80GB HBM3, 81559'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert host.smallest_gpu() == ("NVIDIA H100 80GB HBM3", 81559 / 1024)
    assert preflight.main(eight_b + far) == 2
    assert "on this host's NVIDIA H100 80GB HBM3 (79.6 GiB)" in capsys.readouterr().err
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert host.smallest_gpu() == ("NVIDIA H200", 143771 / 1024)
    assert preflight.main(eight_b + ["--data.seq_len", "131072"]) == 0


def test_a_fit_on_the_cpu_is_refused_and_auto_there_changes_nothing(monkeypatch, capsys):
    """fit_gib fits GPU memory: `llama3_1b.toml --training.fit_gib 23` where no GPU is visible is one line in the
    preflight (it trained on the CPU before); `auto` there has no GPU to fit, and the run goes as configured
    (where the host check may still refuse it). Where a GPU is, offload is what reaches 60 GiB for 8b on two."""
    from titanlike import preflight
    from titanlike.config import host

    monkeypatch.setattr(host, "gpu_visible", lambda: False)
    monkeypatch.setenv(preflight.WORLD_ENV, "1")
    monkeypatch.setenv(preflight.LOCAL_ENV, "1")
    assert preflight.main(["--job.config_file", str(ROOT / C / "llama3_1b.toml"), "--training.fit_gib", "23"]) == 2
    err = capsys.readouterr().err
    assert err == ("error: training.fit_gib = 23 fits a run into GPU memory, and this run trains on the CPU (no GPU is "
                   "visible, or training.device = cpu): run it where its GPUs are, or leave fit_gib 0\n")
    argv = ["--training.fit_gib", "auto"]
    assert fit_to_target(load_config(argv), argv, 1) == (load_config(argv), None)
    assert preflight.main(argv) == 0
    monkeypatch.setattr(host, "gpu_visible", lambda: True)
    on_gpus, _ = fit(["--job.config_file", str(ROOT / C / "llama3_8b.toml"), "--training.fit_gib", "60"], 2)
    assert on_gpus.parallel.cpu_offload


# ---- every training stage ---------------------------------------------------------------------------------

TWO_STAGES = ["--data.seq_len", "2048", "--training.steps", "100", "--data.phase", "50:seq_len=32768",
              "--model.max_seq_len", "32768"]


def estimate_of(argv: list[str], world: int = 1):
    return estimate_run(load_config([*ONE_B, *argv, "--training.device", "cuda"], world), world, H200)


def test_the_plan_reads_every_stage_and_names_the_largest():
    """A long-context stage from step 50: the run's estimate is that stage's, as if the run were that window
    throughout, and the report says which stage it is."""
    first, both = estimate_of(["--data.seq_len", "2048"]), estimate_of(TWO_STAGES)
    alone = estimate_of(["--data.seq_len", "32768", "--model.max_seq_len", "32768"])
    assert both.reserved_gib == pytest.approx(alone.reserved_gib) and both.reserved_gib > 3 * first.reserved_gib
    assert both.stage == "the stage from step 50: seq_len 32768, micro-batch 6"
    assert any(f"the others {first.reserved_gib:.1f} GiB" in note for note in both.notes)
    out = plan("--job.config_file", "train_configs/llama3_1b.toml", "--world", "1", *TWO_STAGES).stdout
    assert "the stage from step 50 (seq_len 32768, micro-batch 6) needs the most of the 2 stages" in out
    # A later stage with its own smaller micro-batch can be the smaller one: the first stage's peak is the run's.
    smaller = estimate_of([*TWO_STAGES[:4], "--data.phase", "50:seq_len=4096,local_batch_size=1,global_batch_size=6"])
    assert smaller.reserved_gib == pytest.approx(first.reserved_gib) and smaller.stage.startswith("the first stage")


def test_fit_gib_and_the_preflight_see_the_later_stage(monkeypatch, capsys):
    """fit_gib chooses levers under which the later stage fits (its first stage alone fits as configured);
    the preflight refuses a later stage that no lever fits, naming it, before any work."""
    from titanlike import preflight
    from titanlike.config import host

    cfg, line = fit([*ONE_B, "--training.fit_gib", "60", *TWO_STAGES], 1)
    assert "(the stage from step 50: seq_len 32768, micro-batch 6); chose --" in line
    assert estimate_run(cfg, 1, H200).reserved_gib <= 60
    assert fit([*ONE_B, "--training.fit_gib", "60", "--data.seq_len", "2048"], 1)[1].endswith("no lever needed")
    monkeypatch.setattr(host, "gpu_visible", lambda: True)
    monkeypatch.setenv(preflight.WORLD_ENV, "1")
    monkeypatch.setenv(preflight.LOCAL_ENV, "1")
    far = ["--data.phase", "50:seq_len=1048576", "--model.max_seq_len", "1048576", "--training.steps", "100",
           "--training.gpu_memory_limit_gib", "78"]
    assert preflight.main([*ONE_B, *far]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "GiB per GPU (the stage from step 50: seq_len 1048576, micro-batch" in err, err
    assert preflight.main([*ONE_B, *far[:-2]]) == 0  # the same stages with no cap: no card is known here


def test_muon_state_is_half_of_adamws_for_the_block_matrices_on_8b_over_two_gpus():
    """--optimizer.name muon on the 8b config over two GPUs: Muon's fp32 momentum (4 bytes) for the blocks'
    matrices, 7.0B of the 8.03B parameters, where AdamW keeps two fp32 moments (8): 4 bytes × 6.98B / 2 GPUs,
    13.0 GiB a GPU less state, and that plus the allocator's share of it less at the peak (the start of backward
    for both: the step's buffers, below, are smaller than what backward holds)."""
    from titanlike.plan.estimate import ALLOCATOR_SLACK, GIB

    eight_b = ["--job.config_file", str(ROOT / C / "llama3_8b.toml"), "--optimizer.state_dtype", "fp32"]
    adamw, muon = estimate_run(load_config(eight_b), 2, H200), estimate_run(
        load_config(eight_b + ["--optimizer.name", "muon"]), 2, H200)
    a = model_args("8b")
    kv = a.n_kv_heads * a.head_dim
    matrices = a.n_layers * (a.dim * (a.dim + 2 * kv) + a.dim * a.dim + 3 * a.dim * a.ffn_dim)
    assert 6.9e9 < matrices < 7.0e9
    saved = 4 * matrices / 2 / GIB
    assert adamw.row("optimizer") - muon.row("optimizer") == pytest.approx(saved, rel=1e-9)
    assert 12.9 < saved < 13.1
    assert adamw.reserved_gib - muon.reserved_gib == pytest.approx(saved * (1 + ALLOCATOR_SLACK), rel=1e-9)
    assert muon.notes[0] == adamw.notes[0] == "the peak comes at the start of backward"


def test_muons_step_buffers_are_the_peak_when_activations_are_small():
    """With little activation memory the optimizer step is the peak: weights, gradients, state, and Muon's
    buffers of the owner's whole matrices (bf16 U and O: 4 bytes an element of about 1/N of them) and Newton–
    Schulz's temporaries of its largest batch (6 bytes an element: at most NS_BATCH_ELEMENTS a call, which the
    4,096 × 4,096 pieces, q and wo, 2 a block, 1/N of them, fill; w1's and w3's four to a call hold less).
    AdamW's step needs nothing beside its state: its peak stays in backward."""
    from titanlike.config.optimizer import NS_BATCH_ELEMENTS
    from titanlike.plan.estimate import ALLOCATOR_SLACK, GIB

    small = ["--job.config_file", str(ROOT / C / "llama3_8b.toml"), "--optimizer.state_dtype", "fp32",
             "--training.local_batch_size", "1", "--training.global_batch_size", "2", "--data.seq_len", "512"]
    adamw, muon = estimate_run(load_config(small), 2, H200), estimate_run(
        load_config(small + ["--optimizer.name", "muon"]), 2, H200)
    a = model_args("8b")
    kv = a.n_kv_heads * a.head_dim
    matrices = a.n_layers * (a.dim * (a.dim + 2 * kv) + a.dim * a.dim + 3 * a.dim * a.ffn_dim)
    square = min(2 * a.n_layers // 2, NS_BATCH_ELEMENTS // (a.dim * a.dim)) * a.dim * a.dim
    feed_forward = min(2 * a.n_layers // 2, NS_BATCH_ELEMENTS // (a.ffn_dim * a.dim)) * a.ffn_dim * a.dim
    assert square == NS_BATCH_ELEMENTS > feed_forward
    buffers = 4 * matrices / 2 + 6 * square
    assert muon.row("the optimizer step's buffers") == pytest.approx(buffers / GIB, rel=1e-9)
    assert muon.notes[0] == "the peak comes at the optimizer step"
    held = muon.row("parameters") + muon.row("gradients") + muon.row("optimizer") + buffers / GIB
    assert muon.reserved_gib == pytest.approx(held * (1 + ALLOCATOR_SLACK) + muon.row("FSDP all-gather"), rel=1e-9)
    assert adamw.row("the optimizer step's buffers") == 0 and "optimizer step" not in adamw.notes[0]


def test_fit_never_picks_a_state_dtype_or_offload_the_optimizer_does_not_take():
    """The levers a fit weighs for a Muon run: bf16 moments (its AdamW parameters'), never 8bit nor
    parallel.cpu_offload, which the config refuses with Muon; for AdamW of the same shape, all three."""
    from titanlike.plan.fit import candidates

    for name, allowed in (("adamw", True), ("muon", False)):
        cfg = cli.on_gpus(load_config(["--job.config_file", str(ROOT / ONE), "--optimizer.name", name]))
        weighed = {(c.key, c.value) for values in candidates(cfg, set()) for c in values if c is not None}
        assert ("optimizer.state_dtype", "bf16") in weighed, name
        others = {("optimizer.state_dtype", "8bit"), ("parallel.cpu_offload", True)}
        assert (others <= weighed) if allowed else not (others & weighed), (name, weighed)
