"""Any model shape: [model] overrides, their validation, QK-norm, the 124m preset, and exact resume."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F

from conftest import losses, resolve_model_args, train_here
from titanlike.config import ConfigError, load_config
from titanlike.model.decoder import Attention, Transformer, apply_rope, rope_tables
from titanlike.model.shape import PRESETS, ModelArgs, count_params, shape_difference

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_overrides_apply_and_unset_keeps_the_preset():
    cfg = load_config(["--model.flavor", "debug", "--model.dim", "128", "--model.n_heads", "4",
                       "--model.n_kv_heads", "1", "--model.qk_norm", "--model.rope_theta", "5e5",
                       "--model.ffn_dim", "320", "--model.n_layers", "3",
                       "--model.norm_eps", "1e-6", "--model.max_seq_len", "1024"])
    a = resolve_model_args(cfg)
    assert (a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.ffn_dim, a.head_dim) == (128, 3, 4, 1, 320, 32)
    assert (a.rope_theta, a.norm_eps, a.qk_norm, a.max_seq_len) == (5e5, 1e-6, True, 1024)
    assert a.vocab_size == PRESETS["debug"].vocab_size
    assert resolve_model_args(load_config([])) == PRESETS["debug"]
    # False is a choice, not "unset": it overrides a preset that says true.
    assert resolve_model_args(load_config(["--model.flavor", "124m", "--model.qk_norm", "false"])).qk_norm is False


@pytest.mark.parametrize("argv,message", [
    (["--model.dim", "100"], "dim = 100 is not divisible by n_heads = 8"),
    (["--model.n_heads", "8", "--model.n_kv_heads", "3"], "n_heads = 8 is not divisible by n_kv_heads = 3"),
    (["--model.dim", "72", "--model.n_heads", "8", "--model.n_kv_heads", "2"],
     "head_dim = dim / n_heads = 9 must be even"),
    (["--model.n_layers", "-1"], "model.n_layers = -1 must be >= 0"),
    (["--model.flavor", "hf"], "model.flavor = hf takes the shape from a Hugging Face folder's config.json"),
    (["--model.max_seq_len", "128", "--data.seq_len", "256"], "data.seq_len = 256 exceeds model.max_seq_len = 128"),
])
def test_shape_validation_is_one_line(argv, message):
    with pytest.raises(ConfigError) as e:
        load_config(argv)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_preset_124m():
    a = PRESETS["124m"]
    assert (a.n_layers, a.dim, a.n_heads, a.n_kv_heads, a.qk_norm, a.rope_theta, a.vocab_size) == \
        (12, 768, 12, 3, True, 10000.0, 32768)
    total, _ = count_params(a)
    with torch.device("meta"):
        assert total == sum(p.numel() for p in Transformer(a).parameters())
    assert abs(total - 124e6) / 124e6 < 0.01  # GPT-2 small's size, as its name says


@pytest.mark.parametrize("qk_norm", [False, True])
def test_count_params_covers_custom_shapes(qk_norm):
    a = ModelArgs(dim=96, n_layers=3, n_heads=6, n_kv_heads=2, ffn_dim=200, vocab_size=111, qk_norm=qk_norm)
    with torch.device("meta"):
        assert count_params(a)[0] == sum(p.numel() for p in Transformer(a).parameters())


def test_qk_norm_attention_equals_a_plain_reference():
    a = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=50, qk_norm=True,
                  rope_theta=10000.0, norm_eps=1e-6)
    torch.manual_seed(0)
    attn = Attention(a)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.ndim == 2 else 1.0) + (1.0 if p.ndim == 1 else 0.0))
    x = torch.randn(2, 10, a.dim)
    cos, sin = rope_tables(a.head_dim, 10, a.rope_theta)
    got = attn(x, cos, sin)

    # Reference: separate projections, per-head RMSNorm written out, RoPE, repeated kv heads, softmax.
    hd = a.head_dim
    wq, wk, wv = attn.wqkv.weight.split(a.qkv_widths, dim=0)
    q = (x @ wq.T).view(2, 10, 4, hd)
    k = (x @ wk.T).view(2, 10, 2, hd)
    v = (x @ wv.T).view(2, 10, 2, hd)

    def rms(t, gain):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + a.norm_eps) * gain

    q, k = rms(q, attn.q_norm.weight), rms(k, attn.k_norm.weight)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k, v = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(10, 10, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", F.softmax(scores, -1), v).reshape(2, 10, -1) @ attn.wo.weight.T
    torch.testing.assert_close(got, out, rtol=1e-5, atol=1e-5)
    # And QK-norm does something: without it the output differs.
    plain = Attention(ModelArgs(**{**a.__dict__, "qk_norm": False}))
    plain.load_state_dict({k: v for k, v in attn.state_dict().items() if "_norm" not in k})
    assert not torch.allclose(plain(x, cos, sin), got)


def test_shape_difference_names_the_field():
    a = PRESETS["debug"]
    saved = {**a.__dict__}
    assert shape_difference(saved, a) is None
    assert shape_difference({**saved, "rope_theta": 500000.0}, a) == "rope_theta is 500000.0 there, 10000.0 here"
    assert shape_difference({**saved, "n_heads": 4, "n_kv_heads": 2}, a) == "n_heads is 4 there, 8 here"
    old = {k: v for k, v in saved.items() if k != "qk_norm"}  # written before qk_norm existed
    assert shape_difference(old, a) is None


# ---- training and exact resume with a custom shape and with 124m ------------------------------------

CUSTOM = ("--model.dim", "96", "--model.n_layers", "2", "--model.n_heads", "6", "--model.n_kv_heads", "2",
          "--model.ffn_dim", "192", "--model.qk_norm", "--model.rope_theta", "50000")
RUN = ("--training.steps", "4", "--data.seq_len", "32", "--training.local_batch_size", "2", "--metrics.log_freq", "1",
       "--validation.enable", "false", "--training.deterministic", "--checkpoint.enable", "--checkpoint.interval", "2")


@pytest.mark.slow
def test_shape_trains_and_resumes_exactly(tmp_path, corpus):
    full, part = tmp_path / "full", tmp_path / "part"
    train_here(full, *RUN, *CUSTOM, corpus=corpus)
    saved = json.loads((full / "checkpoint" / "step-4" / "model_args.json").read_text())
    assert saved["qk_norm"] is True
    # A second run that starts from the step-2 checkpoint continues with the same losses, bit for bit.
    shutil.copytree(full / "checkpoint" / "step-2", part / "checkpoint" / "step-2")
    train_here(part, *RUN, *CUSTOM, corpus=corpus)
    assert losses(part) == {s: v for s, v in losses(full).items() if s > 2}


@pytest.mark.slow
def test_the_124m_preset_trains(tmp_path, corpus):
    """The preset's own shape (QK-norm, its vocabulary) through the trainer, two steps. Its resume is the
    custom shape's above: saving and reloading 124M parameters with AdamW's state twice took a minute of
    CI for nothing a smaller shape does not test."""
    proc = train_here(tmp_path, *RUN, "--model.flavor", "124m", "--training.steps", "2", "--checkpoint.enable",
                      "false", corpus=corpus)
    assert "model 124m" in proc.stderr
    assert sorted(losses(tmp_path)) == [1, 2] and all(math.isfinite(v) for v in losses(tmp_path).values())


@pytest.mark.slow
def test_resume_refuses_another_shape_with_the_same_tensor_shapes(tmp_path, corpus):
    dump = tmp_path / "run"
    train_here(dump, *RUN, *CUSTOM, "--training.steps", "2", corpus=corpus)
    # Another rope_theta (or, without QK-norm, 6 heads × 16 against 3 × 32) has the same tensor shapes.
    proc = train_here(dump, *RUN, *CUSTOM, "--model.rope_theta", "10000", corpus=corpus, check=False)
    assert proc.returncode != 0
    assert "was saved from a different model shape: rope_theta is 50000.0 there, 10000.0 here" in proc.stderr, \
        proc.stderr[-3000:]
