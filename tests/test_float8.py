"""Float8 through torchao: which Linears convert and why, recipes, the device check, FSDP float8 all-gather.

On CPU the float8 matmuls are emulated (--fp8.emulate); the casts to float8_e4m3fn, the scales
and what FSDP puts on the wire are the real ones.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch import nn

from conftest import losses, metrics, run_probe, run_train, train_here
from titanlike.config.schema import Fp8
from titanlike.errors import UserError
from titanlike.float8 import Float8Converter, Float8Options, layers
from titanlike.float8.layers import skip_reason
from titanlike.model.converter import ConvertArgs
from titanlike.model.decoder import OutputLayer, Transformer
from titanlike.model.shape import PRESETS, flops_per_token


def plan(recipe="tensorwise", *, emulate=True, filter_fqns=("output",), auto_filter=True, all_gather=False,
         precompute=False) -> Float8Options:
    return Float8Options(recipe=recipe, emulate=emulate, fsdp_float8_all_gather=all_gather,
                         precompute_scales=precompute, filter_fqns=tuple(filter_fqns), auto_filter=auto_filter)


def linear(k: int, n: int) -> nn.Linear:
    with torch.device("meta"):
        return nn.Linear(k, n, bias=False)


# ---- which layers, and why not ---------------------------------------------------------------------


def test_skip_reason_filter_fqns():
    p = plan(filter_fqns=["output", "wqkv", ""], auto_filter=False)
    assert skip_reason("output", linear(256, 256), p) == "name matches fp8.filter_fqns entry 'output'"
    assert skip_reason("layers.3.attention.wqkv", linear(256, 512), p) == "name matches fp8.filter_fqns entry 'wqkv'"
    assert skip_reason("layers.3.attention.wo", linear(256, 256), p) is None  # "" matches nothing


def test_skip_reason_multiple_of_16():
    p = plan(filter_fqns=[], auto_filter=False)
    assert "100×64 is not a multiple of 16" in skip_reason("a", linear(100, 64), p)
    assert "64×72 is not a multiple of 16" in skip_reason("a", linear(64, 72), p)
    assert skip_reason("a", linear(64, 80), p) is None
    # Checked before the size filter, which would also have skipped it.
    assert "multiple of 16" in skip_reason("a", linear(4100, 8192), plan(filter_fqns=[], auto_filter=True))


def test_skip_reason_auto_filter_sizes():
    tw = plan("tensorwise", filter_fqns=[])
    # Big enough to pay: Llama 8B's projections, and every 1b block Linear (wo, wqkv, w1/w3, w2).
    for k, n in [(4096, 4096), (4096, 14336), (14336, 4096), (2048, 2048), (2048, 4096), (2048, 8192), (8192, 2048)]:
        assert skip_reason("x", linear(k, n), tw) is None, (k, n)
    # Too small: small products, or one side below 1024 however long the other.
    for k, n in [(2048, 1024), (1024, 2048), (256, 768), (512, 65536), (65536, 512), (1008, 1 << 20)]:
        assert skip_reason("x", linear(k, n), tw) == f"{k}×{n} is too small for float8 to pay (fp8.auto_filter)"
    # Without auto_filter the same small layers convert.
    assert skip_reason("x", linear(256, 768), plan("tensorwise", filter_fqns=[], auto_filter=False)) is None
    # Rowwise scaling costs more, so it is never less strict than tensorwise.
    shapes = [(k, n) for k in (512, 1024, 2048, 4096, 8192, 16384) for n in (512, 1024, 2048, 4096, 8192, 16384)]
    for recipe in ("rowwise", "rowwise_with_gw_hp"):
        rw = plan(recipe, filter_fqns=[])
        for k, n in shapes:
            if skip_reason("x", linear(k, n), rw) is None:
                assert skip_reason("x", linear(k, n), tw) is None, (recipe, k, n)
        assert skip_reason("x", linear(8192, 8192), rw) is None
        assert skip_reason("x", linear(1024, 1024), rw) is not None


def test_convert_debug_model():
    with torch.device("meta"):
        model = Transformer(PRESETS["debug"])
    p = layers.convert(model, plan("tensorwise", auto_filter=False))
    from torchao.float8.float8_linear import Float8Linear

    expected = [f"layers.{i}.{m}" for i in range(4) for m in
                ("attention.wqkv", "attention.wo", "feed_forward.w1", "feed_forward.w3", "feed_forward.w2")]
    assert sorted(p.converted) == sorted(expected)
    assert p.skipped == {"output": "name matches fp8.filter_fqns entry 'output'"}
    modules = dict(model.named_modules())
    assert all(isinstance(modules[n], Float8Linear) for n in expected)
    assert type(modules["output"]) is OutputLayer  # left as the model built it
    # Matmul FLOPs share, counted by hand: 6 per weight per token over the model's training FLOPs.
    a, seq = PRESETS["debug"], 64
    per_block = 2 * a.dim * a.dim + 2 * a.dim * (a.dim // 2) + 3 * a.dim * a.ffn_dim
    share = 6 * a.n_layers * per_block / flops_per_token(a, seq)
    assert layers.float8_matmul_share(model, flops_per_token(a, seq), "tensorwise") == pytest.approx(share)


def test_convert_with_auto_filter_keeps_small_model_high_precision():
    with torch.device("meta"):
        model = Transformer(PRESETS["debug"])
    p = layers.convert(model, plan("tensorwise"))
    assert p.converted == [] and len(p.skipped) == 21
    assert p.skipped["layers.0.feed_forward.w1"] == "256×768 is too small for float8 to pay (fp8.auto_filter)"


def test_convert_none_is_a_no_op():
    with torch.device("meta"):
        model = Transformer(PRESETS["debug"])
    before = [type(m) for m in model.modules()]
    p = layers.convert(model, plan("none"))
    assert [type(m) for m in model.modules()] == before and not p.converted and not p.skipped


def test_log_plan_says_what_and_why(caplog):
    p = plan("tensorwise")
    with torch.device("meta"):
        model = Transformer(PRESETS["debug"])
    report = layers.convert(model, p)
    with caplog.at_level(logging.INFO, logger="titanlike"):
        layers.log_report(p, report)
    text = caplog.text
    assert "float8 tensorwise (emulated): 0 Linears converted, 21 kept in high precision" in text
    assert "0% of matmul FLOPs in float8" in text and "float8 all-gather off" in text
    assert "256×768 is too small for float8 to pay" in text and "(8 in all)" in text
    assert "kept high precision: output: name matches fp8.filter_fqns entry 'output'" in text


# ---- options ---------------------------------------------------------------------------------------


def test_resolve_defaults():
    resolve = Float8Options.from_config
    tw = Fp8(recipe="tensorwise")
    p = resolve(tw, dp_shard=2)
    assert p.fsdp_float8_all_gather and p.precompute_scales
    p = resolve(tw, dp_shard=1)  # nothing to gather with one shard
    assert not p.fsdp_float8_all_gather and not p.precompute_scales
    p = resolve(Fp8(recipe="rowwise"), dp_shard=8)
    assert not p.fsdp_float8_all_gather and not p.precompute_scales
    p = resolve(Fp8(recipe="tensorwise", enable_fsdp_float8_all_gather=False), dp_shard=8)
    assert not p.fsdp_float8_all_gather and not p.precompute_scales
    p = resolve(Fp8(recipe="tensorwise", precompute_float8_dynamic_scale_for_fsdp=False), dp_shard=8)
    assert p.fsdp_float8_all_gather and not p.precompute_scales
    p = resolve(Fp8(recipe="rowwise", filter_fqns=["output", "wq"], auto_filter=False, emulate=True), dp_shard=1)
    assert (p.recipe, p.filter_fqns, p.auto_filter, p.emulate) == ("rowwise", ("output", "wq"), False, True)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
@pytest.mark.parametrize("emulate", [False, True])
def test_torchao_config(recipe, emulate):
    from torchao.float8.config import ScalingGranularity

    config = plan(recipe, emulate=emulate, all_gather=recipe == "tensorwise").torchao_config()
    assert config.emulate is emulate
    assert config.enable_fsdp_float8_all_gather is (recipe == "tensorwise")
    expected = ScalingGranularity.TENSORWISE if recipe == "tensorwise" else ScalingGranularity.AXISWISE
    assert config.cast_config_input.scaling_granularity == expected


# ---- the device check -------------------------------------------------------------------------------


def test_check_device_skips_when_emulated_or_off(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("no probe expected")

    monkeypatch.setattr(layers, "convert", boom)
    layers.check_device(plan("tensorwise", emulate=True), torch.device("cpu"))
    layers.check_device(plan("none", emulate=False), torch.device("cpu"))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_check_device_runs_a_real_float8_matmul_on_cpu(monkeypatch, recipe):
    calls = []
    real = torch._scaled_mm

    def counting(*a, **k):
        calls.append(a[0].dtype)
        return real(*a, **k)

    monkeypatch.setattr(torch, "_scaled_mm", counting)
    layers.check_device(plan(recipe, emulate=False), torch.device("cpu"))  # this torch has CPU float8 kernels
    assert calls and set(calls) <= {torch.float8_e4m3fn, torch.float8_e5m2}


@pytest.mark.parametrize("recipe,other", [("tensorwise", "none"), ("rowwise", "tensorwise")])
def test_check_device_failure_is_one_clear_line(monkeypatch, recipe, other):
    def unsupported(*a, **k):
        raise RuntimeError("_scaled_mm is not supported on this device\nmore detail")

    monkeypatch.setattr(torch, "_scaled_mm", unsupported)
    with pytest.raises(UserError) as e:
        layers.check_device(plan(recipe, emulate=False), torch.device("cpu"))
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"fp8.recipe = {recipe} cannot run on CPU with torch {torch.__version__}")
    assert "(_scaled_mm is not supported on this device)" in msg
    assert f"use --fp8.recipe {other} or --fp8.emulate" in msg


# ---- training runs ----------------------------------------------------------------------------------

STEPS = 10
COMMON = ("--training.steps", str(STEPS), "--metrics.log_freq", "1", "--data.seq_len", "64",
          "--training.local_batch_size", "4", "--validation.enable", "false")
FP8 = ("--fp8.emulate", "--fp8.auto_filter", "false")


@pytest.fixture(scope="module")
def high_precision(tmp_path_factory, corpus):
    dump = tmp_path_factory.mktemp("hp")
    train_here(dump, *COMMON, corpus=corpus)
    return losses(dump)


def assert_tracks(fp8_losses: dict, reference: dict) -> None:
    assert fp8_losses.keys() == reference.keys() == set(range(1, STEPS + 1))
    for step, value in fp8_losses.items():
        assert math.isfinite(value), (step, value)
        assert abs(value - reference[step]) < 0.03 * reference[step], (step, value, reference[step])
    assert fp8_losses != reference  # float8 really changed the arithmetic
    assert fp8_losses[STEPS] < fp8_losses[1] - 1.0  # and it trains


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_trains_and_tracks_high_precision(tmp_path, corpus, high_precision, recipe):
    proc = train_here(tmp_path, *COMMON, "--fp8.recipe", recipe, *FP8, corpus=corpus)
    assert_tracks(losses(tmp_path), high_precision)
    log = proc.stdout + proc.stderr
    assert f"float8 {recipe} (emulated): 20 Linears converted, 1 kept in high precision" in log
    assert "kept high precision: output: name matches fp8.filter_fqns entry 'output'" in log
    assert "float8 all-gather off" in log  # one rank: nothing to gather
    a = PRESETS["debug"]
    per_block = 2 * a.dim * a.dim + 2 * a.dim * (a.dim // 2) + 3 * a.dim * a.ffn_dim
    share = 6 * a.n_layers * per_block / flops_per_token(a, 64)
    assert f"{share:.0%} of matmul FLOPs in float8" in log
    assert all(r["float8_matmul_share"] == pytest.approx(share) for r in metrics(tmp_path)[1:])


@pytest.mark.slow
def test_delayed_scaling_trains_and_tracks_high_precision(tmp_path, corpus, high_precision):
    proc = train_here(tmp_path, *COMMON, "--fp8.recipe", "tensorwise", *FP8, "--fp8.scaling", "delayed",
                      "--fp8.amax_every", "2", corpus=corpus)
    assert_tracks(losses(tmp_path), high_precision)
    log = proc.stdout + proc.stderr
    assert ("float8 tensorwise (emulated), delayed scaling (amax history 16, measured every 2 step(s)): "
            "20 Linears converted") in log


@pytest.mark.slow
def test_float8_two_ranks_all_gather_on_by_default(tmp_path, corpus, high_precision):
    # 2 ranks × local 2 = the same global batch of 4 as the single-process reference.
    proc = run_train(tmp_path, *COMMON, "--training.local_batch_size", "2", "--fp8.recipe", "tensorwise", *FP8,
                     nproc=2, corpus=corpus)
    log = proc.stdout + proc.stderr
    assert "dp_shard 2" in log and "float8 all-gather on" in log
    assert_tracks(losses(tmp_path), high_precision)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_rowwise_blocks_compile_with_their_inductor_options(monkeypatch, recipe):
    """What float8 asks of inductor reaches each compiled block's graphs, forward and backward, and
    nothing else: rowwise gets emulated precision casts and 2-D tiling, tensorwise no options. A
    stand-in for inductor records the options and runs the graph as it is (no code generation)."""
    import torch._inductor.compile_fx as compile_fx

    from titanlike import parallel
    from titanlike.model.shape import ModelArgs

    seen = []

    def record(gm, example_inputs, config_patches=None, **kwargs):
        seen.append(dict(config_patches or {}))
        return gm.forward

    monkeypatch.setattr(compile_fx, "compile_fx", record)
    torch._dynamo.reset()
    with torch.device("meta"):
        model = Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=97))
    model.to_empty(device="cpu")
    model.init_weights(0, 16)
    fp8 = Float8Converter(plan(recipe, auto_filter=False))
    fp8.convert(model, ConvertArgs(device=torch.device("cpu")))
    options = fp8.compile_options()
    parallel.apply_compile(model, options)
    model(torch.randint(0, 97, (2, 16))).float().sum().backward()
    torch._dynamo.reset()
    assert seen  # the blocks were compiled
    expected = {"emulate_precision_casts": True, "triton.prefer_nd_tiling": True} if recipe != "tensorwise" else {}
    assert options == expected
    for patches in seen:
        assert {k: patches.get(k) for k in expected} == expected


@pytest.mark.slow
def test_fsdp_all_gather_carries_float8_bytes(tmp_path):
    """What FSDP puts on the wire, recorded inside 2 gloo ranks by tests/probes/float8_fsdp_probe.py."""
    assert_all_gather_moves_float8(run_probe("float8_fsdp_probe.py", tmp_path / "probe.json"))


def assert_all_gather_moves_float8(result: dict) -> None:
    """The probe's record (2 ranks, CPU or GPU): float8 weights cross the wire as one byte each, with
    scales precomputed after the optimizer step; the logits stay close to the fp32 model's."""
    world = result["world"]
    fp8, plain = result["fp8"], result["plain"]

    # The defaults with 2 shards and tensorwise: float8 all-gather and precomputed scales on.
    assert fp8["plan"]["fsdp_float8_all_gather"] and fp8["plan"]["precompute_scales"]
    converted = set(fp8["plan"]["converted"])
    assert len(converted) == 10 and "output" in fp8["plan"]["skipped"]
    weights = {f"{name}.weight" for name in converted}
    for name, (numel, local, kind) in fp8["params"].items():
        assert local * world == numel  # evenly sharded, no padding: byte counts below are exact
        assert kind == ("WeightWithDynamicFloat8CastTensor" if name in weights else "Tensor"), name

    # 1. Each float8 weight hands FSDP its shard as float8_e4m3fn: one byte per element.
    pre = fp8["first"]["pre_all_gather"]
    assert len(pre) == len(converted)
    for rec in pre:
        assert rec["dtypes"] == ["torch.float8_e4m3fn"]
        assert rec["numel"] == rec["shard_numel"] and rec["bytes"] == rec["shard_numel"]
    assert sorted(r["numel"] for r in pre) == sorted(fp8["params"][w][1] for w in weights)

    # 2. The collectives carry exactly those bytes: float8 weights at 1 byte, the rest at 4 (fp32).
    def expected_bytes(case, fp8_names):
        return sum(local * (1 if name in fp8_names else 4) for name, (_, local, _) in case["params"].items())

    sent_fp8 = sum(c["bytes"] for c in fp8["first"]["collectives"])
    sent_plain = sum(c["bytes"] for c in plain["first"]["collectives"])
    assert sent_fp8 == expected_bytes(fp8, weights)
    assert sent_plain == expected_bytes(plain, set())
    assert all(c["dtype"] == "torch.float32" for c in plain["first"]["collectives"])
    # Groups mixing float8 weights and fp32 norm gains travel as raw bytes (uint8).
    assert any(c["dtype"] == "torch.uint8" for c in fp8["first"]["collectives"])
    converted_fp32_bytes = 4 * sum(fp8["params"][w][1] for w in weights)
    assert sent_plain - sent_fp8 == converted_fp32_bytes * 3 // 4  # 4 bytes → 1 byte per weight element
    assert plain["first"]["pre_all_gather"] == []

    # 3. After the optimizer step, the converter's hook precomputed every weight's scale
    #    (float8 max / amax of the full weight), and the next all-gather used it.
    assert set(fp8["precomputed"]) == converted
    for name, rec in fp8["precomputed"].items():
        assert rec["scale"] is not None, name
        assert rec["scale"] == pytest.approx(rec["expected"], rel=1e-6), name
    second = fp8["second"]["pre_all_gather"]
    assert len(second) == len(converted) and all(r["precomputed"] for r in second)
    assert sorted(r["scale"] for r in second) == pytest.approx(sorted(r["scale"] for r in fp8["precomputed"].values()))
    assert not any(r["precomputed"] for r in pre)  # before the first step: computed on the fly

    # 4. Same init, float8 forward close to the fp32 one but not identical.
    a, b = torch.tensor(fp8["logits"]), torch.tensor(plain["logits"])
    rel = float((a - b).norm() / b.norm())
    assert 0 < rel < 0.05


@pytest.mark.parametrize("capability,gpu,recipe,advice", [
    ((12, 0), "NVIDIA GeForce RTX 5090", "rowwise",
     "torch's rowwise float8 matmul for sm_120 (RTX 50xx) is reported to work on some torch versions (field "
     "reports differ; docs/float8.md): try another torch version, or use --fp8.recipe tensorwise"),
    ((9, 0), "NVIDIA H100 80GB HBM3", "rowwise", "use --fp8.recipe tensorwise"),
    ((12, 0), "NVIDIA GeForce RTX 5090", "tensorwise", "use --fp8.recipe none"),
])
def test_probe_failure_on_a_gpu_names_what_to_do(monkeypatch, capability, gpu, recipe, advice):
    """A failing probe on a GPU (here faked: this machine has none) ends in one line that says what
    the user can do; on an RTX 50xx with rowwise that includes other torch versions, as a report."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: gpu)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: capability)

    def failing_probe(recipe, device):
        raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul\nmore")

    monkeypatch.setattr(layers, "_run_probe", failing_probe)
    with pytest.raises(UserError) as e:
        layers.check_device(plan(recipe, emulate=False), torch.device("cuda", 0))
    assert str(e.value) == (
        f"fp8.recipe = {recipe} cannot run on {gpu} with torch {torch.__version__} "
        f"(CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul); {advice}"
    )
