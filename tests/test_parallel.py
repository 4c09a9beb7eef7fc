"""Scale-out on CPU: FSDP and HSDP over 2 gloo ranks, activation checkpointing, compile.

Each test is a list of CLI overrides on the debug model (run_train = torchrun on run_train.sh).
Every run sees the same global batch of 4 samples per step, so in fp32 the losses must agree to
rounding: 2 ranks × local batch 2 = 1 process × local batch 2 × 2 accumulated micro-batches.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import losses, metrics, run_train, spawn_ranks, train_here
from titanlike import parallel
from titanlike.config import JobConfig
from titanlike.config.speed import ActivationCheckpoint
from titanlike.model.decoder import Transformer
from titanlike.model.shape import ModelArgs

STEPS = 6
COMMON = ("--training.steps", str(STEPS), "--metrics.log_freq", "1", "--data.seq_len", "64",
          "--training.local_batch_size", "2", "--training.global_batch_size", "4",
          "--validation.enable", "false", "--checkpoint.enable", "false")

# Measured on this CPU: sharded vs single-process losses agree to ~1e-7 relative (different
# reduction order only); grad norms to ~5e-6 (the norm is summed shard by shard, then all-reduced).
LOSS_RTOL = 2e-6
GRAD_RTOL = 5e-5


def assert_same_losses(a: dict, b: dict, rtol: float = LOSS_RTOL) -> None:
    assert a.keys() == b.keys() == set(range(1, STEPS + 1))
    for step in a:
        assert math.isfinite(a[step])
        assert abs(a[step] - b[step]) <= rtol * abs(b[step]), (step, a[step], b[step])


def grad_norms(dump) -> dict:
    return {r["step"]: r["grad_norm"] for r in metrics(dump)}


@pytest.fixture(scope="module")
def single(tmp_path_factory, corpus):
    """1 process, gradient accumulation over 2 micro-batches: the reference."""
    dump = tmp_path_factory.mktemp("single")
    proc = train_here(dump, *COMMON, corpus=corpus)
    assert "1 rank(s)" in proc.stdout + proc.stderr and "2 micro-batches" in proc.stdout + proc.stderr
    ref = losses(dump)
    assert ref[STEPS] < ref[1] - 0.5  # it trains, so equal losses below are not trivially equal
    return dump


@pytest.mark.slow
def test_fsdp_two_ranks_matches_single_process(tmp_path, corpus, single):
    proc = run_train(tmp_path, *COMMON, nproc=2, corpus=corpus)
    log = proc.stdout + proc.stderr
    assert "2 rank(s) on cpu (dp_replicate 1 × dp_shard 2)" in log and "1 micro-batches" in log
    assert_same_losses(losses(tmp_path), losses(single))
    a, b = grad_norms(tmp_path), grad_norms(single)
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=GRAD_RTOL), step
    # Only rank 0 writes metrics.
    assert len(metrics(tmp_path)) == STEPS


@pytest.mark.slow
def test_fsdp_summing_once_a_step_matches_single_process(tmp_path, corpus, single):
    """parallel.gradient_sync = step with two micro-batches a rank (local batch 1): the reference's losses to
    rounding, as summing after every micro-batch gives them."""
    proc = run_train(tmp_path, *COMMON, "--training.local_batch_size", "1", "--parallel.gradient_sync", "step",
                     nproc=2, corpus=corpus)
    log = proc.stdout + proc.stderr
    assert "2 micro-batches" in log and "gradients summed once a step" in log
    assert_same_losses(losses(tmp_path), losses(single))


@pytest.mark.slow
def test_hsdp_two_replicas_matches_single_process(tmp_path, corpus, single):
    proc = run_train(tmp_path, *COMMON, "--parallel.dp_replicate", "2", "--parallel.dp_shard", "1",
                     nproc=2, corpus=corpus)
    assert "(dp_replicate 2 × dp_shard 1)" in proc.stdout + proc.stderr
    assert_same_losses(losses(tmp_path), losses(single))


@pytest.mark.slow
# op:NAMES: test_selective_op_keeps_the_named_matmul_outputs holds its gradients bit for bit to none's.
@pytest.mark.parametrize("mode,option", [("full", "op"), ("selective", "op"), ("selective", "2")])
def test_activation_checkpointing_same_losses(tmp_path, corpus, single, mode, option):
    train_here(tmp_path, *COMMON, "--activation_checkpoint.mode", mode,
               "--activation_checkpoint.selective_ac_option", option, corpus=corpus)
    # Recomputation replays the same fp32 kernels on the same inputs.
    assert_same_losses(losses(tmp_path), losses(single), rtol=1e-6)


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] = self.counts.get(func, 0) + 1
        return func(*args, **(kwargs or {}))


def recompute_profile(mode: str, option: str) -> tuple[list[int], dict]:
    """(how often each block's body ran in forward + backward, aten op counts during backward)."""
    model = Transformer(ModelArgs(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=50))
    model.init_weights(0, 16)
    parallel.apply_activation_checkpointing(model, ActivationCheckpoint(mode, option))
    calls = [0] * 4
    for i, block in enumerate(model.layers):
        def body(*args, _body=block.body, _i=i):
            calls[_i] += 1
            return _body(*args)

        block.body = body
    loss = model(torch.randint(0, 50, (2, 16))).float().pow(2).mean()
    assert calls == [1, 1, 1, 1]
    with OpCounter() as counter:
        loss.backward()
    return calls, counter.counts


def test_activation_checkpointing_recomputes_what_it_should():
    mm, silu = torch.ops.aten.mm.default, torch.ops.aten.silu.default
    calls, none = recompute_profile("none", "op")
    assert calls == [1, 1, 1, 1] and silu not in none
    calls, full = recompute_profile("full", "op")
    assert calls == [2, 2, 2, 2] and full[mm] > none[mm] and full[silu] == 4
    # Op-level selective AC saves matmul outputs: the body reruns, but no matmul is recomputed.
    calls, op = recompute_profile("selective", "op")
    assert calls == [2, 2, 2, 2] and op[mm] == none[mm] and op[silu] == 4
    # Every 2nd block fully: blocks 0 and 2.
    calls, every2 = recompute_profile("selective", "2")
    assert calls == [2, 1, 2, 1] and every2[silu] == 2 and none[mm] < every2[mm] < full[mm]


class RecomputedLinears(TorchDispatchMode):
    """Which of a block's Linears run their forward matmul again during backward: a matmul whose
    second input is a Linear's weight as forward passes it (weight.t(), strides (1, in_features));
    backward's own matmuls take the weight untransposed or not at all."""

    def __init__(self, block):
        super().__init__()
        self.weights = {m.weight.data_ptr(): name.rsplit(".", 1)[-1] for name, m in block.named_modules()
                        if isinstance(m, torch.nn.Linear)}
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default and args[1].stride()[0] == 1 and args[1].data_ptr() in self.weights:
            self.names.append(self.weights[args[1].data_ptr()])
        return func(*args, **(kwargs or {}))


def block_backward(option: str | None) -> tuple[list[str], dict]:
    """(the Linears whose forward matmul reran in backward, the gradients) of one block under
    selective AC with `option` (None: no AC), uncompiled."""
    model = Transformer(ModelArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=50))
    model.init_weights(0, 16)
    parallel.apply_activation_checkpointing(model, ActivationCheckpoint("none" if option is None else "selective",
                                                                        option or "op"))
    block = model.layers[0]
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    out = block(x, model.rope_cos[:16], model.rope_sin[:16])
    with RecomputedLinears(block) as seen:
        out.pow(2).mean().backward()
    return seen.names, {"x": x.grad, **{name: p.grad for name, p in block.named_parameters()}}


@pytest.mark.parametrize("option,recomputed", [
    ("op", []), ("op:wqkv,wo,w1", ["w3"]), ("op:wqkv,w1", ["wo", "w3"]),
    ("op:wqkv,wo,w1,w3,w2", []), ("op:w2", ["wqkv", "wo", "w1", "w3"])])
def test_selective_op_keeps_the_named_matmul_outputs(option, recomputed):
    """op:NAMES keeps exactly the named Linears' outputs: backward reruns the others' matmuls (in forward
    order; w2's never, as backward needs its input, not its output) and no kept one, and the gradients
    are bit for bit those without checkpointing."""
    names, grads = block_backward(option)
    assert names == recomputed
    _, want = block_backward(None)
    assert grads.keys() == want.keys()
    for name in want:
        assert torch.equal(grads[name], want[name]), name


class RecomputedLinearsOfModel(RecomputedLinears):
    """RecomputedLinears over every block of a model: (block index, Linear name) for each forward
    matmul rerun in backward."""

    def __init__(self, model):
        TorchDispatchMode.__init__(self)
        self.weights = {m.weight.data_ptr(): (i, name.rsplit(".", 1)[-1]) for i, block in enumerate(model.layers)
                        for name, m in block.named_modules() if isinstance(m, torch.nn.Linear)}
        self.names = []


def four_blocks(blocks: int | None, compiled: bool = False) -> Transformer:
    """The debug shape at four blocks, w3 recomputed in `blocks` of them (None: no checkpointing)."""
    torch._dynamo.reset()
    model = Transformer(ModelArgs(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=50))
    model.init_weights(0, 16)
    if blocks is not None:
        parallel.apply_activation_checkpointing(model, ActivationCheckpoint("selective", "op:wqkv,wo,w1",
                                                                            selective_ac_blocks=blocks))
    if compiled:
        parallel.apply_compile(model)
    return model


TOKENS = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(3))


def test_selective_ac_blocks_recomputes_in_that_many_blocks_spread_out():
    """selective_ac_blocks = 2 of 4: blocks 0 and 2 follow op:wqkv,wo,w1 (backward reruns w3), 1 and 3
    follow op (nothing rerun); the gradients are bit for bit those without checkpointing."""
    model = four_blocks(2)
    out = model(TOKENS)
    with RecomputedLinearsOfModel(model) as seen:
        out.float().pow(2).mean().backward()
    assert sorted(seen.names) == [(0, "w3"), (2, "w3")]
    plain = four_blocks(None)
    plain(TOKENS).float().pow(2).mean().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


@pytest.mark.slow  # two compiled block graphs: about 10 s
def test_compiled_blocks_under_two_policies_get_a_graph_each():
    """Compiled blocks share graphs, and dynamo does not look into a checkpoint policy function: with the
    policy bound into each block's hooks.recompute, every block ran the first block's policy. Looked up by
    the block's policy name, each policy gets its graph. Counted in what each block saves for backward:
    blocks 0 and 2 save w3's output (fp32 here) less than blocks 1 and 3."""
    from torch.autograd.graph import saved_tensors_hooks

    model = four_blocks(2, compiled=True)
    params = {p.data_ptr() for p in model.parameters()}
    saved, current = [0] * 4, [None]  # bytes each block saves; the block running now
    for i, block in enumerate(model.layers):
        block.register_forward_pre_hook(lambda module, args, i=i: current.__setitem__(0, i))
        block.register_forward_hook(lambda module, args, out: current.__setitem__(0, None))

    def pack(t):
        if current[0] is not None and t.data_ptr() not in params:
            saved[current[0]] += t.numel() * t.element_size()
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        model(TOKENS)
    w3_output = TOKENS.numel() * 64 * 4
    assert saved[0] == saved[2] and saved[1] == saved[3] and saved[1] - saved[0] == w3_output, saved


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["none", "rowwise"])
def test_selective_op_names_under_compile_and_float8(monkeypatch, recipe):
    """Compiled, the policy runs while the block is traced: each trace asks checkpoint() for fresh
    contexts and sees the block's five matmuls in forward order (float8's converted Linears included:
    one mm each), so op:wqkv,w1 keeps the first and third; the gradients are the uncompiled ones'."""
    import torch.utils.checkpoint as checkpoint_module

    from titanlike.float8 import Float8Converter
    from titanlike.float8.options import Float8Options
    from titanlike.model.converter import ConvertArgs

    real = checkpoint_module.create_selective_checkpoint_contexts
    traces: list[list[str]] = []

    def spy(policy):
        decisions: list[str] = []
        traces.append(decisions)

        def recorded(ctx, op, *args, **kwargs):
            out = policy(ctx, op, *args, **kwargs)
            if op in (torch.ops.aten.mm.default, torch.ops.aten._scaled_mm.default):
                decisions.append(out.name)
            return out

        return real(recorded)

    monkeypatch.setattr(checkpoint_module, "create_selective_checkpoint_contexts", spy)

    def run(compiled: bool) -> dict:
        torch._dynamo.reset()
        model = Transformer(ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=50))
        model.init_weights(0, 16)
        if recipe != "none":
            options = Float8Options(recipe=recipe, emulate=True)
            Float8Converter(options).convert(model, ConvertArgs(device=torch.device("cpu")))
        parallel.apply_activation_checkpointing(model, ActivationCheckpoint("selective", "op:wqkv,w1"))
        if compiled:
            parallel.apply_compile(model)
        block = model.layers[0]
        x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
        block(x, model.rope_cos[:16], model.rope_sin[:16]).pow(2).mean().backward()
        return {"x": x.grad, **{name: p.grad for name, p in block.named_parameters()}}

    want = run(compiled=False)
    traces.clear()
    got = run(compiled=True)
    kept = ["MUST_SAVE", "PREFER_RECOMPUTE", "MUST_SAVE", "PREFER_RECOMPUTE", "PREFER_RECOMPUTE"]
    assert traces and all(decisions == kept for decisions in traces), traces
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


def budgeted_block_run(budget: float) -> tuple[int, dict]:
    """(bytes the compiled blocks keep for backward, the gradients) under mode = budget."""
    torch._dynamo.reset()  # compile each budget's graphs afresh
    model = Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=50))
    model.init_weights(0, 32)
    parallel.apply_activation_checkpointing(model, ActivationCheckpoint("budget", "op", memory_budget=budget))
    parallel.apply_compile(model)
    tokens = torch.randint(0, 50, (2, 32), generator=torch.Generator().manual_seed(0))
    h = model.tok_embeddings(tokens).detach().requires_grad_()
    kept = []

    def pack(t):
        kept.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = h
        for block in model.layers:
            out = block(out, model.rope_cos[:32], model.rope_sin[:32])
    out.float().pow(2).mean().backward()
    return sum(kept), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.slow
def test_memory_budget_keeps_less_for_the_same_gradients(monkeypatch):
    """mode = budget: compile's partitioner keeps fewer bytes for backward at a smaller budget and
    recomputes the rest, to the same gradients."""
    import torch._functorch.config as functorch_config

    monkeypatch.setattr(functorch_config, "activation_memory_budget", 1.0)  # restored after the test
    kept_all, want = budgeted_block_run(1.0)
    kept_some, grads = budgeted_block_run(0.2)
    assert functorch_config.activation_memory_budget == 0.2
    assert kept_some < 0.9 * kept_all, (kept_some, kept_all)
    assert grads.keys() == want.keys() and len(grads) == 2 * 7  # every block weight
    for name in grads:
        torch.testing.assert_close(grads[name], want[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.slow
def test_compile_tracks_eager(tmp_path, corpus, single, monkeypatch):
    monkeypatch.setenv("TORCH_LOGS", "dynamo")  # dynamo reports what it traced: proof that compile ran
    proc = run_train(tmp_path, *COMMON, "--compile.enable", corpus=corpus, timeout=900)
    log = proc.stdout + proc.stderr
    # One process compiles the blocks and, as one graph, the final norm + output layer + loss.
    assert "torchdynamo start tracing forward" in log and "torchdynamo start tracing head_loss" in log
    assert "calling compiler function inductor" in log
    # The four identical blocks share one compiled graph: frame 0 is never recompiled.
    assert "[0/0]" in log and "[0/1]" not in log
    compiled, eager = losses(tmp_path), losses(single)
    # Inductor may fuse and reorder fp32 arithmetic: close to eager (bitwise here on this CPU).
    assert_same_losses(compiled, eager, rtol=1e-4)


def test_allocator_default_leaves_the_users_choice_alone():
    env: dict[str, str] = {}
    parallel.default_allocator_settings(env)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    for mine in ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"},
                 {"PYTORCH_ALLOC_CONF": "max_split_size_mb:512"}):
        env = dict(mine)
        parallel.default_allocator_settings(env)
        assert env == mine


def test_step_fence_is_inert_off_the_gpu():
    fence = parallel.StepFence(torch.device("cpu"))
    fence.backward_queued()
    fence.wait()  # nothing queued ahead on a CPU: returns at once
    assert fence.device is None


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])  # compile: 15 s
def test_step_fence_under_cp_waits_before_the_block_a_quarter_of_the_way_down(compiled):
    """With `hold_in` (context parallelism) the step's start does not wait; the model's forward does, once,
    before the block a quarter of the way down, outside the compiled blocks (a hook on a compiled block is
    traced into its graph, which torch 2.14 refuses for a call it may not trace). The GPU test checks the
    wait itself."""
    from titanlike.model.shape import model_args

    order: list[str] = []
    model = Transformer(model_args("debug", n_layers=8))
    model.init_weights(0, 16)
    tokens = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(0))
    want = model(tokens)
    if compiled:
        parallel.apply_compile(model)
    else:  # the order of blocks and the wait (hooks of compiled blocks would be traced into them)
        for i, block in enumerate(model.blocks()):
            block.register_forward_hook(lambda module, args, out, i=i: order.append(f"block {i}"))
    fence = parallel.StepFence(torch.device("cuda"), hold_in=model)  # no CUDA call until a wait
    fence.wait = lambda: order.append("wait")
    fence.step_start()
    assert order == []
    torch.testing.assert_close(model(tokens), want)
    assert order.count("wait") == 1
    if not compiled:
        assert order[:4] == ["block 0", "block 1", "wait", "block 2"]
    without_cp = parallel.StepFence(torch.device("cuda"))
    without_cp.wait = lambda: order.append("wait at the start")
    without_cp.step_start()
    assert order[-1] == "wait at the start"


def test_default_reshard_keeps_small_models_gathered():
    from titanlike.model.shape import PRESETS, count_params

    gb = 10**9
    one_b, eight_b = (2 * count_params(PRESETS[f])[0] for f in ("1b", "8b"))
    assert parallel.resolve_reshard("default", one_b, 80 * gb) == "never"  # 3.0 GB on an H100
    assert parallel.resolve_reshard("default", eight_b, 141 * gb) == "default"  # 16 GB, even on an H200
    assert parallel.resolve_reshard("default", one_b, 32 * gb) == "default"  # a 32 GB cap is too tight
    assert parallel.resolve_reshard("default", one_b, None) == "default"  # CPU: no memory to judge by
    for asked in ("always", "never"):  # an explicit choice is the user's
        assert parallel.resolve_reshard(asked, one_b, 80 * gb) == asked
        assert parallel.resolve_reshard(asked, eight_b, None) == asked
    assert parallel.device_memory_bytes(torch.device("cpu"), 0) is None


def test_fsdp_gathers_the_next_block_before_a_blocks_forward_runs(tmp_path):
    """Forward prefetch (parallel/fsdp.py prefetch_forward): a block's pre-forward issues the next
    block's all-gather, so that gather is on its way while the block computes, whether or not the CPU
    runs ahead of the GPU. Without it the next gather is issued only when the next block starts."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from titanlike.parallel.fsdp import apply_fsdp

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = Transformer(ModelArgs(dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64))
        model.init_weights(0, 16)
        apply_fsdp(model, init_device_mesh("cpu", (1,)), None, "always")
        names = {id(block): f"layers.{i}" for i, block in enumerate(model.layers)}
        events: list[str] = []
        unshard = FSDPParamGroup.unshard

        def logged_unshard(self, *args, **kwargs):
            for module in getattr(self, "modules", None) or (self.module,):
                event = f"gather {names.get(id(module))}"
                if id(module) in names and event not in events:  # a second call finds it on its way
                    events.append(event)
            return unshard(self, *args, **kwargs)

        for block in model.layers:  # registered after FSDP's: runs once FSDP's pre-forward is done
            block.register_forward_pre_hook(lambda module, args: events.append(f"forward {names[id(module)]}"))
        FSDPParamGroup.unshard = logged_unshard
        try:
            model(torch.randint(0, 64, (1, 16)))
        finally:
            FSDPParamGroup.unshard = unshard
        assert events == ["gather layers.0", "gather layers.1", "forward layers.0", "gather layers.2",
                          "forward layers.1", "forward layers.2"], events
    finally:
        dist.destroy_process_group()


def test_gradients_are_summed_in_the_reduce_dtype(tmp_path):
    """training.mixed_precision_reduce: FSDP copies each gradient into its reduce-scatter in that dtype, so
    with bf16 the sharded gradients are the exact gradients rounded to bf16 (then kept in fp32); with fp32
    they are the exact ones. shard_model keeps fp32 where one rank has nothing to sum."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from titanlike.parallel.fsdp import apply_fsdp, shard_model

    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))

    def gradients(shard) -> dict[str, torch.Tensor]:
        model = Transformer(args)
        model.init_weights(0, 16)
        if shard is not None:
            shard(model)
        model(tokens).float().pow(2).mean().backward()
        return {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                for name, p in model.named_parameters()}

    exact = gradients(None)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        as_bf16 = gradients(lambda m: apply_fsdp(m, mesh, None, "always", reduce_dtype=torch.bfloat16))
        as_fp32 = gradients(lambda m: apply_fsdp(m, mesh, None, "always"))
        cfg = JobConfig()
        cfg.training.mixed_precision, cfg.training.mixed_precision_reduce = "bf16", "bf16"
        cfg.parallel.reshard_after_forward = "always"
        one_rank = gradients(lambda m: shard_model(m, mesh, torch.device("cpu"), cfg, log=False))
    finally:
        dist.destroy_process_group()
    assert exact.keys() == as_bf16.keys() == as_fp32.keys() == one_rank.keys()
    rounded = 0
    for name, grad in exact.items():
        assert as_bf16[name].dtype == torch.float32, name
        assert torch.equal(as_bf16[name], grad.to(torch.bfloat16).float()), name
        assert torch.equal(as_fp32[name], grad), name
        assert torch.equal(one_rank[name], grad), name
        rounded += int(not torch.equal(grad.to(torch.bfloat16).float(), grad))
    assert rounded == len(exact)  # every gradient had digits bf16 drops: the equalities above tell them apart


@pytest.mark.slow
def test_fsdp_two_ranks_summing_in_bf16_stays_near_fp32(tmp_path, corpus, single):
    """training.mixed_precision_reduce bf16 over two gloo ranks: the gradients are summed in bf16, so the first
    step's gradient norm leaves one process's by more than the fp32 sums' rounding (measured: 1.5e-4
    relative, against at most 5e-6 in fp32), and the losses stay within bf16's rounding of the gradients
    (measured: at most 6e-6 relative over the six steps)."""
    proc = run_train(tmp_path, *COMMON, "--training.mixed_precision_reduce", "bf16", nproc=2, corpus=corpus)
    assert "gradients summed in bf16" in proc.stdout + proc.stderr
    a, b = losses(tmp_path), losses(single)
    assert a.keys() == b.keys() == set(range(1, STEPS + 1))
    for step in a:
        assert abs(a[step] - b[step]) <= 1e-4 * abs(b[step]), (step, a[step], b[step])
    first = grad_norms(tmp_path)[1], grad_norms(single)[1]
    assert GRAD_RTOL < abs(first[0] - first[1]) / first[1] < 1e-3, first


def _sync_worker(rank: int, world: int) -> None:
    """Two micro-batches on two ranks, summed after each (micro_batch) or once (step, `sync_after`): the same
    sharded gradients in the end; in between, step has summed nothing and keeps the weights gathered."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from titanlike.parallel.fsdp import apply_fsdp, sync_after

    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64)
    batches = torch.randint(0, 64, (2, world, 2, 16), generator=torch.Generator().manual_seed(0))[:, rank]
    mesh = init_device_mesh("cpu", (world,))
    grads = {}
    for mode in ("micro_batch", "step"):
        model = Transformer(args)
        model.init_weights(0, 16)
        apply_fsdp(model, mesh, None, "always")
        for i, tokens in enumerate(batches):
            if mode == "step":
                sync_after(model, last=i == len(batches) - 1)
            model(tokens).float().pow(2).mean().backward()
            if i == 0:
                named = dict(model.named_parameters())
                if mode == "step":
                    # Nothing summed yet: no sharded gradient. The blocks' weights stay gathered for the next
                    # forward, holding their unsharded gradients (the embedding's weight is never gathered for
                    # backward: parallel/fsdp.py).
                    assert not any(isinstance(p.grad, DTensor) for p in named.values())
                    blocks = [p for n, p in named.items() if n.startswith("layers.")]
                    assert blocks and all(not isinstance(p, DTensor) and p.grad is not None for p in blocks)
                else:
                    assert all(isinstance(p.grad, DTensor) and isinstance(p, DTensor) for p in named.values())
        assert all(isinstance(p, DTensor) and isinstance(p.grad, DTensor) for p in model.parameters())
        grads[mode] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    for name, grad in grads["micro_batch"].items():
        # The same sums in another order: fp32 rounding apart.
        torch.testing.assert_close(grads["step"][name], grad, rtol=1e-5, atol=1e-7, msg=name)
        assert grad.abs().sum() > 0, name


def test_summing_once_a_step_gives_the_gradients_of_summing_every_micro_batch():
    """parallel.gradient_sync = step (parallel/fsdp.py `sync_after`) over two gloo ranks."""
    spawn_ranks(_sync_worker, 2)


def test_a_gpu_memory_cap_on_a_cpu_run_is_said_to_do_nothing(caplog):
    """training.gpu_memory_limit_gib on a run without a GPU: one line says the cap does nothing there, rather
    than the run seeming to honour it."""
    import logging

    from titanlike.parallel.device import configure_device

    with caplog.at_level(logging.INFO, logger="titanlike"):
        configure_device(torch.device("cpu"), 0.0, False)
        assert not caplog.records
        configure_device(torch.device("cpu"), 0.05, False)
    assert [r.getMessage() for r in caplog.records] == [
        "training.gpu_memory_limit_gib = 0.05 caps a GPU's memory; this run trains on the CPU, where it does nothing"]


def test_a_busy_cpu_is_said_when_the_compute_threads_outnumber_the_idle_cores(tmp_path, monkeypatch):
    """On a busy CPU the default threads made training many times slower than one thread (docs/performance.md):
    a CPU run says so at start when other work leaves fewer idle cores than it has threads."""
    from titanlike.parallel import device

    loadavg = tmp_path / "loadavg"
    for text, busy in (("2.50 1.90 1.50 3/300 99", 2.0),  # two others runnable besides the reader
                       ("3.00 2.00 1.00 1/300 99", 0.0),  # a run that just ended: a load average, nothing running
                       ("0.40 0.30 0.20 5/300 99", 0.4)):
        loadavg.write_text(text)
        assert device.other_busy_cores(str(loadavg)) == busy
    monkeypatch.setattr(device.os, "getloadavg", lambda: (1.25, 1.0, 1.0))  # no /proc/loadavg: the load average
    assert device.other_busy_cores(str(tmp_path / "none")) == 1.25
    for threads, cores, busy, said in ((2, 2, 1.0, True), (2, 2, 0.4, False), (1, 2, 5.0, False),
                                       (4, 8, 4.5, False), (4, 8, 5.0, True), (2, 2, None, False)):
        note = device.busy_cpu_note(threads, cores, busy)
        assert (note is not None) == said, (threads, cores, busy, note)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert device.busy_cpu_note(2, 2, 1.0) == (
        "the CPU is busy: other work holds about 1.0 cores' worth of its 2, and this run computes with 2 threads "
        "(OMP_NUM_THREADS=2), which wait on one another whenever one is descheduled; OMP_NUM_THREADS=1, or the "
        "number of idle cores, can train many times faster here (docs/performance.md, \"Training on a CPU\")")
    # What the trainer logs: this process's threads on the CPU, none on another device.
    monkeypatch.setattr(device, "other_busy_cores", lambda: 64.0)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert device.cpu_threads_note(torch.device("cpu")).startswith("the CPU is busy")
        assert device.cpu_threads_note(torch.device("meta")) is None
        torch.set_num_threads(1)
        assert device.cpu_threads_note(torch.device("cpu")) is None
    finally:
        torch.set_num_threads(threads)


def test_the_transforms_steer_a_model_through_its_hooks_alone(tmp_path):
    """Context parallelism, activation checkpointing and compile (its body compiled alone under cp) change how
    the model runs through model.hooks (model/hooks.py) and torch's own compile: no other attribute of any of
    its modules is set or replaced, so decoder.py and hooks.py say all that can run."""
    import torch.distributed as dist

    model = Transformer(ModelArgs(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=50))

    def attributes() -> dict:
        return {name: {key: id(value) for key, value in vars(module).items()
                       if key not in ("hooks", "_compiled_call_impl")}
                for name, module in model.named_modules()}

    before = attributes()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        context = parallel.apply_context_parallel(model, dist.group.WORLD)
        parallel.apply_activation_checkpointing(model, ActivationCheckpoint("full", ""))
        parallel.apply_compile(model, recompute_outside=True)
    finally:
        dist.destroy_process_group()
    assert attributes() == before
    assert all(block.attend == context.attend and block.recompute is not None and block.body is not None
               for block in model.hooks.blocks)
    assert [block.hooks for block in model.blocks()] == model.hooks.blocks


def test_the_rank_layout_is_the_dims_cp_innermost():
    """Ranks lie (dp_replicate, dp_shard, cp), cp innermost: a context group's ranks are neighbours and read
    the same samples; FSDP's mesh flattens dp_shard × cp into one dimension, the context mesh cuts the world
    into groups of cp."""
    from titanlike.config import JobConfig, load_config
    from titanlike.config.dims import parallel_dims

    cfg = load_config(["--parallel.dp_replicate", "2", "--parallel.cp", "2"])
    dims = parallel_dims(cfg, 8)
    assert (dims.dp_replicate, dims.dp_shard, dims.cp) == (2, 2, 2)
    assert [dims.dp_rank(rank) for rank in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert dims.fsdp_mesh == ((2, 4), ("dp_replicate", "dp_shard_cp"))
    assert dims.context_mesh == ((4, 2), ("dp", "cp"))
    plain = parallel_dims(JobConfig(), 4)
    assert [plain.dp_rank(rank) for rank in range(4)] == [0, 1, 2, 3]
    assert plain.fsdp_mesh == ((4,), ("dp_shard",))


def test_parallelize_applies_cp_then_ac_then_compile_and_returns_the_contexts(tmp_path, monkeypatch):
    """One call owns the order: with cp, a block recomputed whole is checkpointed around its compiled body
    (compile saw the cp attention and the checkpoint before it); one rank on the CPU trains without autocast."""
    import contextlib

    import torch.distributed as dist

    from titanlike.config import load_config
    from titanlike.config.dims import parallel_dims
    from titanlike.parallel import apply as spread

    cfg = load_config(["--activation_checkpoint.mode", "full", "--compile.enable"])
    model = Transformer(ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=50))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        # A one-rank context group stands for cp's: the mesh parallel.cp > 1 would make.
        monkeypatch.setattr(spread, "context_mesh", lambda dims, device: SimpleNamespace(get_group=lambda: None))
        monkeypatch.setattr(spread, "apply_context_parallel",
                            lambda model, group, device_type: parallel.apply_context_parallel(model, dist.group.WORLD))
        out = parallel.parallelize(model, parallel_dims(cfg, 1), cfg, device=torch.device("cpu"), mesh=None,
                                   compile_options={}, log=False)
    finally:
        dist.destroy_process_group()
    assert isinstance(out.context, parallel.ContextParallel) and isinstance(out.autocast, contextlib.nullcontext)
    for block in model.hooks.blocks:
        assert block.attend == out.context.attend and block.body is not None
        assert block.recompute is parallel.activation_checkpoint.checkpointed_around_compiled
