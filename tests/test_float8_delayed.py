"""Delayed scaling (fp8.scaling = delayed): each cast's scale comes from the amaxes of earlier steps.

In process, on a small float8 model with emulated matmuls; the casts and scales are the real ones.
The trainer-level checks (it trains, it resumes exactly on two ranks) are in test_float8.py and
test_checkpoint.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from titanlike.float8 import delayed as float8_delayed
from titanlike.float8.delayed import DelayedFloat8Linear

E4M3, E5M2 = torch.finfo(torch.float8_e4m3fn).max, torch.finfo(torch.float8_e5m2).max


def delayed_model(history: int = 4, seed: int = 0) -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64, bias=False), nn.ReLU(), nn.Linear(64, 16, bias=False))
    convert_to_float8_training(model, config=Float8LinearConfig(emulate=True))
    assert float8_delayed.convert(model, history) == 2
    float8_delayed.reset(model)
    return model


class Recorder:
    """Runs steps on a model and keeps, per step, each layer's input and output gradient."""

    def __init__(self, model: nn.Module, hooks: bool = True):
        """`hooks`: keep each layer's input and output gradient (module hooks, which a fully compiled
        model cannot have from torch 2.14 on: "Module-level backwards hooks require compiled autograd")."""
        self.model, self.inputs, self.grads = model, {}, {}
        for i, layer in enumerate(float8_delayed.layers(model) if hooks else []):
            layer.register_forward_pre_hook(lambda m, args, i=i: self.inputs.__setitem__(i, args[0].detach().clone()))
            layer.register_full_backward_hook(
                lambda m, gin, gout, i=i: self.grads.__setitem__(i, gout[0].detach().clone()))

    def step(self, x: torch.Tensor, step: int, every: int = 1) -> torch.Tensor:
        float8_delayed.set_recording(self.model, step, every)
        y = self.model(x.requires_grad_())
        y.float().pow(2).mean().backward()
        with torch.no_grad():
            for p in self.model.parameters():
                p -= 0.5 * p.grad
                p.grad = None
        float8_delayed.update_scales(self.model)
        return y.detach()


def test_scales_come_from_the_amaxes_of_earlier_steps():
    model = delayed_model(history=2)
    rec = Recorder(model)
    first, second = float8_delayed.layers(model)
    xs = [torch.randn(8, 32) * scale for scale in (1.0, 3.0, 0.5)]
    seen = []  # per step: (input amax, output gradient amax, weight amax) of the first layer
    for step, x in enumerate(xs, start=1):
        weight_amax = first.weight.detach().abs().max()
        rec.step(x, step)
        seen.append((rec.inputs[0].abs().max(), rec.grads[0].abs().max(), weight_amax))
        # The history holds the newest `history` steps, newest first; the scale is from their maximum.
        window = seen[-2:][::-1]
        expected = torch.tensor([[s[k] for s in window] + [0.0] * (2 - len(window)) for k in range(3)])
        torch.testing.assert_close(first.amax_history, expected, rtol=0, atol=0)
        for k, (row, fmax) in enumerate((("input", E4M3), ("grad", E5M2), ("weight", E4M3))):
            newest_max = max(s[k] for s in window).double()
            torch.testing.assert_close(getattr(first, f"{row}_scale"),
                                       torch.tensor(fmax, dtype=torch.float64).div(newest_max).float())
        assert first.calibrated and second.calibrated
        assert first.input_amax == 0 and first.grad_amax == 0  # collected for the next step afresh


def test_a_calibrated_step_casts_with_the_delayed_scales():
    """Step 2's input is 4x larger than step 1's: with step 1's scale it saturates, where a dynamic
    scale would have followed it; the output is the matmul of exactly those float8 values."""
    model = delayed_model()
    rec = Recorder(model)
    first = float8_delayed.layers(model)[0]
    x1 = torch.randn(8, 32)
    rec.step(x1, 1)
    x2 = 4 * x1.detach()
    s_in, s_w = first.input_scale.clone(), first.weight_scale.clone()
    w = first.weight.detach().clone()
    with torch.no_grad():
        out = first(x2)
    as_float8 = lambda t, s: (t * s).clamp(-E4M3, E4M3).to(torch.float8_e4m3fn).float() / s  # noqa: E731
    expected = as_float8(x2, s_in) @ as_float8(w, s_w).t()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert as_float8(x2, s_in).abs().max().item() == pytest.approx(E4M3 / s_in.item())  # saturated at the old range
    assert first.input_amax == x2.abs().max()  # and recorded the new one for the next steps


def test_amax_every_measures_only_every_nth_step():
    model = delayed_model(history=8)
    rec = Recorder(model)
    first = float8_delayed.layers(model)[0]
    inputs = [torch.randn(8, 32) * (step + 1) for step in range(7)]
    for step, x in enumerate(inputs, start=1):
        rec.step(x, step, every=3)
        assert first.recording == (step in (1, 4, 7))
    # Steps 1, 4 and 7 measured, newest first; the others left no entry.
    recorded = [inputs[s - 1].abs().max() for s in (7, 4, 1)]
    torch.testing.assert_close(first.amax_history[0, :3], torch.stack(recorded))
    assert first.amax_history[0, 3:].eq(0).all()


def test_a_non_finite_step_leaves_no_trace_in_the_history():
    model = delayed_model()
    rec = Recorder(model)
    first = float8_delayed.layers(model)[0]
    rec.step(torch.randn(8, 32), 1)
    before = first.amax_history.clone()
    bad = torch.randn(8, 32)
    bad[0, 0] = float("nan")
    rec.step(bad, 2)
    assert torch.isfinite(first.input_scale) and torch.isfinite(first.grad_scale)
    # Input and gradient amaxes of the NaN step entered as nothing; the weights were still finite.
    assert first.amax_history[:2, 0].eq(0).all() and first.amax_history[2, 0] > 0
    torch.testing.assert_close(first.amax_history[:, 1], before[:, 0])


def test_compiled_steps_record_what_eager_steps_record():
    """Under torch.compile (AOTAutograd, which inductor shares) the in-place amax records, the
    backward's among them, must survive functionalisation: same scales, same outputs as eager."""
    eager, compiled = delayed_model(seed=1), delayed_model(seed=1)
    compiled.compile(backend="aot_eager", fullgraph=True)
    runs = [Recorder(eager, hooks=False), Recorder(compiled, hooks=False)]
    for step in range(1, 5):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(step)) * step
        outs = [rec.step(x, step, every=2) for rec in runs]
        torch.testing.assert_close(outs[0], outs[1])
        for a, b in zip(float8_delayed.layers(eager), float8_delayed.layers(compiled)):
            torch.testing.assert_close(a.amax_history, b.amax_history, rtol=0, atol=0)
    assert float8_delayed.layers(compiled)[0].amax_history[1].gt(0).sum() == 2  # steps 1 and 3 measured


def test_checkpoint_state_round_trip_and_mismatch():
    model = delayed_model(history=4)
    rec = Recorder(model)
    for step in (1, 2):
        rec.step(torch.randn(8, 32), step)
    state = {k: v.clone() for k, v in float8_delayed.checkpoint_state(model).items()}
    assert state[float8_delayed.CHECKPOINT_KEY].shape == (2, 3, 4)

    other = delayed_model(history=4, seed=5)
    assert not float8_delayed.layers(other)[0].calibrated
    float8_delayed.load_checkpoint_state(other, state)
    for a, b in zip(float8_delayed.layers(model), float8_delayed.layers(other)):
        assert b.calibrated
        for name in ("amax_history", "input_scale", "grad_scale", "weight_scale"):
            torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=0, atol=0)

    # A checkpoint without a history (dynamic scaling) or of another length: start afresh.
    for loaded in ({}, {float8_delayed.CHECKPOINT_KEY: torch.ones(2, 3, 7)}):
        float8_delayed.load_checkpoint_state(other, loaded)
        assert not any(m.calibrated for m in float8_delayed.layers(other))
        assert all(m.amax_history.eq(0).all() for m in float8_delayed.layers(other))


def test_only_plain_float8_linears_convert():
    model = delayed_model()
    assert all(type(m) is DelayedFloat8Linear for m in float8_delayed.layers(model))
    assert float8_delayed.convert(model, 4) == 0  # already converted: nothing left to swap
    assert "delayed scaling, amax history of 4" in repr(model)


def test_the_converter_checkpoints_one_stateful_item_under_the_old_key():
    """Float8Converter, as the trainer and the checkpoint manager use it: its hook after each optimizer
    step updates delayed scaling's history; its state_dict() is that history under the key checkpoints
    have always had (so old ones load), and its load_state_dict() restores a run's scales; without
    delayed scaling it holds nothing."""
    from titanlike.converters import ModelConverters
    from titanlike.float8 import Float8Converter, Float8Options
    from titanlike.model.converter import ConvertArgs
    from titanlike.run.state import TrainState

    class Sink:
        def scalars(self, step, values):
            pass

        def note(self, values):
            pass

    def converter(seed: int) -> tuple[Float8Converter, nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(32, 64, bias=False), nn.ReLU(), nn.Linear(64, 16, bias=False))
        fp8 = Float8Converter(Float8Options(recipe="tensorwise", emulate=True, scaling="delayed", amax_history=4))
        fp8.convert(model, ConvertArgs(device=torch.device("cpu")))
        assert fp8.report.converted == ["0", "2"]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        ModelConverters([fp8]).attach(optimizer, counters=counters, metrics=Sink())
        return fp8, model, optimizer

    counters = TrainState()  # the run's counters, as the trainer hands them over
    fp8, model, optimizer = converter(0)
    for step in (1, 2, 3):
        model(torch.randn(8, 32)).float().pow(2).mean().backward()
        optimizer.step()  # the converter's hook: this step's amaxes into the history
        counters.step = step
    state = {k: v.clone() for k, v in fp8.state_dict().items()}
    assert list(state) == ["float8_amax_history"] and state["float8_amax_history"].shape == (2, 3, 4)
    assert state["float8_amax_history"][..., :3].gt(0).all()  # three steps measured

    restored, other, _ = converter(5)
    restored.load_state_dict(state)
    for a, b in zip(float8_delayed.layers(model), float8_delayed.layers(other)):
        assert b.calibrated
        for name in ("amax_history", "input_scale", "grad_scale", "weight_scale"):
            torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=0, atol=0)
    restored.load_state_dict({})  # a checkpoint saved with dynamic scaling: the history starts afresh
    assert not any(m.calibrated for m in float8_delayed.layers(other))

    dynamic = Float8Converter(Float8Options(recipe="tensorwise", emulate=True))
    dynamic.convert(nn.Sequential(nn.Linear(32, 32, bias=False)), ConvertArgs(device=torch.device("cpu")))
    assert dynamic.state_dict() == {}
    dynamic.load_state_dict({})
