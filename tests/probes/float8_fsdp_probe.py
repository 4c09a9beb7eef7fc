"""Worker for tests/test_float8.py: what does FSDP really all-gather with float8 all-gather on?

Run as `torchrun --nproc_per_node=2 tests/probes/float8_fsdp_probe.py OUT.json [cpu|cuda]` (CPU with gloo
and float8 emulated, the default; or one GPU per rank with NCCL and real float8 kernels). Builds a
small Llama twice, with torchao tensorwise float8 + float8 all-gather and without, each through
titanlike's own Float8Converter and parallel.apply_fsdp, and records during a forward pass:
every all-gather collective (dtype, bytes sent by this rank), and every float8 weight's
fsdp_pre_all_gather (dtype and element count of what it hands to FSDP, and whether a
precomputed scale was used; with one, whether titanlike's fused cast gave the same bytes as
torchao's own). Rank 0 writes the records as JSON.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist

from titanlike import parallel
from titanlike.config.schema import Fp8
from titanlike.converters import ModelConverters
from titanlike.float8 import Float8Converter
from titanlike.model.converter import ConvertArgs
from titanlike.model.decoder import Transformer
from titanlike.model.shape import ModelArgs
from titanlike.run.state import TrainState

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=64)
SEQ = 16
DEVICE_TYPE = sys.argv[2] if len(sys.argv) > 2 else "cpu"


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if DEVICE_TYPE == "cuda" else torch.device("cpu")


class Recorder:
    def __init__(self):
        self.collectives: list[dict] = []
        self.pre_all_gather: list[dict] = []
        self.active = False
        self._depth = 0

    @contextlib.contextmanager
    def patch(self):
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

        originals = {name: getattr(dist, name) for name in ("all_gather_single", "all_gather_into_tensor")
                     if hasattr(dist, name)}
        pre = WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather

        def wrap(name, fn):
            def recorded(output_tensor, input_tensor, *args, **kwargs):
                outer = self._depth == 0
                self._depth += 1
                try:
                    if outer and self.active:
                        self.collectives.append({"op": name, "dtype": str(input_tensor.dtype),
                                                 "numel": input_tensor.numel(),
                                                 "bytes": input_tensor.numel() * input_tensor.element_size()})
                    return fn(output_tensor, input_tensor, *args, **kwargs)
                finally:
                    self._depth -= 1
            return recorded

        def recorded_pre(weight, mesh):  # FSDP reads this signature: keep it (self, mesh)
            used_precomputed = weight._precomputed_scale is not None
            out, meta = pre(weight, mesh)
            if self.active:
                record = {"dtypes": [str(t.dtype) for t in out], "numel": sum(t.numel() for t in out),
                          "bytes": sum(t.numel() * t.element_size() for t in out),
                          "shard_numel": weight.numel(), "precomputed": used_precomputed, "scale": float(meta[0])}
                self.pre_all_gather.append(record)
            return out, meta

        for name, fn in originals.items():
            setattr(dist, name, wrap(name, fn))
        WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather = recorded_pre
        try:
            yield self
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)
            WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather = pre


class NoMetrics:
    def scalars(self, step, values):
        pass

    def note(self, values):
        pass


def build(fp8: bool, mesh):
    with torch.device("meta"):
        model = Transformer(ARGS)
    cfg = Fp8(recipe="tensorwise" if fp8 else "none", emulate=DEVICE_TYPE == "cpu", auto_filter=False,
              filter_fqns=["output"])
    fp8 = Float8Converter.from_config(cfg, dp_shard=mesh.size())  # all-gather and precompute left to their defaults
    fp8.convert(model, ConvertArgs(device=device(), batch=2, seq_len=SEQ))
    parallel.apply_fsdp(model, mesh, None, "default")
    model.to_empty(device=device())
    model.init_weights(seed=0, seq_len=SEQ)
    return model, fp8


def full_amax(weight) -> float:
    local = weight._local_tensor
    hp = getattr(local, "_tensor", local)
    amax = hp.detach().abs().max().float()
    dist.all_reduce(amax, op=dist.ReduceOp.MAX)
    return float(amax)


def case(fp8: bool, mesh, rec: Recorder) -> dict:
    model, component = build(fp8, mesh)
    params = {name: (p.shape.numel(), p.to_local().numel(), type(p.to_local()).__name__)
              for name, p in model.named_parameters()}
    torch.manual_seed(1)
    tokens = torch.randint(0, ARGS.vocab_size, (2, SEQ)).to(device())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    rec.collectives, rec.pre_all_gather, rec.active = [], [], True
    logits = model(tokens)
    rec.active = False
    first = {"collectives": rec.collectives, "pre_all_gather": rec.pre_all_gather}
    logits.float().pow(2).mean().backward()
    # The trainer attaches the converter before step 1 (so step 1 gathers with precomputed scales too);
    # here after the first forward, which then shows the scales computed on the fly.
    ModelConverters([component]).attach(optimizer, counters=TrainState(), metrics=NoMetrics())
    optimizer.step()  # the converter's hook precomputes every weight's scale

    precomputed = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        # torchao sets the scale on the DTensor's own local tensor (to_local() may return a fresh view).
        local = getattr(weight, "_local_tensor", None)
        if local is not None and hasattr(local, "_precomputed_scale"):
            scale = local._precomputed_scale
            amax = torch.tensor(full_amax(weight), dtype=torch.float64)
            precomputed[name] = {"scale": None if scale is None else float(scale),
                                 "expected": float(torch.finfo(torch.float8_e4m3fn).max / amax)}

    rec.collectives, rec.pre_all_gather, rec.active = [], [], True
    with torch.no_grad():
        model(tokens)
    rec.active = False
    second = {"collectives": rec.collectives, "pre_all_gather": rec.pre_all_gather}
    options, report = component.options, component.report
    return {"plan": {"fsdp_float8_all_gather": options.fsdp_float8_all_gather,
                     "precompute_scales": options.precompute_scales,
                     "converted": report.converted, "skipped": report.skipped},
            "params": params, "first": first, "second": second, "precomputed": precomputed,
            "logits": logits.detach().flatten()[:512].tolist()}


def main() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    if DEVICE_TYPE == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if DEVICE_TYPE == "cuda" else "gloo")
    mesh = init_device_mesh(DEVICE_TYPE, (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    rec = Recorder()
    with rec.patch():
        out = {"world": dist.get_world_size(), "fp8": case(True, mesh, rec), "plain": case(False, mesh, rec)}
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
