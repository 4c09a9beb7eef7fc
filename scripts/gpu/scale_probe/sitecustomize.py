"""Upper bounds for the tensorwise recipe, GPU experiments only (never for training: the numbers it
produces are wrong on purpose). Put this folder first on PYTHONPATH and set TL_SCALE_PROBE to a
comma-separated list of:

  static      every tensorwise amax is the constant 1.0, so no amax reduction runs at all: the step
              time a delayed-scaling recipe could at best reach (it still has to fold an amax into
              each cast kernel, which this leaves out);
  fast_accum  the gradient matmuls use fast accumulation too (torchao keeps them exact by default).
"""

import os

probes = set(filter(None, os.environ.get("TL_SCALE_PROBE", "").split(",")))
if probes - {"static", "fast_accum"}:
    raise SystemExit(f"TL_SCALE_PROBE: unknown probe(s) {sorted(probes - {'static', 'fast_accum'})}")
if probes:
    import dataclasses

    import torch
    from torchao.float8 import config as ao_config
    from torchao.float8 import float8_utils

    if "static" in probes:
        exact_amax = float8_utils.tensor_to_amax

        def constant_amax(x, reduce_amax=False, device_mesh=None,
                          scaling_granularity=ao_config.ScalingGranularity.TENSORWISE, axiswise_dim=None):
            if scaling_granularity is ao_config.ScalingGranularity.TENSORWISE:
                return torch.ones((), dtype=torch.float32, device=x.device)
            return exact_amax(x, reduce_amax, device_mesh, scaling_granularity, axiswise_dim)

        float8_utils.tensor_to_amax = constant_amax  # tensor_to_scale looks it up at call time

    if "fast_accum" in probes:
        import torchao.float8 as ao_float8

        convert = ao_float8.convert_to_float8_training

        def convert_with_fast_accum(model, *args, config=None, **kwargs):
            fast = ao_config.Float8GemmConfig(use_fast_accum=True)
            config = dataclasses.replace(config, gemm_config_grad_input=fast, gemm_config_grad_weight=fast)
            return convert(model, *args, config=config, **kwargs)

        ao_float8.convert_to_float8_training = convert_with_fast_accum  # titanlike imports it at call time
