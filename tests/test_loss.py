"""The loss over whole logits and chunk by chunk (training.loss_chunk_tokens): the same loss and
gradients, the chunked one never keeps the whole (tokens × vocab) logits for backward, and on one
process (the fused kind) it does no more matmul work than whole logits."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from conftest import losses, metrics, run_train
from titanlike.float8 import Float8Options, layers
from titanlike.model.decoder import Transformer
from titanlike.model.loss import (
    LinearCrossEntropy,
    build_loss,
    chunked_output_loss,
    cross_entropy_sum_and_grad,
    fuses,
)
from titanlike.model.shape import model_args

BATCH, SEQ = 3, 40  # 120 tokens: chunks of 7 leave a last chunk of 1


def model_and_batch(tie: bool = False, float8_output: bool = False):
    torch.manual_seed(0)
    args = model_args("debug", n_layers=2, tie_embeddings=tie)
    model = Transformer(args)
    model.init_weights(seed=1, seq_len=SEQ)
    if float8_output:
        report = layers.convert(model, Float8Options(recipe="tensorwise", emulate=True, auto_filter=False,
                                                     filter_fqns=("layers",)))
        assert report.converted == ["output"]
    tokens = torch.randint(0, args.vocab_size, (BATCH, SEQ + 1))
    return model, tokens[:, :-1], tokens[:, 1:]


def loss_and_grads(model, inputs, targets, chunk_tokens: int, compile: bool = False, compile_head: bool = False):
    model.zero_grad(set_to_none=True)
    loss = build_loss(chunk_tokens, compile, compile_head)(model, inputs, targets)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("chunk_tokens", [7, 64, 1000])
def test_chunked_loss_equals_whole_logits(tie, chunk_tokens):
    """Loss and every gradient (the output layer's, a tied embedding's, the blocks') within fp32 tolerance."""
    model, inputs, targets = model_and_batch(tie)
    want_loss, want_grads = loss_and_grads(model, inputs, targets, 0)
    loss, grads = loss_and_grads(model, inputs, targets, chunk_tokens)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == want_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], want_grads[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("chunk_tokens,rtol", [(1000, 1e-6), (7, 2e-2)])
def test_chunked_loss_with_a_float8_output_layer(chunk_tokens, rtol):
    """A float8 output layer (emulated) takes its dynamic tensorwise scales per call: one chunk holding
    every token gives the whole-logits numbers; smaller chunks scale each chunk by its own amax, so
    the loss and gradients differ from the whole-logits ones by float8 rounding, no more."""
    model, inputs, targets = model_and_batch(float8_output=True)
    want_loss, want_grads = loss_and_grads(model, inputs, targets, 0)
    loss, grads = loss_and_grads(model, inputs, targets, chunk_tokens)
    torch.testing.assert_close(loss, want_loss, rtol=rtol, atol=1e-6)
    for name in grads:
        rel = (grads[name] - want_grads[name]).norm() / want_grads[name].norm()
        assert rel <= max(rtol, 1e-6) * 5, (name, rel.item())


@pytest.mark.slow  # two compiles; the default tier compiles the head's loss below
def test_chunked_loss_compiled_equals_whole_logits():
    model, inputs, targets = model_and_batch()
    want_loss, want_grads = loss_and_grads(model, inputs, targets, 0, compile=True)
    loss, grads = loss_and_grads(model, inputs, targets, 32, compile=True)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    for name in grads:
        torch.testing.assert_close(grads[name], want_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("float8_output", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_compiled_head_equals_eager_loss(float8_output):
    """One process, compiled: the final norm, the output layer (bf16 or float8) and the loss as one
    graph give the eager loss and gradients; and the same compiled loss serves under no_grad (validation)."""
    model, inputs, targets = model_and_batch(float8_output=float8_output)
    want_loss, want_grads = loss_and_grads(model, inputs, targets, 0)
    loss, grads = loss_and_grads(model, inputs, targets, 0, compile=True, compile_head=True)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    for name in grads:
        torch.testing.assert_close(grads[name], want_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():
        again = build_loss(0, compile=True, compile_head=True)(model, inputs, targets)
    torch.testing.assert_close(again, want_loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk_tokens", [0, 16])
def test_chunked_loss_keeps_no_logits_for_backward(chunk_tokens):
    """What autograd saves for backward: the whole (tokens × vocab) logits without chunks; with
    chunks, no logits at all (backward recomputes each chunk's)."""
    model, inputs, targets = model_and_batch()
    vocab = model.args.vocab_size
    logits_saved: list[int] = []

    def pack(t):
        # Logits, their fp32 copy, the softmax; not the output weight (saved transposed: dim × vocab).
        if t.shape and t.shape[-1] == vocab and t.numel() != model.args.dim * vocab:
            logits_saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = build_loss(chunk_tokens, compile=False)(model, inputs, targets)
    if chunk_tokens:
        assert logits_saved == []
    else:
        assert max(logits_saved) == BATCH * SEQ * vocab
    loss.backward()


def matmul_flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def test_fused_chunked_loss_computes_each_chunks_logits_once():
    """One process with a plain output layer: the chunked loss (fused) does exactly the matmul FLOPs
    of whole logits; the recomputed kind (FSDP, float8 output layer) does one more output-layer
    matmul per token, 2 × dim × vocab FLOPs, to rebuild the logits in backward."""
    model, inputs, targets = model_and_batch()
    assert fuses(model.output)
    whole = matmul_flops(lambda: loss_and_grads(model, inputs, targets, 0))
    fused = matmul_flops(lambda: loss_and_grads(model, inputs, targets, 16))
    assert fused == whole

    def recomputed():
        model.zero_grad(set_to_none=True)
        loss = model(inputs, head=lambda norm, output, h: chunked_output_loss(output, norm(h), targets, 16))
        loss.backward()

    tokens, dim, vocab = BATCH * SEQ, model.args.dim, model.args.vocab_size
    assert matmul_flops(recomputed) == whole + 2 * tokens * dim * vocab


def test_fused_chunked_loss_under_bf16_autocast():
    """Under autocast (one GPU's mixed precision) the fused loss computes in bf16 as nn.Linear would,
    and hands back a gradient in the weight's own dtype (fp32): the same numbers as the recomputed
    chunks within bf16 rounding; and validation (no_grad) gives the same loss."""
    model, inputs, targets = model_and_batch()

    def run(loss_fn):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn()
        loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}

    want_loss, want_grads = run(lambda: model(
        inputs, head=lambda norm, output, h: chunked_output_loss(output, norm(h), targets, 16)))
    loss, grads = run(lambda: build_loss(16, compile=False)(model, inputs, targets))
    assert grads["output.weight"].dtype == torch.float32
    torch.testing.assert_close(loss, want_loss, rtol=1e-2, atol=1e-3)
    for name in grads:
        rel = (grads[name] - want_grads[name]).norm() / want_grads[name].norm()
        assert rel < 2e-2, (name, rel.item())
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        again = build_loss(16, compile=False)(model, inputs, targets)
    torch.testing.assert_close(again, loss, rtol=1e-2, atol=1e-3)


def test_fused_chunked_loss_backward_runs_once():
    """Its backward scales the saved weight gradient in place, so a second backward through the same
    graph (retain_graph) is refused rather than answered with a doubly scaled gradient."""
    h = torch.randn(10, 8, requires_grad=True)
    weight = torch.randn(32, 8, requires_grad=True)
    loss = LinearCrossEntropy.apply(h, weight, torch.randint(0, 32, (10,)), 4, cross_entropy_sum_and_grad)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="runs once"):
        loss.backward()


@pytest.mark.slow  # two 2-rank runs; the default tier has the in-process FSDP test below
@pytest.mark.parametrize("tie", [False])
def test_two_rank_fsdp_chunked_loss_matches_whole(tmp_path, corpus, tie):
    """Under FSDP2 (2 gloo ranks) the fused chunked loss runs inside the output layer's FSDP hooks
    (its `loss_sum`): every step's loss and gradient norm match the whole-logits run."""
    common = ["--training.steps", "4", "--metrics.log_freq", "1", "--model.tie_embeddings", str(tie).lower(),
              "--training.local_batch_size", "2", "--data.seq_len", "64"]
    run_train(tmp_path / "whole", *common, nproc=2, corpus=corpus)
    run_train(tmp_path / "chunked", *common, "--training.loss_chunk_tokens", "48", nproc=2, corpus=corpus)
    whole, chunked = losses(tmp_path / "whole"), losses(tmp_path / "chunked")
    assert whole.keys() == chunked.keys() == {1, 2, 3, 4}
    for step in whole:
        assert chunked[step] == pytest.approx(whole[step], rel=1e-5), step
    grad_norms = [(a["grad_norm"], b["grad_norm"]) for a, b in zip(metrics(tmp_path / "whole"),
                                                                   metrics(tmp_path / "chunked"))]
    for a, b in grad_norms:
        assert b == pytest.approx(a, rel=1e-4)



@pytest.mark.parametrize("reshard", ["default", "always"])
def test_fsdp_chunked_loss_is_fused_with_the_gathered_weight(tmp_path, reshard):
    """Under FSDP2 (one gloo rank, in this process) the output layer's `loss_sum` runs as a forward:
    the chunked loss reads the gathered weight, computes each chunk's logits once (whole logits'
    matmul FLOPs, no recomputation in backward), and gives the unsharded model's loss and gradients;
    also with the output layer freed after forward and not gathered for backward (reshard default:
    backward needs no output weight)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from titanlike.parallel.fsdp import apply_fsdp

    want_model, inputs, targets = model_and_batch()
    want_loss, want_grads = loss_and_grads(want_model, inputs, targets, 0)
    whole = matmul_flops(lambda: loss_and_grads(want_model, inputs, targets, 0))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model, _, _ = model_and_batch()
        apply_fsdp(model, init_device_mesh("cpu", (1,)), None, reshard, fused_loss=True)
        assert fuses(model.output)
        assert matmul_flops(lambda: loss_and_grads(model, inputs, targets, 16)) == whole
        loss, grads = loss_and_grads(model, inputs, targets, 16)
        torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
        for name, grad in grads.items():
            torch.testing.assert_close(grad.full_tensor(), want_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("path", ["whole", "fused", "recomputed", "float8 output"])
def test_token_loss_is_the_same_loss_with_each_tokens_loss_beside_it(path):
    """A mixture's loss (build_loss's per_token) gives the plain loss's mean and gradients bit for bit, on
    every path (whole logits, fused chunks, recomputed chunks as under FSDP, a float8 output layer),
    and each token's detached loss beside it: their mean is the loss."""
    model, inputs, targets = model_and_batch(float8_output=path == "float8 output")
    chunk_tokens = 0 if path == "whole" else 16
    if path == "recomputed":
        model.output.__class__ = type("Unfused", (torch.nn.Linear,), {})  # FSDP's wrapper class: not fused
    assert fuses(model.output) == (path in ("whole", "fused"))
    want_loss, want_grads = loss_and_grads(model, inputs, targets, chunk_tokens)
    model.zero_grad(set_to_none=True)
    loss, tokens = build_loss(chunk_tokens, compile=False, per_token=True)(model, inputs, targets)
    loss.backward()
    assert torch.equal(loss.detach(), want_loss)
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, want_grads[name]), name
    assert tokens.shape == targets.shape and tokens.dtype == torch.float32 and not tokens.requires_grad
    torch.testing.assert_close(tokens.mean(), want_loss, rtol=1e-6, atol=1e-6)
    if path != "float8 output":  # float8 scales each chunk's logits by its own amax: not the whole logits'
        with torch.no_grad():
            want_tokens = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(0, 1),
                                                            reduction="none")
        torch.testing.assert_close(tokens.flatten(), want_tokens, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("chunk_tokens,compile_head", [(0, True), (0, False), (16, False)])
def test_compiled_token_loss_is_the_compiled_loss(chunk_tokens, compile_head):
    """Compiled, too, a mixture's loss is the plain loss bit for bit (its graph also returns each
    token's loss; the mean's operations are the same), and so is every gradient."""
    model, inputs, targets = model_and_batch()
    want_loss, want_grads = loss_and_grads(model, inputs, targets, chunk_tokens, compile=True,
                                           compile_head=compile_head)
    model.zero_grad(set_to_none=True)
    token_loss = build_loss(chunk_tokens, compile=True, compile_head=compile_head, per_token=True)
    loss, tokens = token_loss(model, inputs, targets)
    loss.backward()
    assert torch.equal(loss.detach(), want_loss)
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, want_grads[name]), name
    torch.testing.assert_close(tokens.mean(), want_loss, rtol=1e-6, atol=1e-6)
