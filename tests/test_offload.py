"""parallel.cpu_offload on CPU: the refusals (config, degrees, no GPU), the host memory it needs and the
check of it, and FSDP's offload mechanics over a one-rank gloo mesh (the path one GPU takes), which must
train as the plain model does. The GPU runs themselves are in test_gpu.py."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

from titanlike import parallel, preflight
from titanlike.config import ConfigError
from titanlike.config.dims import ParallelDims
from titanlike.config.optimizer import Optimizer
from titanlike.model.decoder import Transformer
from titanlike.model.shape import ModelArgs
from titanlike.optim import build_optimizer, clip_and_step
from titanlike.parallel import offload

GiB = 2**30


def preflight_error(capsys, monkeypatch, world: int, *argv: str) -> str:
    monkeypatch.setenv(preflight.WORLD_ENV, str(world))
    rc = preflight.main(["--parallel.cpu_offload", "--job.dump_folder", "/tmp/titanlike-offload-test", *argv])
    return "" if rc == 0 else capsys.readouterr().err


@pytest.mark.parametrize("world,argv,expected", [
    (2, ["--fp8.recipe", "tensorwise", "--fp8.emulate"],
     "error: parallel.cpu_offload cannot all-gather weights in float8, which tensorwise turns on with more than one "
     "shard: set --fp8.enable_fsdp_float8_all_gather false\n"),
    (2, ["--parallel.dp_shard", "1", "--parallel.dp_replicate", "-1"],
     "error: parallel.cpu_offload works with plain FSDP, not HSDP (parallel.dp_replicate resolves to 2): set "
     "--parallel.dp_replicate 1\n"),
    (2, ["--fp8.recipe", "tensorwise", "--fp8.emulate", "--fp8.enable_fsdp_float8_all_gather", "false"], ""),
    (1, ["--fp8.recipe", "tensorwise", "--fp8.emulate"], ""),  # one shard: nothing gathered in float8
    (2, ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op:wqkv,w1"],
     ""),
])
def test_preflight_refuses_what_offload_cannot_do_at_this_world_size(capsys, monkeypatch, world, argv, expected):
    assert preflight_error(capsys, monkeypatch, world, *argv) == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without a GPU")
def test_offload_without_a_gpu_is_one_line(tmp_path, capsys):
    from titanlike.train import main

    rc = main(["--parallel.cpu_offload", "--training.steps", "1", "--job.dump_folder", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2 and err == ("error: parallel.cpu_offload moves the training state from a GPU to host memory, and "
                               "no CUDA GPU is visible: drop --parallel.cpu_offload\n")


def test_host_bytes_per_rank():
    # 8B parameters over 2 shards: fp32 weights and gradients (8 B) and fp32 moments (8 B) = 16 B each.
    assert offload.host_bytes_per_rank(8 * 10**9, 2, "fp32", False) == 64 * 10**9
    assert offload.host_bytes_per_rank(10**9, 1, "8bit", False) == int(10.04 * 10**9)
    # A background save's host copy: weights (4 B) and moments again.
    assert offload.host_bytes_per_rank(10**9, 1, "fp32", True) == 28 * 10**9


def test_host_available_reads_memavailable(tmp_path):
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       1000 kB\nMemFree:         10 kB\nMemAvailable:    700 kB\n")
    assert offload.host_available_bytes(str(info)) == 700 * 1024
    assert offload.host_available_bytes(str(tmp_path / "absent")) > 0  # physical memory where no meminfo


def test_host_memory_check_says_what_it_needs_and_refuses_a_host_without_it(monkeypatch, caplog):
    monkeypatch.setattr(offload, "host_available_bytes", lambda: 100 * GiB)
    with caplog.at_level(logging.INFO, logger="titanlike"):
        offload.check_host_memory(2 * 2**30, 1, "fp32", False, local_ranks=2, log=True)  # 2 × 32 GiB fits
    assert ("cpu offload: 32.0 GiB of host memory a rank (2.15B parameters: fp32 weights and gradients, fp32 AdamW "
            "moments, over dp_shard 1), 64.0 GiB for the 2 rank(s) of this host; 100.0 GiB available") in caplog.text
    with pytest.raises(ConfigError) as e:
        offload.check_host_memory(4 * 2**30, 1, "fp32", False, local_ranks=2, log=False)
    assert str(e.value) == ("parallel.cpu_offload needs 128.0 GiB of host memory on each host (2 rank(s) × 64.0 GiB) "
                            "but a host has 100.0 GiB available: use more GPUs (a larger dp_shard), "
                            "--optimizer.state_dtype 8bit, or a smaller model")


def test_cpu_threads_share_the_cores_unless_the_user_chose():
    cores = len(__import__("os").sched_getaffinity(0))
    assert offload.cpu_threads(1, {}) == cores
    assert offload.cpu_threads(1, {"OMP_NUM_THREADS": "1"}) == cores  # torchrun's and the launcher's default
    assert offload.cpu_threads(1, {"OMP_NUM_THREADS": "3"}) is None  # the user's
    assert offload.cpu_threads(10**6, {}) == 1


ARGS = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64)


def train(model: Transformer, steps: int) -> list[float]:
    optimizer = build_optimizer(model, Optimizer(lr=1e-2), "cpu", host_params=True)
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        tokens = torch.randint(0, 64, (2, 17), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        clip_and_step(optimizer, list(model.parameters()), max_norm=0.5, skip_nonfinite=True)
        out.append(loss.item())
    return out


def test_offloaded_fsdp_over_one_rank_trains_as_the_plain_model():
    """One process, a one-rank gloo mesh (init_distributed's single-GPU path): FSDP's CPU offload keeps the
    weights and gradients as host DTensors, the host's fused AdamW updates them, clipping and the
    non-finite check read host gradients; the losses are the plain model's."""
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.tensor import DTensor

    plain = Transformer(ARGS)
    plain.init_weights(0, 16)
    want = train(plain, 4)

    dims = ParallelDims(world_size=1, dp_replicate=1, dp_shard=1, global_batch=2, accum_steps=1)
    cpu = torch.device("cpu")
    assert parallel.init_distributed(dims, cpu, 60) is None  # one rank: no process group unless offloading
    mesh = parallel.init_distributed(dims, cpu, 60, cpu_offload=True)
    try:
        assert dist.get_world_size() == 1 and mesh.size() == 1
        with torch.device("meta"):
            model = Transformer(ARGS)
        # Unpinned: this torch build may have no accelerator to pin host memory for.
        parallel.apply_fsdp(model, mesh, None, "always", offload_policy=CPUOffloadPolicy(pin_memory=False))
        model.to_empty(device=offload.param_device(torch.device("cuda"), True))
        model.init_weights(0, 16)
        offload.buffers_to(model, cpu)
        got = train(model, 4)
        assert all(isinstance(p, DTensor) and p.device.type == "cpu" for p in model.parameters())
    finally:
        dist.destroy_process_group()
    assert got == pytest.approx(want, rel=1e-5)
