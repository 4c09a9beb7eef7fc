"""Context parallelism (parallel.cp, titanlike/parallel/context.py) on CPU over gloo.

The layout is exact arithmetic (split then unsplit is the identity); attention and the whole model
on cp ranks match the unsplit computation on the same batch in fp32, forward and gradients; a
training run with cp 2 matches one process, and checkpoints move between cp degrees.
"""

from __future__ import annotations

import itertools
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from conftest import spawn_ranks
from titanlike.model.decoder import Transformer
from titanlike.model.masks import document_mask
from titanlike.model.shape import ModelArgs
from titanlike.parallel.context import (
    ContextParallel,
    apply_context_parallel,
    shard_sequence,
    window_order,
)

# fp32 on one CPU: the split attention sums the same products in another order (measured ~1e-7).
ATOL, RTOL = 1e-5, 1e-5



class WholeWindow:
    """The exchange of one cp rank, in one process: the "gather" hands back the whole window's keys and
    values (in the order the real one lays them out), and the "reduce-scatter" keeps what this rank sends
    (its sum over ranks is the test's)."""

    def __init__(self, k, v, cp):
        self.k, self.v, self.cp, self.sent = k, v, cp, None

    def gather_start(self, kv):
        return kv

    def gather_finish(self, pending):
        from titanlike.parallel.chunk_attention import prefix_order, token_major_kv

        return token_major_kv(self.k.detach(), self.v.detach(), 2 * self.cp)[prefix_order(self.cp)]

    def scatter_start(self, send):
        self.sent = send.clone()
        return send

    def scatter_finish(self, pending):
        return torch.zeros((2, *pending.shape[1:]), dtype=pending.dtype)


def unshard_sequence(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's part, in rank order: the inverse of shard_sequence."""
    cp = len(parts)
    halves = [p.chunk(2, dim=dim) for p in parts]
    ordered = [halves[r][0] for r in range(cp)] + [halves[r][1] for r in reversed(range(cp))]
    return torch.cat(ordered, dim=dim)


@pytest.mark.parametrize("kernel", ["CpuKernel", "TorchKernel"])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_causal_chunks_match_whole_window_attention(cp, kernel):
    """The causal path under cp (parallel/chunk_attention.py: each chunk as a square causal block on the
    rank's own keys and an unmasked prefix on the gathered ones, merged by log-sum-exp, backward per part
    with the merged softmax), with each CPU kernel in cuDNN's place: every rank's output, and the key
    and value gradients each rank keeps plus what it sends to be summed, are whole-window causal
    attention's."""
    from titanlike.parallel import chunk_attention
    from titanlike.parallel.context import chunks_of

    torch.manual_seed(0)
    b, heads, kv_heads, seq, dim = 2, 4, 2, 32, 8
    q, k, v = (torch.randn(b, h, seq, dim, requires_grad=True) for h in (heads, kv_heads, kv_heads))
    g = torch.randn(b, heads, seq, dim)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    want_grads = torch.autograd.grad((want * g).sum(), (q, k, v))
    exchanges, outs = [], []
    for r in range(cp):
        exchange = WholeWindow(k, v, cp)
        exchanges.append(exchange)
        local_k, local_v = (shard_sequence(t.detach(), r, cp, dim=2).requires_grad_() for t in (k, v))
        plan = chunk_attention.make_plan(chunks_of(r, cp), getattr(chunk_attention, kernel), exchange)
        outs.append((chunk_attention.causal_chunks(shard_sequence(q, r, cp, dim=2), local_k, local_v, plan),
                     local_k, local_v))
    got = unshard_sequence([out for out, _, _ in outs], dim=2)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    (got * g).sum().backward()
    torch.testing.assert_close(q.grad, want_grads[0], atol=ATOL, rtol=RTOL)
    # What rank r receives: the sum over ranks of what each sent for r's two chunks (sent in prefix order).
    sent = sum(exchange.sent for exchange in exchanges)
    order = chunk_attention.prefix_order(cp)
    for r, (_, local_k, local_v) in enumerate(outs):
        summed_k, summed_v = chunk_attention.kv_views(sent[[order.index(c) for c in chunks_of(r, cp)]])
        for mine, summed, theirs in ((local_k, summed_k, want_grads[1]), (local_v, summed_v, want_grads[2])):
            torch.testing.assert_close(mine.grad + summed, shard_sequence(theirs, r, cp, dim=2), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("cp", [2])
def test_causal_chunk_ops_declare_what_they_return(cp):
    """torch.library's own checks of the two ops compile sees (titanlike::cp_causal_attention_<digest> and
    its backward): the shapes and strides their fake kernels declare are the real ones', and autograd is
    registered, as a compiled graph relies on."""
    from titanlike.parallel import chunk_attention
    from titanlike.parallel.context import chunks_of

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, h, 16 * 2 * cp, 8) for h in (4, 2, 2))
    for r in range(cp):
        plan = chunk_attention.make_plan(chunks_of(r, cp), chunk_attention.CpuKernel, WholeWindow(k, v, cp))
        local = [shard_sequence(t, r, cp, dim=2).requires_grad_() for t in (q, k, v)]
        # (Not test_aot_dispatch_dynamic, seconds of tracing: the compiled tests below run the ops under AOT.)
        torch.library.opcheck(chunk_attention.ATTENTION_OP, (*local, plan),
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_each_ranks_plan_has_its_own_number():
    """The plan's number is in every compiled graph of the ops, and compile's caches key graphs by their
    code: ranks whose parts differ (on cuDNN their saved states differ in size) must write different
    numbers, or one rank loads another's cached graph and fails on the state's size. A plan made again
    keeps its number; the same chunks over another exchange get their own."""
    from titanlike.parallel import chunk_attention
    from titanlike.parallel.context import chunks_of

    exchange = object()
    kernels = (chunk_attention.CudnnKernel, chunk_attention.CpuKernel)
    numbers = {(cp, r, kernel): chunk_attention.make_plan(chunks_of(r, cp), kernel, exchange)
               for cp in (2, 4) for r in range(cp) for kernel in kernels}
    assert len(set(numbers.values())) == len(numbers) == 12
    again = chunk_attention.make_plan(chunks_of(1, 2), chunk_attention.CudnnKernel, exchange)
    assert again == numbers[(2, 1, chunk_attention.CudnnKernel)]
    other = chunk_attention.make_plan(chunks_of(1, 2), chunk_attention.CudnnKernel, object())
    assert other not in numbers.values()


# Rank 0 holds chunks 0 and 3 of cp 2: two squares (L queries by L keys), one prefix (L by 3L); rank 1 holds
# chunks 1 and 2: two squares, and prefixes of L and 2L keys.
ORDER_OF_RANK = {
    0: (["gather", "square 8x8", "square 8x8", "wait", "prefix 8x24"],
        ["gather", "square 8x8", "wait", "prefix 8x24", "reduce-scatter", "square 8x8", "wait"]),
    1: (["gather", "square 8x8", "square 8x8", "wait", "prefix 8x8", "prefix 8x16"],
        ["gather", "square 8x8", "wait", "prefix 8x8", "prefix 8x16", "reduce-scatter", "square 8x8", "wait"]),
}


@pytest.mark.slow  # compile, 7 s on 2 cores
@pytest.mark.parametrize("rank", [0, 1])
def test_collectives_start_before_the_attention_that_does_not_need_them_compiled_too(rank):
    """The order the ops exist for, with the attention compiled as a block compiles it (the ops are opaque to
    it, so inductor cannot move the collectives): forward starts the gather, computes the square blocks,
    then waits; backward starts the gather, computes the first square, waits, computes the prefixes,
    starts the reduce-scatter, computes the other square, then waits. Each kernel call is named with its
    queries and keys."""
    from titanlike.parallel import chunk_attention
    from titanlike.parallel.context import chunks_of

    events: list[str] = []

    class Recording(WholeWindow):
        def gather_start(self, kv):
            events.append("gather")
            return super().gather_start(kv)

        def gather_finish(self, pending):
            events.append("wait")
            return super().gather_finish(pending)

        def scatter_start(self, send):
            events.append("reduce-scatter")
            return super().scatter_start(send)

        def scatter_finish(self, pending):
            events.append("wait")
            return super().scatter_finish(pending)

    def record(q, k, causal):
        events.append(f"{'square' if causal else 'prefix'} {q.shape[2]}x{k.shape[2]}")

    class Kernel(chunk_attention.CpuKernel):
        @staticmethod
        def forward(q, k, v, causal):
            record(q, k, causal)
            return chunk_attention.CpuKernel.forward(q, k, v, causal)

        @staticmethod
        def backward(grad, q, k, v, out, lse, causal, state):
            record(q, k, causal)
            return chunk_attention.CpuKernel.backward(grad, q, k, v, out, lse, causal, state)

    torch.manual_seed(0)
    cp = 2  # a window of 32 tokens: four chunks of 8
    q, k, v = (torch.randn(1, h, 32, 8) for h in (4, 2, 2))
    plan = chunk_attention.make_plan(chunks_of(rank, cp), Kernel, Recording(k, v, cp))
    local = [shard_sequence(t, rank, cp, dim=2).requires_grad_() for t in (q, k, v)]
    attend = torch.compile(lambda q, k, v: chunk_attention.causal_chunks(q, k, v, plan).sum(), fullgraph=True)
    loss = attend(*local)
    forward = list(events)
    events.clear()
    loss.backward()
    assert (forward, events) == ORDER_OF_RANK[rank]


def test_split_then_unsplit_is_identity():
    from titanlike.parallel import chunk_attention

    x = torch.arange(2 * 48 * 3).view(2, 48, 3)
    for cp in (1, 2, 3, 4, 6):
        parts = [shard_sequence(x, r, cp) for r in range(cp)]
        assert all(p.shape == (2, 48 // cp, 3) for p in parts)
        assert torch.equal(unshard_sequence(parts), x)
        # Head-tail balance: rank r holds chunks r and 2cp-1-r, so the positions it holds sum alike.
        positions = [shard_sequence(torch.arange(48), r, cp, dim=0) for r in range(cp)]
        assert len({int(p.sum()) for p in positions}) == 1
        # What the all-gather hands over: ranks' parts stacked along dim 0, to window order.
        kv = torch.arange(2 * 5 * 48 * 4).view(2, 5, 48, 4)  # (keys and values, heads, window, head_dim)
        stacked = torch.cat([shard_sequence(kv, r, cp, dim=2) for r in range(cp)])
        assert torch.equal(window_order(stacked, cp), kv)
        # The fused kernels' gather: chunks in prefix order, each prefix of the window one run of it.
        order = chunk_attention.prefix_order(cp)
        assert sorted(order) == list(range(2 * cp))
        for c in range(2 * cp):
            assert sorted(order[chunk_attention.prefix_run(c, cp)]) == list(range(c))
    assert torch.equal(shard_sequence(torch.arange(8), 0, 2, dim=0), torch.tensor([0, 1, 6, 7]))
    assert torch.equal(shard_sequence(torch.arange(8), 1, 2, dim=0), torch.tensor([2, 3, 4, 5]))


@pytest.mark.parametrize("world,argv,expected", [
    ("3", ["--parallel.cp", "2"], "error: parallel.cp = 2 does not divide the 3 ranks"),
    ("2", ["--parallel.cp", "2", "--data.seq_len", "66"], "error: data.seq_len = 66 must be a multiple of 2 × "
                                                         "parallel.cp = 4"),
    ("2", ["--parallel.cp", "2", "--data.seq_len", "768", "--model.attn_mask", "block_causal"],
     "error: model.attn_mask = block_causal with parallel.cp = 2 runs flex attention on a GPU"),
])
def test_preflight_refuses(monkeypatch, capsys, world, argv, expected):
    """What run_train.sh runs before torchrun: one `error:` line, exit code 2."""
    from titanlike import preflight

    monkeypatch.setenv(preflight.WORLD_ENV, world)
    assert preflight.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(expected) and err.count("\n") == 1, err


# ---- multi-rank workers: each runs in its own process, gloo over a file store ------------------------------


def _gathered(t: torch.Tensor, dim: int) -> torch.Tensor:
    """The whole sequence from every rank's part of `t`."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return unshard_sequence(parts, dim=dim)


def _attention_worker(rank: int, cp: int, mask_kind: str) -> None:
    gen = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, seq, dim = 2, 4, 2, 32, 8
    q = torch.randn(batch, heads, seq, dim, generator=gen)
    k, v = (torch.randn(batch, kv_heads, seq, dim, generator=gen) for _ in range(2))
    weight = torch.randn(batch, heads, seq, dim, generator=gen)
    tokens = torch.randint(0, 5, (batch, seq), generator=gen)  # id 0 ends a document
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    if mask_kind == "causal":
        ref = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True)
    else:
        ref = F.scaled_dot_product_attention(*full, attn_mask=document_mask(tokens, 0, flex=False), enable_gqa=True)
    (ref * weight).sum().backward()

    context = ContextParallel(dist.group.WORLD)
    # Causal: on the fused kernels (the override cp_attention_kernels) and on SDPA's public front door.
    for kernels in (True, False) if mask_kind == "causal" else (context.kernels,):
        context.kernels = kernels
        local = [shard_sequence(t, rank, cp, dim=2).clone().requires_grad_() for t in (q, k, v)]
        _, _, shard = context.shard(tokens, tokens, None if mask_kind == "causal" else 0)
        out = context.attend(*local, shard.mask, True)
        torch.testing.assert_close(out, shard_sequence(ref, rank, cp, dim=2), atol=ATOL, rtol=RTOL)
        (out * shard_sequence(weight, rank, cp, dim=2)).sum().backward()
        for mine, want in zip(local, full, strict=True):
            assert mine.grad is not None and want.grad is not None
            torch.testing.assert_close(_gathered(mine.grad, 2), want.grad, atol=ATOL, rtol=RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("mask_kind", ["causal", "block_causal"])
def test_attention_four_ranks_matches_unsplit(mask_kind):
    spawn_ranks(_attention_worker, 4, mask_kind)


SMALL = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64)


def _model_worker(rank: int, cp: int, attn_mask: str, ac: str, compiled: bool = False) -> None:
    """`compiled`: the cp model's blocks compiled as the trainer compiles them under cp (a block recomputed
    whole checkpointed around its compiled body)."""
    from titanlike.config.speed import ActivationCheckpoint
    from titanlike.model.loss import build_loss
    from titanlike.parallel import apply_activation_checkpointing, apply_compile

    args = ModelArgs(**{**SMALL.__dict__, "attn_mask": attn_mask})
    seq = 32
    tokens = torch.randint(0, 64, (2, seq + 1), generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    loss_fn = build_loss(0, compile=False)

    def built() -> Transformer:
        model = Transformer(args, document_end=3)
        model.init_weights(0, seq)
        apply_activation_checkpointing(model, ActivationCheckpoint(ac, "op"))
        return model

    reference = built()
    want = loss_fn(reference, inputs, targets)
    want.backward()

    model = built()
    context = apply_context_parallel(model, dist.group.WORLD)
    if compiled:
        apply_compile(model, recompute_outside=True)
    loss = loss_fn(model, *context.shard(inputs, targets, model.document_end))
    loss.backward()
    # The window's mean loss is the mean of the ranks' (equal token counts); so is its gradient. Compiled,
    # inductor fuses and orders the sums its own way: a looser tolerance, still far below a wrong gradient's.
    atol, rtol = (1e-5, 1e-4) if compiled else (1e-6, 1e-5)
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    torch.testing.assert_close(mean / cp, want.detach(), atol=atol, rtol=rtol)
    for (name, p), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert p.grad is not None and ref.grad is not None, name
        grad = p.grad.clone()
        dist.all_reduce(grad)
        torch.testing.assert_close(grad / cp, ref.grad, atol=atol, rtol=rtol, msg=name)


def _two_rank_worker(rank: int, cp: int) -> None:
    for mask_kind in ("causal", "block_causal"):
        _attention_worker(rank, cp, mask_kind)
    _model_worker(rank, cp, "causal", "none")
    _model_worker(rank, cp, "block_causal", "selective")


def test_two_ranks_match_unsplit():
    """Attention (causal, block_causal) and the whole model (loss and every gradient) on 2 ranks: one
    pair of processes for all four, to keep the default tier short."""
    spawn_ranks(_two_rank_worker, 2)


@pytest.mark.slow
@pytest.mark.parametrize("attn_mask,ac", [("causal", "full"), ("causal", "selective"), ("block_causal", "none")])
def test_model_four_ranks_matches_unsplit(attn_mask, ac):
    spawn_ranks(_model_worker, 4, attn_mask, ac)



@pytest.mark.slow
def test_compiled_full_recompute_under_cp_matches_unsplit():
    """Compiled blocks under cp with full recompute, checkpointed around their compiled bodies as the trainer
    does under cp: the loss and every gradient of the unsplit eager model."""
    spawn_ranks(_model_worker, 2, "causal", "full", True)


def _saved_bytes_worker(rank: int, world: int, result: str) -> None:
    """What one rank keeps for backward, in bytes (parameters aside), for the whole model at one window
    split over cp = 2, 4 and 8 ranks (groups of this world), causal, no activation checkpointing."""
    from torch.autograd.graph import saved_tensors_hooks

    from titanlike.model.loss import build_loss

    seq = 128
    tokens = torch.randint(0, 64, (2, seq + 1), generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    saved = {}
    for cp in (2, 4, 8):
        groups = [dist.new_group(list(range(first, first + cp))) for first in range(0, world, cp)]
        model = Transformer(SMALL)
        model.init_weights(0, seq)
        context = apply_context_parallel(model, groups[rank // cp])
        params = {p.data_ptr() for p in model.parameters()}
        saved[cp] = 0

        def pack(t: torch.Tensor, cp: int = cp, params: set = params) -> torch.Tensor:
            if t.data_ptr() not in params:
                saved[cp] += t.numel() * t.element_size()
            return t

        with saved_tensors_hooks(pack, lambda t: t):
            loss = build_loss(0, compile=False)(model, *context.shard(inputs, targets, None))
        loss.backward()  # backward gathers the keys and values again, over the group
    if rank == 0:
        with open(result, "w") as f:
            f.write(repr(saved))


@pytest.mark.slow
def test_what_a_rank_keeps_for_backward_shrinks_with_cp(tmp_path):
    """At a fixed window, each rank keeps for backward only its part of the window: its own keys and
    values, never the gathered ones, so the bytes fall as 1/cp from cp 2 to 8 (they grew by the gathered
    window's keys and values in every layer, whatever cp, when attention kept them)."""
    import ast

    result = tmp_path / "saved.txt"
    spawn_ranks(_saved_bytes_worker, 8, str(result))
    saved = ast.literal_eval(result.read_text())
    assert saved[2] > saved[4] > saved[8] > 0, saved
    for cp in (4, 8):
        assert saved[cp] * cp == pytest.approx(saved[2] * 2, rel=0.01), saved


def _compiled_saved_shapes_worker(rank: int, world: int, seq: int, result: str) -> None:
    """The shape of every tensor (parameters aside) one cp rank's compiled blocks keep for backward."""
    from torch.autograd.graph import saved_tensors_hooks

    from titanlike.model.loss import build_loss
    from titanlike.parallel.compile import apply_compile

    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=64))
    model.init_weights(0, seq)
    context = apply_context_parallel(model, dist.group.WORLD)
    apply_compile(model)
    tokens = torch.randint(0, 64, (1, seq + 1), generator=torch.Generator().manual_seed(1))
    params = {p.data_ptr() for p in model.parameters()}
    shapes = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in params:
            shapes.append(tuple(t.shape))
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        loss = build_loss(0, compile=False)(model, *context.shard(tokens[:, :-1], tokens[:, 1:], None))
    loss.backward()
    if rank == 0:  # rank 0 holds the window's first and last chunks: its prefixes reach furthest
        with open(result, "w") as f:
            f.write(repr(shapes))


@pytest.mark.slow
def test_compiled_blocks_keep_no_gathered_keys_for_backward(tmp_path):
    """Compiled, a cp rank keeps for backward nothing longer than its own part of the window: the gathered
    keys and values are not kept (compile traces forward and backward as one graph, and it merged
    backward's gather with forward's, then kept the window's keys and values from one to the other)."""
    import ast

    seq, cp = 512, 2
    result = tmp_path / "shapes.txt"
    spawn_ranks(_compiled_saved_shapes_worker, cp, seq, str(result))
    shapes = ast.literal_eval(result.read_text())
    assert shapes, "nothing was saved for backward: the hook saw nothing"
    # The model's widths (64, 128, 16) are all below seq / cp = 256; a gathered prefix is 384 or 512 long.
    assert max(max(s, default=0) for s in shapes) <= seq // cp, shapes


# ---- whole runs: torchrun on run_train.sh, 2 gloo ranks with --parallel.cp 2 (slow tier) ---------------

STEPS = 6
# One global batch of 4 windows per step for every run: one process reads them as 2 micro-batches of 2;
# the 2 cp ranks both read the same 2 micro-batches, each keeping half of every window.
RUN = ("--training.steps", str(STEPS), "--metrics.log_freq", "1", "--data.seq_len", "64",
       "--training.local_batch_size", "2", "--training.global_batch_size", "4", "--validation.enable", "false",
       "--checkpoint.enable", "--checkpoint.interval", "3")
# Measured here: cp 2 and one process agree to ~1e-7 relative (attention sums in another order).
LOSS_RTOL = 2e-6


def _assert_close_losses(got: dict, want: dict, steps) -> None:
    assert sorted(got) == list(steps), sorted(got)
    for step in steps:
        assert abs(got[step] - want[step]) <= LOSS_RTOL * abs(want[step]), (step, got[step], want[step])


@pytest.fixture(scope="module", params=["causal", "block_causal"])
def runs(request, tmp_path_factory):
    """(mask, one-process run, cp 2 run) on the same data (the embedded corpus, whose tokenizer marks
    document ends) and seed, each checkpointed at steps 3 and 6."""
    from conftest import run_train, step_losses, train_here

    mask = ("--model.attn_mask", request.param)
    one, two = tmp_path_factory.mktemp("cp1"), tmp_path_factory.mktemp("cp2")
    train_here(one, *RUN, *mask)
    proc = run_train(two, *RUN, *mask, "--parallel.cp", "2", nproc=2)
    assert "(dp_replicate 1 × dp_shard 1 × cp 2)" in proc.stderr and "2 micro-batches" in proc.stderr
    assert step_losses(one)[STEPS] < step_losses(one)[1] - 0.5  # it trains: equal losses are not trivial
    return mask, one, two


@pytest.mark.slow
def test_cp2_training_matches_one_process(runs):
    from conftest import metrics, step_losses

    _, one, two = runs
    _assert_close_losses(step_losses(two), step_losses(one), range(1, STEPS + 1))
    norms = {r["step"]: r["grad_norm"] for r in metrics(one)}
    for r in metrics(two):
        assert r["grad_norm"] == pytest.approx(norms[r["step"]], rel=5e-5), r["step"]


@pytest.mark.slow
def test_cp2_on_stock_torch_matches_one_process(runs, tmp_path):
    """--parallel.overrides off: causal attention through SDPA's public front door and DTensor's gather."""
    from conftest import run_train, step_losses

    mask, one, _ = runs
    if mask[1] != "causal":
        pytest.skip("block_causal runs the same public path with overrides on or off")
    proc = run_train(tmp_path, *RUN, *mask, "--parallel.cp", "2", "--parallel.overrides", "off",
                     "--checkpoint.enable", "false", nproc=2)
    assert "off, stock behaviour: " in proc.stderr and "cp_attention_kernels (parallel.overrides)" in proc.stderr
    _assert_close_losses(step_losses(tmp_path), step_losses(one), range(1, STEPS + 1))


@pytest.mark.slow
def test_checkpoint_moves_between_cp_degrees(runs, tmp_path):
    """Saved with cp 2, resumed with cp 1, and the reverse: DCP reshards the FSDP-sharded weights and
    optimizer state by itself; the resumed steps match the uninterrupted runs to fp32 rounding (not bit
    for bit: cp 2 and one process sum attention in different orders)."""
    from conftest import ckpt, run_train, step_losses, train_here

    mask, one, two = runs
    if mask[1] != "causal":
        pytest.skip("one mask suffices: what DCP reshards does not depend on it")
    to_one, to_two = tmp_path / "to_cp1", tmp_path / "to_cp2"
    for src, dst in ((two, to_one), (one, to_two)):
        shutil.copytree(ckpt(src) / "step-3", ckpt(dst) / "step-3")
    train_here(to_one, *RUN, *mask)
    proc = run_train(to_two, *RUN, *mask, "--parallel.cp", "2", nproc=2)
    assert "resumed from" in proc.stderr
    _assert_close_losses(step_losses(to_one), step_losses(two), range(4, STEPS + 1))
    _assert_close_losses(step_losses(to_two), step_losses(one), range(4, STEPS + 1))


@pytest.mark.slow
def test_cp2_compiled_tracks_eager(runs, tmp_path):
    """cp 2 with the blocks compiled (the causal chunks' Function with its collectives, or the gather and
    the document mask, inside the compiled graph) and selective activation checkpointing."""
    from conftest import run_train, step_losses

    mask, one, _ = runs
    if mask[1] != "causal":
        pytest.skip("one mask on the CPU (compile is slow here); the GPU tier compiles both")
    run_train(tmp_path, *RUN, *mask, "--parallel.cp", "2", "--compile.enable", "--activation_checkpoint.mode",
              "selective", "--checkpoint.enable", "false", nproc=2, timeout=900)
    got, want = step_losses(tmp_path), step_losses(one)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in got:  # inductor may fuse and reorder fp32 arithmetic
        assert got[step] == pytest.approx(want[step], rel=1e-4), step


@pytest.mark.slow
@pytest.mark.parametrize("replicate", ["2"])
def test_cp2_with_data_parallel_matches_one_process(runs, tmp_path, replicate):
    """4 ranks: cp 2 × dp_replicate 2 (HSDP): the two data-parallel groups read different halves of each
    global batch (their rank is rank // cp), and the losses are one process's, which reads the same 4
    windows as 2 micro-batches. (cp 2 × dp_shard 2, FSDP over all 4, trains in test_stages.py's
    four-rank stage test; the data layout, rank // cp, is the same.)"""
    from conftest import run_train, step_losses

    mask, one, _ = runs
    if mask[1] != "causal":
        pytest.skip("one mask suffices: how ranks are laid out does not depend on it")
    proc = run_train(tmp_path, *RUN, *mask, "--parallel.cp", "2", "--parallel.dp_replicate", replicate,
                     "--checkpoint.enable", "false", nproc=4, timeout=900)
    shard = "1" if replicate == "2" else "2"
    assert f"(dp_replicate {replicate} × dp_shard {shard} × cp 2)" in proc.stderr and "1 micro-batches" in proc.stderr
    _assert_close_losses(step_losses(tmp_path), step_losses(one), range(1, STEPS + 1))


@pytest.mark.slow
def test_cp2_with_float8_all_gather_tracks_float8_one_process(tmp_path):
    """Tensorwise float8 (emulated on a CPU) with FSDP's float8 all-gather over the dp_shard × cp ranks:
    close to one process in float8 (each rank scales its own tokens' activations, so not to rounding)."""
    from conftest import run_train, step_losses, train_here

    fp8 = ("--fp8.recipe", "tensorwise", "--fp8.emulate", "--fp8.auto_filter", "false",
           "--checkpoint.enable", "false")
    train_here(tmp_path / "one", *RUN, *fp8)
    proc = run_train(tmp_path / "two", *RUN, *fp8, "--parallel.cp", "2", nproc=2)
    assert "float8 all-gather on" in proc.stderr
    one, two = step_losses(tmp_path / "one"), step_losses(tmp_path / "two")
    assert sorted(two) == list(range(1, STEPS + 1))
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-2), step


@pytest.mark.parametrize("cp", [2, 4])
def test_a_ranks_document_blockmask_is_torchs_and_laid_out_as_flex_reads_it(cp):
    """A cp rank's BlockMask (its queries against the whole window, model/masks.py document_mask_at): the
    blocks of torch's create_block_mask for the same mask function, and every count and index list
    contiguous. Flex's kernels read the lists row after row; the query-side lists (what backward reads)
    once came out with transposed strides for these non-square masks, and the key and value gradients
    were wrong on a GPU while this CPU comparison of values alone passed."""
    from torch.nn.attention.flex_attention import create_block_mask

    from titanlike.model.masks import document_ids, document_mask_at

    seq = 2048
    tokens = torch.randint(0, 300, (2, seq), generator=torch.Generator().manual_seed(cp))
    docs = document_ids(tokens, 0)
    for rank in range(cp):
        mask = document_mask_at(docs, shard_sequence(torch.arange(seq), rank, cp, dim=0), flex=True)
        reference = create_block_mask(mask.mask_mod, 2, None, seq // cp, seq, device="cpu")
        for side in ("kv", "full_kv", "q", "full_q"):
            counts, indices = getattr(mask, f"{side}_num_blocks"), getattr(mask, f"{side}_indices")
            assert counts.is_contiguous() and indices.is_contiguous(), (rank, side)
            want_counts, want_indices = getattr(reference, f"{side}_num_blocks"), getattr(reference, f"{side}_indices")
            assert torch.equal(counts, want_counts), (rank, side)
            for row in itertools.product(*map(range, counts.shape)):
                n = int(counts[row])
                assert sorted(indices[row][:n].tolist()) == sorted(want_indices[row][:n].tolist()), (rank, side, row)
