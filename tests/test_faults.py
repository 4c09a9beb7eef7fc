"""Faults: out of GPU memory, a GPU without float8, and SIGKILLs at random moments (in a step, in a save)."""

from __future__ import annotations

import random
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, metrics, run_python, run_train
from test_checkpoint import SCHEDULE, STEPS, ckpt, folders, output, signal_job, start, step_losses, train_args, wait_for
from titanlike.config import JobConfig
from titanlike.config.dims import parallel_dims
from titanlike.errors import UserError
from titanlike.float8 import Float8Options
from titanlike.float8.layers import check_device
from titanlike.process import faults

# ---- out of memory ----------------------------------------------------------------------------------

H100 = {"name": "NVIDIA H100 80GB HBM3", "total": 79.2, "allocated": 77.9, "reserved": 78.6}


def config(**sections) -> JobConfig:
    cfg = JobConfig()
    for section, values in sections.items():
        for key, value in values.items():
            setattr(getattr(cfg, section), key, value)
    return cfg


def test_oom_message_names_peak_batch_and_knobs():
    cfg = config(training={"local_batch_size": 8, "global_batch_size": 128}, data={"seq_len": 4096})
    assert faults.oom_message(cfg, parallel_dims(cfg, 8), 3, 12, H100) == (
        "out of GPU memory on rank 3 (NVIDIA H100 80GB HBM3, 79.2 GiB) after 12 completed steps: peak 77.9 GiB "
        "allocated, 78.6 GiB reserved; training.local_batch_size 8 × data.seq_len 4096; to use less: "
        "--activation_checkpoint.mode selective or full (now none), --training.local_batch_size 4 "
        "--training.global_batch_size 128 (the same global batch in 4 gradient-accumulation micro-batches), "
        "--training.loss_chunk_tokens 4096 (the logits then never exist whole), "
        "--optimizer.state_dtype 8bit (AdamW's moments in about 2 bytes a parameter instead of 8), "
        "--fp8.recipe tensorwise (now none): FSDP then gathers weights in float8, "
        "--parallel.reshard_after_forward always (frees every gathered weight after forward); "
        "--profiling.memory_snapshot shows what held it"
    )


def test_oom_message_only_offers_what_is_left(monkeypatch):
    # Full AC and tensorwise float8 already on, one GPU, an odd local batch,
    # fragmentation (with the allocator's default settings turned off), a memory cap and a snapshot.
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    cfg = config(training={"local_batch_size": 6, "gpu_memory_limit_gib": 31.0, "loss_chunk_tokens": 2048},
                 activation_checkpoint={"mode": "full"}, fp8={"recipe": "tensorwise"},
                 optimizer={"state_dtype": "8bit"})
    msg = faults.oom_message(cfg, parallel_dims(cfg, 1), 0, 0, {**H100, "allocated": 20.0, "reserved": 30.5},
                             "/run/oom/snap.pickle")
    assert msg.startswith("out of GPU memory on rank 0 (NVIDIA H100 80GB HBM3, 79.2 GiB, capped at 31 GiB by "
                          "training.gpu_memory_limit_gib) after 0 completed steps: peak 20.0 GiB allocated")
    assert msg.endswith(
        "to use less: --training.local_batch_size 3 --training.global_batch_size 6 (the same global batch in 2 "
        "gradient-accumulation micro-batches), PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (reserved far "
        "above allocated: fragmentation); memory snapshot in /run/oom/snap.pickle"
    )
    assert "activation_checkpoint" not in msg and "fp8" not in msg
    assert "loss_chunk_tokens" not in msg and "state_dtype" not in msg
    # With expandable segments on (titanlike's default) the allocator already does what it can.
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    memory = {**H100, "allocated": 20.0, "reserved": 30.5}
    assert "PYTORCH_CUDA_ALLOC_CONF" not in faults.oom_message(cfg, parallel_dims(cfg, 1), 0, 0, memory)
    # Selective AC → full; a local batch of 1 → shorter sequences; no step yet → while building.
    cfg = config(training={"local_batch_size": 1}, activation_checkpoint={"mode": "selective"})
    msg = faults.oom_message(cfg, parallel_dims(cfg, 2), 1, None, None)
    assert "on rank 1 while building the model: peak memory unknown (not a CUDA device)" in msg
    assert "--activation_checkpoint.mode full (now selective), --data.seq_len 128 (local batch is already 1)" in msg
    # One GPU: tensorwise float8 is offered for its lower peak only when compiled.
    eager = config(fp8={"recipe": "rowwise"})
    assert "--fp8.recipe" not in faults.oom_message(eager, parallel_dims(eager, 1), 0, 3, H100)
    compiled = config(fp8={"recipe": "rowwise"}, compile={"enable": True})
    assert ("--fp8.recipe tensorwise (now rowwise): compiled, it lowered the 1b preset's peak from 64 to 53 GiB on "
            "one GPU") in faults.oom_message(compiled, parallel_dims(compiled, 1), 0, 3, H100)


def test_oom_message_offers_only_a_state_dtype_the_optimizer_takes():
    """Muon's AdamW parameters take fp32 or bf16 moments, not 8bit (a config refusal): its line offers bf16."""
    cfg = config(optimizer={"name": "muon"})
    msg = faults.oom_message(cfg, parallel_dims(cfg, 1), 0, 3, H100)
    assert "--optimizer.state_dtype bf16 (AdamW's moments in 4 bytes a parameter instead of 8)" in msg
    assert "8bit" not in msg


@pytest.mark.slow
def test_oom_in_a_step_is_one_line_and_exit_2(tmp_path, corpus):
    """The real trainer, its model's forward made to raise torch.OutOfMemoryError in step 3."""
    hooked = tmp_path / "oom_train.py"
    hooked.write_text(textwrap.dedent("""
        import sys
        import torch
        from titanlike.model import decoder as model

        real, calls = model.Transformer.forward, []

        def forward(self, tokens, *args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
            return real(self, tokens, *args, **kwargs)

        model.Transformer.forward = forward
        from titanlike.train import main
        sys.exit(main())
    """))
    proc = run_python(str(hooked), "--job.config_file", str(ROOT / "train_configs" / "debug_model.toml"),
                      "--job.dump_folder", str(tmp_path / "run"), "--training.device", "cpu", "--data.path", corpus[0],
                      "--training.steps", "5", "--training.local_batch_size", "4", "--data.seq_len", "64",
                      "--metrics.log_freq", "1", "--validation.enable", "false")
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: out of GPU memory on rank 0 after 2 completed steps: peak memory unknown (not a CUDA device); "
        "training.local_batch_size 4 × data.seq_len 64; to use less: --activation_checkpoint.mode selective or "
        "full (now none), --training.local_batch_size 2 --training.global_batch_size 4 (the same global batch in "
        "2 gradient-accumulation micro-batches), --training.loss_chunk_tokens 4096 (the logits then never exist "
        "whole), --optimizer.state_dtype 8bit (AdamW's moments in about 2 bytes a parameter instead of 8); "
        "--profiling.memory_snapshot shows what held it"
    ]
    assert "Traceback" not in proc.stderr
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1, 2]


# ---- a GPU without float8 ------------------------------------------------------------------------------


@pytest.mark.parametrize("gpu,capability", [("NVIDIA A100-SXM4-80GB", (8, 0)), ("Tesla V100-SXM2-32GB", (7, 0))])
def test_gpu_without_float8_is_one_line(monkeypatch, gpu, capability):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: gpu)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: capability)
    with pytest.raises(UserError) as e:
        check_device(Float8Options(recipe="rowwise", auto_filter=True), torch.device("cuda", 0))
    assert str(e.value) == (
        f"fp8.recipe = rowwise: {gpu} (compute capability {capability[0]}.{capability[1]}) has no float8 tensor "
        f"cores (they start at 8.9: Ada, Hopper, Blackwell); use --fp8.recipe none"
    )
    # Emulation runs anywhere: no check.
    check_device(Float8Options(recipe="rowwise", emulate=True, auto_filter=True), torch.device("cuda", 0))


# ---- SIGKILL at random moments -----------------------------------------------------------------------

SLOW_SAVE = 0.8  # seconds each save's write takes in the killed runs, so that a kill can land inside it
INTERVAL = ("--checkpoint.interval", "2")


def slow_save_launcher(tmp_path: Path, markers: Path) -> Path:
    """The trainer, with each rank's write of a checkpoint announced (a marker file) and slowed down:
    half the delay before its data files are written, half after, before DCP's metadata and the rename."""
    hooked = tmp_path / "slow_save_train.py"
    hooked.write_text(textwrap.dedent(f"""
        import os, sys, time
        import torch.distributed.checkpoint.filesystem as fs

        real_write = fs._FileSystemWriter.write_data

        def slow_write(self, plan, planner):
            step = os.path.basename(str(self.path)).split(".")[0]
            open(os.path.join({str(markers)!r}, step + ".rank" + os.environ["RANK"]), "w").close()
            time.sleep({SLOW_SAVE / 2})
            result = real_write(self, plan, planner)
            time.sleep({SLOW_SAVE / 2})
            return result

        fs._FileSystemWriter.write_data = slow_write
        from titanlike.train import main
        sys.exit(main())
    """))
    return hooked


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_is_bit_exact(tmp_path, corpus):
    """Three SIGKILLs to torchrun and both workers, at moments drawn from a seeded RNG: in a step, in
    a save, in a step; each time the next run resumes from the newest complete checkpoint. Every loss
    any of the runs logged, the last one included, is bit for bit the uninterrupted run's."""
    rng = random.Random(20261122)
    reference = tmp_path / "reference"
    run_train(reference, *SCHEDULE, *INTERVAL, nproc=2, corpus=corpus)
    want = step_losses(reference)

    dump, markers = tmp_path / "run", tmp_path / "markers"
    markers.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(slow_save_launcher(tmp_path, markers)), *train_args(dump, corpus, *INTERVAL)]
    half_written = None
    for i, kind in enumerate(["step", "save", "step"]):
        complete = ([int(n.split("-")[1]) for n in folders(dump) if not n.endswith(".tmp")]
                    if ckpt(dump).exists() else [])
        newest = max(complete, default=0)
        seen = len(metrics(dump)) if (dump / "metrics.jsonl").exists() else 0
        for m in markers.iterdir():
            m.unlink()
        logs = tmp_path / f"killed{i}"
        proc = start(cmd, logs)
        try:
            if kind == "step":
                # After an odd step comes no save: the kill lands in the next step's forward or backward.
                target = min(newest + rng.choice([3, 5]), STEPS - 3)
                # (seen and target bound now: ruff's B023 cannot tell that wait_for runs the check at once.
                # A resume first moves the killed attempt's records after its checkpoint aside, so the
                # file may shrink before it grows: the records past `seen` are this run's either way.)
                wait_for(lambda seen=seen, target=target: (dump / "metrics.jsonl").exists() and
                         max((r["step"] for r in metrics(dump)[seen:]), default=0) >= target,
                         f"step {target}", proc, logs)
                time.sleep(rng.uniform(0.0, 0.1))  # a step takes ~0.2 s here
            else:
                target = newest + rng.choice([2, 4])
                wait_for(lambda target=target: all((markers / f"step-{target}.rank{r}").exists() for r in (0, 1)),
                         f"the save of step {target}", proc, logs)
                time.sleep(rng.uniform(0.0, SLOW_SAVE * 0.9))
        finally:
            signal_job(proc, signal.SIGKILL)
            proc.wait()
        assert proc.returncode == -signal.SIGKILL
        log = output(logs)
        if newest:
            assert f"resumed from {ckpt(dump)}/step-{newest} at step {newest} (data position and RNG restored)" in log
        if half_written:
            assert f"ignoring {ckpt(dump)}/step-{half_written}.tmp: a save that never completed" in log
            half_written = None
        if kind == "save":
            # Killed inside the write: the step's folder never became a checkpoint.
            assert f"step-{target}.tmp" in folders(dump) and f"step-{target}" not in folders(dump), folders(dump)
            half_written = target

    final = run_train(dump, *SCHEDULE, *INTERVAL, nproc=2, corpus=corpus)
    newest = max(int(n.split("-")[1]) for n in folders(dump) if not n.endswith(".tmp"))
    assert "resumed from" in final.stderr
    records = metrics(dump)
    assert records[-1]["step"] == STEPS and records[-1]["loss"] == want[STEPS]
    mismatched = [(r["step"], r["loss"], want[r["step"]]) for r in records if r["loss"] != want[r["step"]]]
    assert not mismatched
    # Some steps ran twice (after a checkpoint, before a kill): metrics.jsonl keeps the run that counts,
    # each step once; the killed attempts' later records were moved to metrics.dropped.jsonl.
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert (dump / "metrics.dropped.jsonl").read_text().strip()
    assert folders(dump) == [f"step-{s}" for s in range(2, STEPS + 1, 2)]  # the half-written save was redone
    assert newest == STEPS


@pytest.mark.gpu
def test_real_cuda_oom_is_reported_with_its_peak():
    device = torch.device("cuda", torch.cuda.current_device())
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(2**60, dtype=torch.uint8, device=device)
    memory = faults.gpu_memory(device)
    assert memory["total"] > 1 and 0 <= memory["allocated"] <= memory["reserved"] <= memory["total"]
    msg = faults.oom_message(JobConfig(), parallel_dims(JobConfig(), 1), 0, 5, memory)
    assert f"({torch.cuda.get_device_name(device)}, {memory['total']:.1f} GiB) after 5 completed steps: peak" in msg
