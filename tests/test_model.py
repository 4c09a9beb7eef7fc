"""The Llama model: sizes, FLOPs, rotary embeddings, causality, GQA, tied embeddings, init."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from titanlike.model.decoder import Attention, Transformer, apply_rope, rope_tables
from titanlike.model.shape import PRESETS, ModelArgs, count_params, flops_per_token, model_args

SMALL = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=97, rope_theta=10000.0)


def meta_numel(args: ModelArgs) -> int:
    with torch.device("meta"):
        model = Transformer(args)
    return sum(p.numel() for p in model.parameters())  # shared (tied) parameters count once


def build(args: ModelArgs, seed: int = 0, seq_len: int = 32) -> Transformer:
    """As the trainer does it: on the meta device, materialised, then initialised."""
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(seed, seq_len)
    return model


# ---- sizes and FLOPs ------------------------------------------------------------------------------


@pytest.mark.parametrize("flavor", list(PRESETS))
@pytest.mark.parametrize("tie", [False, True])
def test_count_params_matches_the_module(flavor, tie):
    args = model_args(flavor, tie_embeddings=tie)
    total, embed = count_params(args)
    assert total == meta_numel(args)
    assert embed == args.vocab_size * args.dim


@pytest.mark.parametrize("flavor,published", [("8b", 8.03e9), ("70b", 70.55e9)])
def test_llama3_sizes(flavor, published):
    # Meta's published sizes of Llama 3 8B (8,030,261,248) and 70B (70,553,706,496).
    total, _ = count_params(PRESETS[flavor])
    assert abs(total - published) / published < 0.005, total


def test_flops_per_token_by_hand():
    a, seq = PRESETS["debug"], 256
    assert not a.tie_embeddings
    hd = a.dim // a.n_heads
    # Parameters counted from the architecture, independently of count_params:
    attention = a.dim * (a.n_heads * hd) + 2 * a.dim * (a.n_kv_heads * hd) + (a.n_heads * hd) * a.dim
    ffn = 3 * a.dim * a.ffn_dim
    norms = 2 * a.dim
    params = a.n_layers * (attention + ffn + norms) + a.dim + 2 * a.vocab_size * a.dim
    embedding = a.vocab_size * a.dim
    expected = 6 * (params - embedding) + 12 * a.n_layers * a.n_heads * hd * seq
    assert flops_per_token(a, seq) == expected
    # The attention term grows linearly with the sequence.
    assert flops_per_token(a, 2 * seq) - flops_per_token(a, seq) == 12 * a.n_layers * a.n_heads * hd * seq


def test_flops_8b():
    a = PRESETS["8b"]
    # 6 × (8.03e9 - 128256·4096 embedding) + 12·32·32·128·8192
    expected = 6 * (8_030_261_248 - 128256 * 4096) + 12 * 32 * 32 * 128 * 8192
    assert flops_per_token(a, 8192) == expected


def test_tied_output_still_does_its_matmul():
    a = PRESETS["debug"]
    tied = replace(a, tie_embeddings=True)
    assert count_params(tied)[0] == count_params(a)[0] - a.vocab_size * a.dim
    assert flops_per_token(tied, 128) == flops_per_token(a, 128)


# ---- rotary embeddings -----------------------------------------------------------------------------


def rope_reference(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Complex-number RoPE: (x_i, x_{i+D/2}) is z_i, turned by pos · θ^(-2i/D)."""
    b, s, h, d = x.shape
    half = d // 2
    xd = x.double()
    z = torch.complex(xd[..., :half], xd[..., half:])
    i = torch.arange(half, dtype=torch.float64)
    pos = torch.arange(s, dtype=torch.float64)
    angle = pos[:, None] * theta ** (-2 * i / d)[None, :]  # (s, half)
    z = z * torch.polar(torch.ones_like(angle), angle)[None, :, None, :]
    return torch.cat([z.real, z.imag], dim=-1)


@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_rope_against_complex_reference(theta):
    torch.manual_seed(0)
    x = torch.randn(2, 50, 3, 16)
    cos, sin = rope_tables(16, 50, theta)
    out = apply_rope(x, cos, sin)
    assert out.dtype == x.dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), rope_reference(x, theta), rtol=1e-5, atol=1e-5)
    # Position 0 is not rotated; later positions are.
    torch.testing.assert_close(out[:, 0], x[:, 0])
    assert not torch.allclose(out[:, 1], x[:, 1])


def test_rope_scores_depend_on_relative_position_only():
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 32), torch.randn(1, 1, 1, 32)
    cos, sin = rope_tables(32, 64, 10000.0)

    def score(m, n):
        qm = apply_rope(q.expand(1, 64, 1, 32).contiguous(), cos, sin)[0, m, 0]
        kn = apply_rope(k.expand(1, 64, 1, 32).contiguous(), cos, sin)[0, n, 0]
        return float(qm @ kn)

    assert math.isclose(score(10, 3), score(40, 33), rel_tol=1e-4)
    assert math.isclose(score(5, 5), score(60, 60), rel_tol=1e-4)
    assert not math.isclose(score(10, 3), score(10, 4), rel_tol=1e-3)


def test_rope_keeps_bf16_dtype():
    x = torch.randn(1, 8, 2, 16, dtype=torch.bfloat16)
    cos, sin = rope_tables(16, 8, 10000.0)
    assert apply_rope(x, cos, sin).dtype == torch.bfloat16


def test_residual_stream_in_the_autocast_dtype():
    """Under autocast (one GPU) the blocks see and pass on bf16, as under FSDP's bf16 parameters."""
    model = build(SMALL)
    seen = []
    for layer in model.layers:
        layer.register_forward_hook(lambda _m, args, out: seen.append((args[0].dtype, out.dtype)))
    tokens = torch.randint(0, SMALL.vocab_size, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens)
    assert seen == [(torch.bfloat16, torch.bfloat16)] * SMALL.n_layers and logits.dtype == torch.bfloat16
    logits.float().square().mean().backward()
    assert model.tok_embeddings.weight.grad.dtype == torch.float32  # the weights themselves stay fp32
    seen.clear()
    model(tokens)  # without autocast nothing is cast
    assert seen == [(torch.float32, torch.float32)] * SMALL.n_layers


def test_blocks_share_one_copy_of_the_rope_tables_in_the_weights_dtype():
    """With bf16 weights and no autocast (FSDP's mixed precision) the model hands every block one bf16 copy of
    the RoPE tables, which FSDP would otherwise make per block (each kept for backward); the blocks compute
    what they computed from their own cast. Under autocast the tables stay fp32."""
    model = build(SMALL)
    for p in model.parameters():  # as FSDP's gathered bf16 weights: the fp32 RoPE buffers stay
        p.data = p.data.to(torch.bfloat16)
    assert model.rope_cos.dtype == torch.float32
    tables = []
    for layer in model.layers:
        layer.register_forward_pre_hook(lambda _m, args: tables.append(args[1:3]))
    tokens = torch.randint(0, SMALL.vocab_size, (2, 16))
    logits = model(tokens)
    assert {(cos.dtype, sin.dtype) for cos, sin in tables} == {(torch.bfloat16, torch.bfloat16)}
    assert len({cos.data_ptr() for cos, _ in tables}) == 1
    h, cos, sin = model.tok_embeddings(tokens), model.rope_cos[:16].to(torch.bfloat16), model.rope_sin[:16].to(
        torch.bfloat16)
    for layer in model.layers:  # each block casting the fp32 tables for itself
        h = layer(h, cos.clone(), sin.clone(), None)
    assert torch.equal(logits, model.output(model.norm(h)))
    tables.clear()
    model = build(SMALL)
    model.layers[0].register_forward_pre_hook(lambda _m, args: tables.append(args[1:3]))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(tokens)
    assert tables[0][0].dtype == torch.float32


# ---- attention --------------------------------------------------------------------------------------


def test_causal_masking():
    model = build(SMALL, seq_len=24)
    torch.manual_seed(1)
    tokens = torch.randint(0, SMALL.vocab_size, (2, 24))
    changed = tokens.clone()
    t = 13
    changed[:, t] = (changed[:, t] + 1) % SMALL.vocab_size
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-6)
    # The change is visible from position t on, so the comparison above could fail.
    assert (a[:, t:] - b[:, t:]).abs().amax(dim=-1).min() > 1e-4


def test_gqa_shapes():
    a = PRESETS["debug"]
    attn = Attention(a)
    hd = a.dim // a.n_heads
    assert attn.wqkv.weight.shape == ((a.n_heads + 2 * a.n_kv_heads) * hd, a.dim)
    assert attn.wo.weight.shape == (a.dim, a.n_heads * hd)
    x = torch.randn(2, 10, a.dim)
    cos, sin = rope_tables(hd, 10, a.rope_theta)
    assert attn(x, cos, sin).shape == (2, 10, a.dim)
    assert build(SMALL)(torch.randint(0, 97, (3, 11))).shape == (3, 11, 97)


def _qkv(attn: Attention) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of the q, k and v rows of the stacked projection."""
    kv = attn.n_kv_heads * attn.head_dim
    return attn.wqkv.weight.split([attn.n_heads * attn.head_dim, kv, kv], dim=0)


def test_gqa_equals_attention_with_repeated_kv_heads():
    """Query head h reads kv head h // (n_heads / n_kv_heads): same as MHA with each kv head repeated."""
    torch.manual_seed(0)
    gqa_args = replace(SMALL, n_heads=8, n_kv_heads=2)
    gqa, mha = Attention(gqa_args), Attention(replace(gqa_args, n_kv_heads=8))
    hd, rep, dim = gqa_args.head_dim, 4, gqa_args.dim

    def load_mha(expand):
        with torch.no_grad():
            (gq, gk, gv), (mq, mk, mv) = _qkv(gqa), _qkv(mha)
            mq.copy_(gq)
            mha.wo.weight.copy_(gqa.wo.weight)
            for g, m in ((gk, mk), (gv, mv)):
                m.copy_(expand(g.view(2, hd, dim)).reshape(8 * hd, dim))

    x = torch.randn(2, 12, dim)
    cos, sin = rope_tables(hd, 12, gqa_args.rope_theta)
    load_mha(lambda w: w.repeat_interleave(rep, dim=0))
    torch.testing.assert_close(gqa(x, cos, sin), mha(x, cos, sin))
    # Pairing kv heads differently (tile instead of interleave) gives another result.
    load_mha(lambda w: w.repeat(rep, 1, 1))
    assert not torch.allclose(gqa(x, cos, sin), mha(x, cos, sin), atol=1e-4)


def test_stacked_qkv_equals_three_projections():
    """wqkv's rows are q, then k, then v: the attention equals one computed from three Linears."""
    torch.manual_seed(0)
    a = replace(SMALL, n_heads=8, n_kv_heads=2)
    attn = Attention(a)
    x = torch.randn(2, 12, a.dim)
    cos, sin = rope_tables(a.head_dim, 12, a.rope_theta)
    wq, wk, wv = _qkv(attn)
    q = apply_rope((x @ wq.T).view(2, 12, 8, a.head_dim), cos, sin).transpose(1, 2)
    k = apply_rope((x @ wk.T).view(2, 12, 2, a.head_dim), cos, sin).transpose(1, 2).repeat_interleave(4, dim=1)
    v = (x @ wv.T).view(2, 12, 2, a.head_dim).transpose(1, 2).repeat_interleave(4, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 12, -1)
    torch.testing.assert_close(attn(x, cos, sin), attn.wo(out))


# ---- tied embeddings and init --------------------------------------------------------------------------


def test_tied_embeddings_share_storage():
    args = replace(SMALL, tie_embeddings=True)
    model = build(args)  # meta → to_empty → init_weights, as in training
    assert model.output.weight is model.tok_embeddings.weight
    assert model.output.weight.data_ptr() == model.tok_embeddings.weight.data_ptr()
    assert sum(p.numel() for p in model.parameters()) == count_params(args)[0]
    # A gradient step on the one shared tensor moves both uses.
    model(torch.randint(0, 97, (2, 8))).sum().backward()
    with torch.no_grad():
        model.tok_embeddings.weight -= model.tok_embeddings.weight.grad
    assert torch.equal(model.output.weight, model.tok_embeddings.weight)
    untied = build(SMALL)
    assert untied.output.weight.data_ptr() != untied.tok_embeddings.weight.data_ptr()


def test_init_weights_deterministic():
    a, b, c = build(SMALL, seed=3), build(SMALL, seed=3), build(SMALL, seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys() == sc.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name
        if name.endswith("norm.weight"):
            assert torch.equal(sa[name], torch.ones_like(sa[name]))
        else:
            assert not torch.equal(sa[name], sc[name]), name
    # Every parameter draws from its own stream: no two matrices of the same shape are equal.
    assert not torch.equal(sa["layers.0.attention.wqkv.weight"], sa["layers.1.attention.wqkv.weight"])
    # Independent of the global RNG.
    torch.manual_seed(123)
    d = build(SMALL, seed=3)
    assert all(torch.equal(sa[n], t) for n, t in d.state_dict().items())


def test_init_scales():
    model = build(PRESETS["debug"], seed=0)
    a = model.args
    std = {n: p.std().item() for n, p in model.named_parameters()}
    assert abs(std["layers.0.attention.wqkv.weight"] - 0.02) < 0.002
    assert abs(std["layers.0.feed_forward.w2.weight"] - 0.02 / math.sqrt(2 * a.n_layers)) < 0.001
    assert abs(std["output.weight"] - a.dim**-0.5) < 0.1 * a.dim**-0.5
    for n, p in model.named_parameters():
        s = model.init_std(n)
        if s:
            assert p.abs().max() <= 3 * s + 1e-6, n  # truncated at 3 standard deviations
