"""AdamW parameter groups, the warmup-stable-decay schedule, gradient clipping."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from titanlike.config.schema import LRScheduler
from titanlike.model.decoder import Transformer
from titanlike.model.shape import ModelArgs
from titanlike.optim import build_optimizer, build_scheduler, clip_and_step, lr_factor


def factors(total, warmup, ratio, kind, floor, upto=None):
    return [lr_factor(s, total, warmup, ratio, kind, floor) for s in range(1, (upto or total) + 1)]


# ---- schedule ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["linear", "cosine"])
@pytest.mark.parametrize("floor", [0.0, 0.1])
def test_warmup_stable_decay_shape(kind, floor):
    total, warmup, ratio = 100, 10, 0.3
    f = factors(total, warmup, ratio, kind, floor, upto=total + 20)
    # Warmup: strictly rising, below the peak.
    assert all(0 < a < b < 1 for a, b in zip(f[:warmup - 1], f[1:warmup]))
    # Stable: exactly the peak until the decay's last 30 steps.
    assert f[warmup:70] == [1.0] * (70 - warmup)
    # Decay: strictly falling to the floor, reached at the last step.
    decay = f[69:total]
    assert all(a > b for a, b in zip(decay, decay[1:]))
    assert f[total - 1] == pytest.approx(floor, abs=1e-12)
    # Halfway through the decay, both shapes are halfway between peak and floor.
    assert f[85 - 1] == pytest.approx(floor + 0.5 * (1 - floor))
    # Past the end it stays at the floor, never below, never negative.
    assert all(x == pytest.approx(floor, abs=1e-12) and x >= 0 for x in f[total:])


def test_linear_and_cosine_differ_in_shape():
    lin = factors(100, 0, 0.5, "linear", 0.0)
    cos = factors(100, 0, 0.5, "cosine", 0.0)
    # Step 60 is a fifth into the decay (steps 51..100): linear is at 4/5, cosine at (1 + cos(π/5)) / 2.
    assert lin[59] == pytest.approx(0.8)
    assert cos[59] == pytest.approx(0.5 * (1 + math.cos(math.pi / 5)))


def test_no_decay_and_no_warmup():
    assert factors(20, 0, 0.0, "linear", 0.0) == [1.0] * 20
    f = factors(20, 5, 0.0, "cosine", 0.3)
    assert f[:5] == [s / 6 for s in range(1, 6)] and f[5:] == [1.0] * 15


def test_decay_never_eats_into_warmup():
    # decay_ratio 1.0 = "decay right after warmup": the warmup still rises to the peak first.
    f = factors(20, 5, 1.0, "linear", 0.0)
    assert all(a < b for a, b in zip(f[:5], f[1:5]))
    assert f[5] == pytest.approx(1 - 1 / 15)  # first of 15 decay steps
    assert all(a > b for a, b in zip(f[5:], f[6:])) and f[-1] == 0.0
    # A decay longer than what is left after warmup shortens, it does not overlap.
    g = factors(12, 10, 0.3, "linear", 0.0)
    assert all(a < b for a, b in zip(g[:10], g[1:10]))
    assert g[10:] == [pytest.approx(0.5), 0.0]


def test_scheduler_drives_the_optimizer():
    p = nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=0.5)
    sched = build_scheduler(opt, LRScheduler(warmup_steps=3, decay_ratio=0.4, decay_type="linear"), 10)
    used = []
    for _ in range(12):
        used.append(opt.param_groups[0]["lr"])  # the LR of the next update
        opt.step()
        sched.step()
    assert used == pytest.approx([0.5 * x for x in factors(10, 3, 0.4, "linear", 0.0, upto=12)])
    assert used[0] == pytest.approx(0.5 / 4) and used[9] == 0.0 and min(used) >= 0


# ---- parameter groups ------------------------------------------------------------------------------------


def small_model() -> Transformer:
    model = Transformer(ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=50))
    model.init_weights(0, 16)
    return model


def test_no_weight_decay_on_1d_params():
    model = small_model()
    opt = build_optimizer(model, lr=0.1, weight_decay=0.5, betas=[0.9, 0.95], eps=1e-8, device_type="cpu")
    wd_of = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    assert len(wd_of) == len(list(model.parameters()))
    for name, p in model.named_parameters():
        assert wd_of[id(p)] == (0.0 if p.ndim == 1 else 0.5), name
    assert any(p.ndim == 1 for p in model.parameters())
    assert opt.param_groups[0]["betas"] == (0.9, 0.95)
    # Behaviour: with zero gradients Adam's update is zero, so only decoupled weight decay moves
    # weights: matrices shrink by (1 - lr·wd), norm gains stay put.
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for name, p in model.named_parameters():
        if p.ndim == 1:
            assert torch.equal(p, before[name]), name
        else:
            torch.testing.assert_close(p, before[name] * (1 - 0.1 * 0.5)), name


def test_the_moments_exist_before_the_first_step_and_it_is_the_same_step():
    """build_optimizer makes AdamW's state at once (zero moments, step 0), and leaves the weights as they were;
    three updates from there equal three from an AdamW that made its state at its first update, bit for bit."""
    ours, theirs = small_model(), small_model()
    weights = [p.detach().clone() for p in ours.parameters()]
    opt = build_optimizer(ours, lr=0.1, weight_decay=0.5, betas=[0.9, 0.95], eps=1e-8, device_type="cpu")
    assert all(torch.equal(p, w) for p, w in zip(ours.parameters(), weights))
    assert all(p.grad is None for p in ours.parameters())
    states = [opt.state[p] for p in ours.parameters()]
    assert len(states) == len(weights) and all(float(s["step"]) == 0 for s in states)
    assert all(not s["exp_avg"].any() and not s["exp_avg_sq"].any() for s in states)
    twin = dict(zip(map(id, ours.parameters()), theirs.parameters()))
    lazy = torch.optim.AdamW([{"params": [twin[id(p)] for p in g["params"]], "weight_decay": g["weight_decay"]}
                              for g in opt.param_groups], lr=0.1, betas=(0.9, 0.95), eps=1e-8, foreach=True)
    assert not lazy.state
    for step in range(3):
        for a, b in zip(ours.parameters(), theirs.parameters()):
            grad = torch.randn(a.shape, generator=torch.Generator().manual_seed(step))
            a.grad, b.grad = grad.clone(), grad.clone()
        opt.step()
        lazy.step()
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)
        assert torch.equal(opt.state[a]["exp_avg_sq"], lazy.state[b]["exp_avg_sq"])
        assert float(opt.state[a]["step"]) == float(lazy.state[b]["step"]) == 3


# ---- clipping --------------------------------------------------------------------------------------------


def clip_grad_norm(params, max_norm):
    """clip_and_step with an optimizer that leaves the weights alone: what does clipping do to the gradients?"""
    return clip_and_step(torch.optim.SGD(params, lr=0.0), params, max_norm, skip_nonfinite=False)[0]


def with_grads(*grads):
    params = []
    for g in grads:
        p = nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        params.append(p)
    return params


def test_clip_to_max_norm_returns_preclip_norm():
    torch.manual_seed(0)
    grads = [torch.randn(4, 5) * 3, torch.randn(7) * 2, torch.randn(2, 2, 2)]
    params = with_grads(*grads) + [nn.Parameter(torch.zeros(3))]  # one without a gradient
    expected = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
    assert expected > 1.0
    norm = clip_grad_norm(params, max_norm=1.0)
    assert float(norm) == pytest.approx(expected, rel=1e-6)
    after = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in params if p.grad is not None))
    assert after == pytest.approx(1.0, rel=1e-5)
    # Clipping scales all gradients by one factor: directions are kept.
    for p, g in zip(params, grads):
        torch.testing.assert_close(p.grad, g * (after / expected), rtol=1e-5, atol=1e-7)


def test_no_clip_below_max_norm_or_when_disabled():
    g = torch.tensor([0.3, 0.4])  # norm 0.5
    params = with_grads(g)
    assert float(clip_grad_norm(params, 1.0)) == pytest.approx(0.5)
    torch.testing.assert_close(params[0].grad, g)
    big = torch.tensor([30.0, 40.0])
    params = with_grads(big)
    assert float(clip_grad_norm(params, 0.0)) == pytest.approx(50.0)
    torch.testing.assert_close(params[0].grad, big)
