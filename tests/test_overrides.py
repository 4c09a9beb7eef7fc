"""Every reach into torch's and torchao's internals lives in titanlike/overrides, behind probes and one
switch (parallel.overrides): each probe passes on the torch and torchao tested here, each private op is
called by keyword (a moved signature fails here, not in a run), a failed probe turns its override off
with one line, and off means stock behaviour."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from conftest import call, train_here
from titanlike import overrides
from titanlike.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
# The private names of torch and torchao that titanlike reaches for: none outside the overrides home.
PRIVATE = re.compile(r"torch(\.[a-z_]+)*\._[a-zA-Z]|torch\.ops\._|aten\._|\._local_tensor|\._spec\b|"
                     r"_precomputed_scale|_set_unshard_async_op|fsdp_pre_all_gather|_fsdp_collectives|"
                     r"matmul_with_hp_or_float8_args|hp_tensor_and_scale_to_float8|float8_utils|"
                     r"float8_training_tensor|_c10d_functional|_functional_collectives")


def test_no_private_name_outside_the_overrides_home():
    found = []
    for path in sorted((ROOT / "titanlike").rglob("*.py")):
        if "overrides" in path.parts:
            continue
        for n, line in enumerate(path.read_text().splitlines(), start=1):
            code = line.split("#", 1)[0]
            # (a logger's name is a string, not a reach: torch.utils._pytree's is quieted by name)
            if PRIVATE.search(code) and "getLogger(" not in code:
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "private names outside titanlike/overrides:\n" + "\n".join(found)


@pytest.mark.parametrize("name", overrides.NAMES)
def test_every_probe_passes_on_the_tested_torch_and_torchao(name):
    """A probe that fails here fails on a version CI runs (the pinned torch and the newest): the override's
    names or signatures moved, and it would run stock."""
    assert overrides.probe(name) is None


def test_each_override_runs_the_probe_its_module_marks_and_an_unknown_name_fails_at_import():
    """A probe is found by its mark (`@probe_for(name)`), not by a name composed at run time: each override's
    module registers one, and a mark naming no override raises where it is written."""
    for name in overrides.NAMES:
        overrides.probe(name)
    assert set(overrides._probes) == set(overrides.NAMES)
    from titanlike.overrides import float8

    assert overrides._probes["delayed_scaling"] is float8.probe_delayed_scaling
    with pytest.raises(ValueError, match="no override is called 'delayed_scalling'"):
        overrides.probe_for("delayed_scalling")


def test_the_policys_matmul_ops_are_the_ones_this_torch_has(monkeypatch):
    """Selective AC keys on float8's scaled mm where torch has it; a torch without it is no KeyError at
    start-up (nothing can run float8 there), the plain mm is still kept."""
    from titanlike.overrides import attention

    assert attention.matmul_ops() == {torch.ops.aten.mm.default, torch.ops.aten._scaled_mm.default}

    class Without:  # torch.ops.aten with no _scaled_mm
        mm = torch.ops.aten.mm

    monkeypatch.setattr(attention, "aten", Without())
    assert attention.matmul_ops() == {torch.ops.aten.mm.default}


def test_private_attention_ops_are_called_by_keyword_on_their_current_signatures():
    """cuDNN's and the CPU's fused attention and their backwards, by keyword on meta tensors: a renamed or
    reordered argument raises here."""
    from titanlike.overrides import attention

    q = torch.empty(2, 4, 16, 8, device="meta", dtype=torch.bfloat16)
    o, lse, cum_q, cum_k, max_q, max_k, seed, offset = attention.cudnn_attention(q, q, q, causal=False)
    assert o.shape == q.shape and lse.shape[:3] == q.shape[:3]
    dq, dk, dv = attention.cudnn_attention_backward(o, q, q, q, o, lse, seed, offset, cum_q, cum_k, max_q, max_k, False)
    assert dq.shape == dk.shape == dv.shape == q.shape
    x = torch.randn(1, 2, 8, 4)
    out, lse = attention.cpu_attention(x, x, x, causal=True)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True))
    grads = attention.cpu_attention_backward(torch.ones_like(out), x, x, x, out, lse, causal=True)
    assert [g.shape for g in grads] == [x.shape] * 3


def test_the_switch_chooses_and_the_start_line_says_why():
    line = overrides.configure("on")
    assert line.startswith("overrides of torch/torchao internals: on: ") and "; off" not in line
    assert all(overrides.active(name) for name in overrides.NAMES)
    line = overrides.configure("off")
    assert not any(overrides.active(name) for name in overrides.NAMES)
    assert "on: none; off, stock behaviour: " in line and "delayed_scaling (parallel.overrides)" in line
    overrides.configure("delayed_scaling,cp_attention_kernels")
    assert [n for n in overrides.NAMES if overrides.active(n)] == ["cp_attention_kernels", "delayed_scaling"]
    with pytest.raises(UserError, match="unknown: fused_cast") as e:
        overrides.chosen_names("delayed_scaling,fused_cast")
    assert "\n" not in str(e.value)


def test_a_wrong_override_name_is_refused_wherever_the_config_is_read():
    """titanlike-plan and --job.print_config refuse the names a training run's preflight refuses: a printed
    config trains when read back."""
    from titanlike import preflight, train
    from titanlike.plan import cli

    for main in (cli.main, preflight.main, train.main):
        for argv in (["--parallel.overrides", "bogus"], ["--job.print_config", "--parallel.overrides", "on,off"]):
            printing = "--job.print_config" in argv
            if (main is cli.main and printing) or (main is train.main and not printing):
                continue  # the plan prints no config; a training run's refusal is the preflight's
            rc, err = call(main, *argv)
            assert rc == 2, (main, argv, err)
            line, = err.strip().splitlines()
            assert line.startswith("error: parallel.overrides = "), line
    spaced = " delayed_scaling , cp_attention_kernels "
    assert call(preflight.main, "--job.print_config", "--parallel.overrides", spaced)[0] == preflight.PRINTED


def test_a_version_outside_the_checked_ones_turns_an_override_off():
    assert overrides.version_outside("2.13.0+cpu", (2, 11), (2, 14)) is None
    assert overrides.version_outside("2.14.1+cu130", (2, 11), (2, 14)) is None
    assert "outside the checked 2.11-2.14" in overrides.version_outside("2.15.0", (2, 11), (2, 14))
    assert "not a version" in overrides.version_outside("nightly", (2, 11), (2, 14))


def test_a_failed_probe_runs_stock_and_says_so_in_the_start_line(tmp_path, corpus, monkeypatch):
    """Delayed scaling whose torchao functions moved: the run trains with dynamic scaling, and the start
    line and the float8 line say so; nothing raises."""
    overrides.probe("delayed_scaling")  # its module registered its probe
    monkeypatch.setitem(overrides._probes, "delayed_scaling", lambda: "torchao's amax_to_scale takes (x)")
    monkeypatch.setattr(overrides, "_verdicts", {})
    proc = train_here(tmp_path, "--training.steps", "2", "--training.local_batch_size", "2", "--data.seq_len", "32",
                      "--fp8.recipe", "tensorwise", "--fp8.emulate", "--fp8.scaling", "delayed",
                      "--fp8.auto_filter", "false", "--validation.enable", "false", corpus=corpus)
    assert "off, stock behaviour: delayed_scaling (torchao's amax_to_scale takes (x))" in proc.stderr
    assert "fp8.scaling = delayed runs as dynamic" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_budget_mode_with_its_override_off_is_one_line():
    from titanlike import preflight

    rc = preflight.main(["--activation_checkpoint.mode", "budget", "--compile.enable",
                         "--parallel.overrides", "off"])
    assert rc == 2


def test_inductors_hook_for_its_heuristics_is_where_the_aligned_splits_expect_it():
    """What the override's probe reads only on a GPU host (the import is slow), read here on every torch CI runs."""
    from titanlike.overrides.compile import choices_hook_moved

    assert choices_hook_moved() is None


def test_aligned_split_cuts_a_reduction_into_equal_parts_of_16():
    from titanlike.overrides.compile import aligned_split

    # 16,384 tokens x 1b's 8,192 feed-forward features: inductor's 528 parts become 512 of 262,144.
    assert aligned_split(2**27, 528) == 512
    assert aligned_split(3 * 2**26, 700) == 768  # the nearest count that divides into multiples of 16
    assert aligned_split(2**28, 2048) == 2048  # already equal parts of a multiple of 16
    assert aligned_split(1000, 3) == 3  # none within a factor of two: inductor's own
    assert aligned_split(2**27, 1) == 1  # not split at all


class _H200Like:
    """What inductor's split rule reads of a GPU: 132 SMs (an H100 or H200)."""
    multi_processor_count, warp_size_or_default, max_threads_per_multi_processor, major = 132, 32, 2048, 9


def test_inductor_splits_an_amax_of_two_to_the_27_unaligned_and_the_override_aligns_it(monkeypatch):
    """The premise and the remedy, through inductor's own rule (its GPU read from a stand-in): stock, a float8
    amax over 16,384 x 8,192 values goes into 528 parts of 254,201 values (odd: no load aligned); under
    the override into 512 of 262,144. On a CPU, and where stock is aligned, the override changes nothing."""
    import torch._inductor.choices as choices

    from titanlike.overrides.compile import _aligned_splits_class

    monkeypatch.setattr(choices.DeviceProperties, "create", staticmethod(lambda device: _H200Like()))
    stock, ours = choices.InductorChoices(), _aligned_splits_class()()
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert stock.reduction_split_factor(cuda, 2**27, 1, True) == 528
    assert ours.reduction_split_factor(cuda, 2**27, 1, True) == 512
    assert ours.reduction_split_factor(cpu, 2**27, 1, True) == 528
    assert ours.reduction_split_factor(cuda, 2**28, 1, True) == stock.reduction_split_factor(cuda, 2**28, 1, True)


def test_the_aligned_splits_are_inductors_choices_only_when_on(monkeypatch):
    import pickle

    import torch._inductor.config as inductor_config
    from torch._inductor.virtualized import V

    from titanlike.overrides.compile import _aligned_splits_class, use_aligned_reduction_splits

    prior = V.choices
    monkeypatch.setattr(inductor_config, "inductor_choices_class", None)
    try:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        use_aligned_reduction_splits()  # no GPU: nothing to change
        assert inductor_config.inductor_choices_class is None and V.choices is prior
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        overrides.configure("off")
        use_aligned_reduction_splits()
        assert inductor_config.inductor_choices_class is None and V.choices is prior
        overrides.configure("aligned_reduction_splits")
        use_aligned_reduction_splits()
        assert inductor_config.inductor_choices_class is _aligned_splits_class()
        assert isinstance(V.choices, _aligned_splits_class())
        # compile's cache keys graphs by the class, pickled by reference (torch 2.11): it must be found by name
        assert pickle.loads(pickle.dumps(_aligned_splits_class())) is _aligned_splits_class()
    finally:
        V.set_choices_handler(prior)
        overrides.reset()


# ---- fused_float8_weight_cast --------------------------------------------------------------------------------


def _wrapped_weight(shard: torch.Tensor, scale: float):
    from torchao.float8.float8_training_tensor import LinearMMConfig

    from titanlike.overrides import float8

    return float8._weight_wrapper()(shard, LinearMMConfig(), torch.float8_e4m3fn, torch.tensor(scale))


def test_the_fused_weight_cast_gives_torchaos_bytes_and_is_torchaos_own_when_off():
    """The cast before FSDP's float8 all-gather, compiled into one kernel (here inductor's CPU code; the GPU
    tier checks the GPU's), gives the bytes of torchao's three: scaled, saturated (the 1e6), rounded (the
    small values to subnormals). Installed, a CPU shard still takes torchao's path; switched off, torchao's
    own method is back."""
    from titanlike.overrides import float8

    cls = float8._weight_wrapper()
    float8.use_fused_weight_cast(False)  # torchao's own, whatever ran in this process before
    stock = cls.fsdp_pre_all_gather
    shard = torch.randn(64, 48, generator=torch.Generator().manual_seed(0)) * 0.02
    shard[0, 0], shard[1, 1] = 1e6, 3e-6
    weight = _wrapped_weight(shard, 300.0)
    (theirs,), (their_scale,) = stock(weight, None)
    ours = float8._fused_cast(shard.reshape(-1), weight._precomputed_scale, torch.float8_e4m3fn).view(shard.shape)
    assert theirs.dtype == ours.dtype == torch.float8_e4m3fn
    assert torch.equal(theirs.view(torch.uint8), ours.view(torch.uint8))
    assert float(theirs[0, 0]) == 448.0  # saturated, as the fused kernel must too
    try:
        float8.use_fused_weight_cast(True)
        float8.use_fused_weight_cast(True)  # twice: torchao's method stays the one to go back to
        assert cls.fsdp_pre_all_gather is float8._fused_pre_all_gather
        (on_cpu,), (scale,) = cls.fsdp_pre_all_gather(weight, None)
        assert torch.equal(on_cpu.view(torch.uint8), theirs.view(torch.uint8)) and torch.equal(scale, their_scale)
    finally:
        float8.use_fused_weight_cast(False)
    assert cls.fsdp_pre_all_gather is stock


def test_the_fused_weight_cast_probe_refuses_a_torchao_whose_cast_changed(monkeypatch):
    from titanlike.overrides import float8

    cls = float8._weight_wrapper()
    assert float8.probe_fused_float8_weight_cast() is None

    def unscaled(self, mesh):  # a torchao that, say, scales the weight elsewhere
        return (self._tensor.to(self._dtype),), (self._precomputed_scale,)

    monkeypatch.setattr(cls, "fsdp_pre_all_gather", unscaled)
    assert "not the scaled, saturated cast" in float8.probe_fused_float8_weight_cast()
    monkeypatch.setattr(cls, "fsdp_pre_all_gather", lambda self, mesh, extra: None)
    assert "takes (self, mesh, extra)" in float8.probe_fused_float8_weight_cast()


def test_the_converter_installs_the_fused_cast_with_float8_all_gather_and_compile_only_when_on():
    from titanlike.float8 import Float8Converter, Float8Options
    from titanlike.model.converter import ConvertArgs
    from titanlike.model.decoder import Transformer
    from titanlike.model.shape import ModelArgs
    from titanlike.overrides import float8

    cls = float8._weight_wrapper()
    float8.use_fused_weight_cast(False)
    stock = cls.fsdp_pre_all_gather

    def convert(compiled: bool):
        with torch.device("meta"):
            model = Transformer(ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=97))
        options = Float8Options(recipe="tensorwise", emulate=True, fsdp_float8_all_gather=True, precompute_scales=True,
                                filter_fqns=("output",), auto_filter=False)
        Float8Converter(options).convert(model, ConvertArgs(device=torch.device("cpu"), compiled=compiled))

    try:
        overrides.configure("on")
        convert(compiled=True)
        assert cls.fsdp_pre_all_gather is float8._fused_pre_all_gather
        convert(compiled=False)  # a run without compile may be one where inductor cannot run
        assert cls.fsdp_pre_all_gather is stock
        convert(compiled=True)
        overrides.configure("off")
        convert(compiled=True)
        assert cls.fsdp_pre_all_gather is stock
    finally:
        float8.use_fused_weight_cast(False)
        overrides.reset()
