"""Float8 health: per converted Linear, the weight amax and the shares of values that saturate or flush
to zero when cast to float8, logged every metrics.log_freq × fp8.health_log_freq steps (emulated on CPU)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import metrics, run_train
from titanlike import float8
from titanlike.float8 import Float8Options, layers

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def converted(recipe: str, weight: torch.Tensor) -> nn.Module:
    model = nn.Sequential(nn.Linear(weight.shape[1], weight.shape[0], bias=False))
    layers.convert(model, Float8Options(recipe=recipe, emulate=True))
    with torch.no_grad():
        model[0].weight.copy_(weight)
    return model


def outlier_weight() -> torch.Tensor:
    """32×64: one outlier of 1000, eight exact zeros, every other value 1e-3."""
    w = torch.full((32, 64), 1e-3)
    w[0, 0] = 1000.0
    w[1, :8] = 0.0
    return w


def torchao_zeros(model: nn.Module) -> int:
    """Non-zero weights that torchao's own forward cast turns into zeros."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig

    layer = model[0]
    c = layer.config
    axiswise = c.cast_config_weight.scaling_granularity is ScalingGranularity.AXISWISE
    fp8 = hp_tensor_to_float8_dynamic(layer.weight.t(), c.cast_config_weight.target_dtype, LinearMMConfig(),
                                      gemm_input_role=GemmInputRole.WEIGHT,
                                      scaling_granularity=c.cast_config_weight.scaling_granularity,
                                      axiswise_dim=0 if axiswise else None,
                                      round_scales_to_power_of_2=c.round_scales_to_power_of_2)
    return int(((fp8._data.float() == 0) & (layer.weight.t() != 0)).sum())


def test_tensorwise_outlier_flushes_the_small_weights():
    model = converted("tensorwise", outlier_weight())
    health = float8.weight_health(model)
    # scale = 448 / 1000: 1e-3 becomes 4.5e-4, below half the smallest e4m3 subnormal (2^-10): zero.
    assert health == {"0": {"amax": 1000.0, "saturated": 0.0, "underflow": (2048 - 1 - 8) / 2048}}
    assert torchao_zeros(model) == 2048 - 1 - 8  # exactly what torchao's cast does


def test_rowwise_confines_the_outlier_to_its_row():
    model = converted("rowwise", outlier_weight())
    health = float8.weight_health(model)
    # One scale per output row: only row 0 (the outlier's) loses its 63 small values.
    assert health == {"0": {"amax": 1000.0, "saturated": 0.0, "underflow": 63 / 2048}}
    assert torchao_zeros(model) == 63


def test_stale_scale_saturates():
    from torchao.float8.float8_linear import LinearMMConfig
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    model = converted("tensorwise", outlier_weight())
    plain = model[0].weight.detach()

    def precomputed(scale: float) -> None:
        """The weight as float8 all-gather wraps it, with the scale its last precompute left there (as
        torchao's precompute_float8_dynamic_scale_for_fsdp leaves it)."""
        model[0].weight = nn.Parameter(WeightWithDynamicFloat8CastTensor(plain, LinearMMConfig(), torch.float8_e4m3fn))
        model[0].weight._precomputed_scale = torch.tensor(scale)

    # A precomputed scale ten times too large (as a stale float8 all-gather scale would be): the
    # outlier lands at 4480, far above the e4m3 maximum of 448; the small weights no longer flush.
    precomputed(4.48)
    assert float8.weight_health(model)["0"] == {"amax": 1000.0, "saturated": 1 / 2048, "underflow": 0.0}
    # Up to 464, half an e4m3 step above 448, a value rounds to 448 anyway: that is no saturation.
    precomputed(0.463)
    assert float8.weight_health(model)["0"]["saturated"] == 0.0
    precomputed(0.465)
    assert float8.weight_health(model)["0"]["saturated"] == 1 / 2048


def test_health_summary_names_the_worst_layer():
    health = {"a": {"amax": 3.0, "saturated": 0.0, "underflow": 0.1},
              "b": {"amax": 1.0, "saturated": 0.2, "underflow": 0.3}}
    assert float8.health_summary(health) == {"fp8_weight_amax_max": 3.0, "fp8_saturated_max": 0.2,
                                             "fp8_underflow_max": 0.3, "fp8_underflow_worst_layer": "b"}
    assert float8.health_summary({}) == {}
    assert float8.weight_health(nn.Sequential(nn.Linear(16, 16))) == {}  # nothing converted


@pytest.mark.slow
def test_two_sharded_ranks_log_the_health_of_the_full_weights(tmp_path, corpus):
    """FSDP with float8 all-gather (each rank holds half of each weight, wrapped for the float8
    all-gather, with precomputed scales): the logged numbers are those of the full weights."""
    run_train(tmp_path, "--training.steps", "4", "--data.seq_len", "64", "--training.local_batch_size", "2",
              "--metrics.log_freq", "1", "--validation.enable", "false", "--fp8.recipe", "tensorwise", "--fp8.emulate",
              "--fp8.auto_filter", "false", "--fp8.health_log_freq", "2", "--checkpoint.enable",
              "--checkpoint.interval", "4", nproc=2, corpus=corpus)
    records = metrics(tmp_path)
    with_health = [r["step"] for r in records if "fp8_underflow_max" in r]
    assert with_health == [2, 4]  # every log_freq × health_log_freq = 2 steps

    # The weights after step 4, unsharded, in one process, measured the same way.
    from test_nonfinite import read_checkpoint
    from titanlike.model.decoder import Transformer
    from titanlike.model.shape import model_args

    model = Transformer(model_args("debug"))
    layers.convert(model, Float8Options(recipe="tensorwise", emulate=True, filter_fqns=("output",)))
    model.load_state_dict(read_checkpoint(tmp_path / "checkpoint" / "step-4", tmp_path)["model"])
    want = float8.weight_health(model)
    assert len(want) == 20 and all(h["amax"] > 0 for h in want.values())
    summary = {k: v for k, v in records[-1].items() if k.startswith("fp8_")}
    assert summary["fp8_saturated_max"] == 0.0  # scales come from the amax: nothing saturates
    assert summary.keys() == float8.health_summary(want).keys()
    for key, value in float8.health_summary(want).items():
        assert summary[key] == (pytest.approx(value, rel=1e-6) if isinstance(value, float) else value), key

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(tmp_path / "tb"))
    tb.Reload()
    tags = [t for t in tb.Tags()["scalars"] if t.startswith("fp8/")]
    assert len(tags) == 20 * 3
    for name, h in want.items():
        for key, value in h.items():
            logged = {e.step: e.value for e in tb.Scalars(f"fp8/{name}/{key}")}
            assert sorted(logged) == [2, 4]
            assert logged[4] == pytest.approx(value, rel=1e-6, abs=1e-9), (name, key)
