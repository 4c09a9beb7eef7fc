"""A non-finite loss or gradient norm: training.nonfinite = abort (test_train.py), skip, or rollback.

NaNs are injected deterministically with TITANLIKE_NAN_BATCHES (tests/probes/site/nan_batches.py): the loss of
the listed global batches becomes NaN on data-parallel rank 0 only, so these runs also show that
the other rank, whose own loss is finite, takes the same decision (through the global gradient norm).
"""

from __future__ import annotations

import copy
import math
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import ROOT, metrics, nan_batches, run_python, run_train, train_here
from titanlike.optim import clip_and_step, lr_factor
from titanlike.run.nonfinite import MAX_IN_A_ROW, NonFiniteLoss, NonFinitePolicy

SEQ, GLOBAL = 64, 8
COMMON = ("--data.seq_len", str(SEQ), "--training.local_batch_size", "4", "--training.global_batch_size", str(GLOBAL),
          "--metrics.log_freq", "1", "--validation.enable", "false", "--training.deterministic")
LR, WARMUP = 3e-3, 10  # train_configs/debug_model.toml

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


# ---- helpers -------------------------------------------------------------------------------------------


def read_checkpoint(step_dir: Path, tmp: Path) -> dict:
    """A checkpoint as one plain nested dict: the DCP tensors (all ranks' shards joined) and the
    trainer's own state (trainer_state.json)."""
    import json

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{step_dir.parent.parent.name}-{step_dir.name}.pt"
    dcp_to_torch_save(str(step_dir), str(out))
    state = torch.load(out, weights_only=True)
    state["train_state"] = json.loads((step_dir / "trainer_state.json").read_text())["states"]["train_state"]
    return state


def tensors(sd: dict) -> dict[str, torch.Tensor]:
    """Model weights and optimizer state (moments and step counts), by name."""
    out = {f"model.{k}": v for k, v in sd["model"].items()}
    for name, state in sd["optimizer"]["state"].items():
        out.update({f"optimizer.{name}.{k}": torch.as_tensor(v) for k, v in state.items()})
    return out


def batch_loss(sd: dict, corpus, step: int) -> float:
    """Loss of the checkpoint's weights on the global batch that step `step` of an uninterrupted run reads."""
    from titanlike.data.loader import GlobalBatchSampler, open_dataset
    from titanlike.data.order import EpochOrder
    from titanlike.model.decoder import Transformer
    from titanlike.model.loss import cross_entropy
    from titanlike.model.shape import model_args

    model = Transformer(model_args("debug"))
    model.load_state_dict(sd["model"])
    model.init_rope(SEQ)
    data = open_dataset(corpus[0], SEQ, model.args.vocab_size, "data.path")
    sampler = iter(GlobalBatchSampler(EpochOrder(len(data), 0), GLOBAL, GLOBAL, 0, 1))
    for _ in range(step):
        indices = next(sampler)
    batch = torch.stack([data[i] for i in indices])
    with torch.no_grad():
        return cross_entropy(model(batch[:, :-1]), batch[:, 1:]).item()


def train_alone(dump: Path, corpus, *overrides: str):
    """One process without torchrun (the one-GPU launch), so that the trainer's exit code reaches us."""
    return run_python("-m", "titanlike.train", "--job.config_file", str(ROOT / "train_configs" / "debug_model.toml"),
                      "--job.dump_folder", str(dump), "--training.device", "cpu", "--data.path", corpus[0],
                      *COMMON, *overrides)


def error_lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


# ---- optim.clip_and_step with skip_nonfinite ------------------------------------------------------


def pair(fused: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1, fused=fused, foreach=not fused)
    return model, opt


def train_step(model, opt, x, poison=False) -> tuple[torch.Tensor, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss = model(x).square().mean()
    (loss * float("nan") if poison else loss).backward()
    return clip_and_step(opt, list(model.parameters()), 1.0, skip_nonfinite=True)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
def test_skip_nonfinite_skips_exactly(fused):
    a, opt_a = pair(fused)
    b, opt_b = pair(fused)  # the same model, trained without ever seeing the bad step
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    for model, opt in ((a, opt_a), (b, opt_b)):
        assert float(train_step(model, opt, x)[1].tolist()) == 0.0

    before = copy.deepcopy((a.state_dict(), opt_a.state_dict()))
    norm, skipped = train_step(a, opt_a, x, poison=True)
    assert not torch.isfinite(norm).tolist()
    assert skipped.tolist() == 1.0
    after = (a.state_dict(), opt_a.state_dict())
    for k, v in before[0].items():
        assert torch.equal(v, after[0][k]), k
    for p, state in before[1]["state"].items():  # moments and the step count (bias correction) untouched
        for k, v in state.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(after[1]["state"][p][k])), (p, k)

    # The next good step lands exactly where it would have without the bad one.
    for model, opt in ((a, opt_a), (b, opt_b)):
        train_step(model, opt, x * 2)
    for (k, v), w in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(v, w), k
        assert not torch.equal(v, before[0][k]), k  # and the good steps did update


# ---- the policy alone (nonfinite.py): rows in, a verdict out -------------------------------------------

NAN, OK = float("nan"), 1.0


def policy(mode: str, checkpoints=(4,)) -> NonFinitePolicy:
    return NonFinitePolicy(mode, lambda: list(checkpoints), lambda s: f"ckpt/step-{s}")


def test_policy_all_finite_is_ok_with_the_last_loss():
    for mode in ("abort", "skip", "rollback"):
        verdict = policy(mode).judge([(2.5, OK, 0), (2.25, OK, 0)], first_step=7)
        assert (verdict.kind, verdict.loss, verdict.skipped, verdict.rollback_to) == ("ok", 2.25, 0, None)


def test_policy_abort_names_the_first_bad_value():
    with pytest.raises(NonFiniteLoss) as e:
        policy("abort").judge([(2.0, OK, 0), (2.0, float("inf"), 0), (NAN, NAN, 0)], first_step=5)
    assert str(e.value).startswith("gradient norm became inf at step 6; lower --optimizer.lr")
    assert e.value.same_on_all_ranks


def test_policy_skip_counts_and_stops_after_three_in_a_row():
    p = policy("skip")
    verdict = p.judge([(NAN, NAN, 1), (2.0, OK, 0), (NAN, NAN, 1)], first_step=1)
    assert (verdict.kind, verdict.skipped) == ("skipped", 2) and math.isnan(verdict.loss)  # the last step's loss
    assert p.skips_in_a_row == 1  # the good step in between reset the run
    assert p.judge([(NAN, NAN, 1)], first_step=4).skipped == 1 and p.skips_in_a_row == MAX_IN_A_ROW - 1
    with pytest.raises(NonFiniteLoss, match="loss became nan at step 5: 3 steps in a row had their update skipped"):
        p.judge([(NAN, NAN, 1)], first_step=5)
    # A non-finite value whose update was not skipped on the device cannot be skipped: abort.
    with pytest.raises(NonFiniteLoss, match="at step 9; lower"):
        policy("skip").judge([(NAN, NAN, 0)], first_step=9)


def test_policy_rollback_to_the_newest_earlier_checkpoint_at_most_three_times():
    p = policy("rollback", checkpoints=(4, 8, 12))
    verdict = p.judge([(2.0, OK, 0), (NAN, NAN, 0), (2.0, OK, 0)], first_step=9)
    assert (verdict.kind, verdict.rollback_to, verdict.in_a_row, verdict.loss) == ("rollback", 8, 1, None)
    step, what, value = verdict.cause
    assert (step, what) == (10, "loss") and math.isnan(value)
    assert [p.judge([(NAN, NAN, 0)], first_step=9).in_a_row for _ in range(2)] == [2, 3]
    with pytest.raises(NonFiniteLoss, match="at step 9 after 3 rollbacks in a row to ckpt/step-8"):
        p.judge([(NAN, NAN, 0)], first_step=9)
    assert policy("rollback", checkpoints=(4, 8)).judge([(NAN, OK, 0)], first_step=5).rollback_to == 4
    with pytest.raises(NonFiniteLoss, match="at step 4, before the first checkpoint: nothing to roll back to"):
        policy("rollback", checkpoints=(4, 8)).judge([(NAN, OK, 0)], first_step=4)


def test_nan_injection_poisons_listed_training_batches_only(monkeypatch):
    def loss_fn(x):
        return x.sum()

    reading = {"batch": 1}
    poisoned = nan_batches.poisoned(loss_fn, reading)
    monkeypatch.delenv(nan_batches.ENV, raising=False)
    assert not math.isnan(poisoned(torch.ones(3)).item())
    monkeypatch.setenv(nan_batches.ENV, "2,4")
    seen = []
    for reading["batch"] in range(1, 6):
        seen.append(math.isnan(poisoned(torch.ones(3)).item()))
    assert seen == [False, True, False, True, False]
    with torch.no_grad():  # validation's losses stay finite
        assert not math.isnan(poisoned(torch.ones(3)).item())


# ---- skip -----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_skip_leaves_weights_untouched_and_consumes_the_batch(tmp_path, corpus, monkeypatch):
    monkeypatch.setenv("TITANLIKE_NAN_BATCHES", "3")
    dump = tmp_path / "run"
    proc = run_train(dump, *COMMON, "--training.steps", "5", "--training.nonfinite", "skip", "--checkpoint.enable",
                     "--checkpoint.interval", "1", nproc=2, corpus=corpus)
    assert "step 3: loss became nan; update skipped (training.nonfinite = skip, 1 skipped so far)" in proc.stderr
    records = metrics(dump)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert [r["skipped_steps"] for r in records] == [0, 0, 1, 1, 1]
    assert [r["loss"] is None for r in records] == [False, False, True, False, False]  # NaN is null in JSON
    # The LR schedule moved on through the skipped step: step 4 uses step 4's LR.
    for r in records:
        assert r["lr"] == pytest.approx(LR * lr_factor(r["step"], 5, WARMUP, 0.3, "linear", 0.0))

    # Weights and optimizer state after step 3 are those after step 2, on both ranks' shards.
    ckpts = {s: read_checkpoint(dump / "checkpoint" / f"step-{s}", tmp_path) for s in (2, 3, 4)}
    s2, s3, s4 = (tensors(ckpts[s]) for s in (2, 3, 4))
    assert s2.keys() == s3.keys() and len(s2) > 50
    assert all(torch.equal(s2[k], s3[k]) for k in s2)
    assert not any(torch.equal(s3[k], s4[k]) for k in s3 if k.startswith("model."))
    assert ckpts[3]["train_state"]["skipped_steps"] == 1 and ckpts[3]["train_state"]["step"] == 3

    # The poisoned batch was consumed: step 4 trained on batch 4 (not on batch 3 again).
    assert records[3]["loss"] == pytest.approx(batch_loss(ckpts[3], corpus, 4), rel=1e-5)
    assert records[3]["loss"] != pytest.approx(batch_loss(ckpts[3], corpus, 3), rel=1e-3)


@pytest.mark.slow
def test_skip_stops_when_every_step_is_skipped(tmp_path, corpus, monkeypatch):
    monkeypatch.setenv("TITANLIKE_NAN_BATCHES", "3,4,5")
    proc = train_alone(tmp_path, corpus, "--training.steps", "8", "--training.nonfinite", "skip")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert error_lines(proc) == [
        "error: loss became nan at step 5: 3 steps in a row had their update skipped (training.nonfinite = skip), so "
        "the weights themselves have diverged; lower --optimizer.lr, raise --lr_scheduler.warmup_steps or check "
        "--training.max_norm"
    ]
    assert "Traceback" not in proc.stderr


# ---- rollback ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_rollback_reloads_checkpoint_and_skips_the_batch(tmp_path, corpus, monkeypatch):
    monkeypatch.setenv("TITANLIKE_NAN_BATCHES", "7")
    dump = tmp_path / "run"
    rollback = ("--training.steps", "10", "--training.nonfinite", "rollback", "--checkpoint.enable",
                "--checkpoint.interval", "4")
    proc = run_train(dump, *COMMON, *rollback, nproc=2, corpus=corpus)
    ckpt = dump / "checkpoint"
    assert (f"loss became nan at step 7: rolled back to {ckpt}/step-4 (1 of at most 3 in a row); training goes on "
            f"with batch 8: the 3 batches read since step 4 are not replayed") in proc.stderr
    assert metrics(dump, "rollback") == [
        {"kind": "rollback", "step": 7, "to_step": 4, "not_replayed": 3, "in_a_row": 1}]
    records = metrics(dump)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8, 9, 10]
    assert [r["batches_skipped"] for r in records] == [0] * 6 + [3] * 6
    assert all(r["loss"] is not None for r in records)
    assert sorted(p.name for p in ckpt.iterdir()) == [".titanlike.lock", "step-10", "step-4", "step-8"]

    # Step 5 after the rollback: step 4's weights on batch 8, the first batch after the poisoned one.
    step4 = read_checkpoint(ckpt / "step-4", tmp_path)
    first_5, second_5 = records[4]["loss"], records[6]["loss"]
    assert first_5 == pytest.approx(batch_loss(step4, corpus, 5), rel=1e-5)
    assert second_5 == pytest.approx(batch_loss(step4, corpus, 8), rel=1e-5)
    assert read_checkpoint(ckpt / "step-8", tmp_path)["train_state"]["data_offset"] == 3

    # A resume from step 8 (on one rank: the data position then comes from step + data_offset) goes on
    # with the batches the rolled-back run read, not with batches 9 and 10 again.
    resumed = tmp_path / "resumed"
    shutil.copytree(ckpt / "step-8", resumed / "checkpoint" / "step-8")
    monkeypatch.delenv("TITANLIKE_NAN_BATCHES")
    train_here(resumed, *COMMON, *rollback, corpus=corpus)
    after, want = {r["step"]: r["loss"] for r in metrics(resumed)}, {r["step"]: r["loss"] for r in records[6:]}
    assert sorted(after) == [9, 10]
    for s in (9, 10):
        assert after[s] == pytest.approx(want[s], rel=2e-5, abs=0), s


@pytest.mark.slow
def test_rollback_gives_up_after_three_in_a_row_and_without_a_checkpoint(tmp_path, corpus, monkeypatch):
    rollback = ("--training.steps", "10", "--training.nonfinite", "rollback", "--checkpoint.enable",
                "--checkpoint.interval", "4")
    advice = "lower --optimizer.lr, raise --lr_scheduler.warmup_steps or check --training.max_norm"
    # Batches 7-10 are all bad: step 7 rolls back to step 4, then step 5 meets batch 8, 9, 10 in turn.
    monkeypatch.setenv("TITANLIKE_NAN_BATCHES", "7,8,9,10")
    proc = train_alone(tmp_path / "again", corpus, *rollback)
    assert proc.returncode == 2, proc.stderr[-3000:]
    ckpt = tmp_path / "again" / "checkpoint"
    assert error_lines(proc) == [
        f"error: loss became nan at step 5 after 3 rollbacks in a row to {ckpt}/step-4 (training.nonfinite = "
        f"rollback): other data does not help; {advice}"
    ]
    assert [(r["step"], r["in_a_row"]) for r in metrics(tmp_path / "again", "rollback")] == [(7, 1), (5, 2), (5, 3)]
    assert sorted(p.name for p in ckpt.iterdir()) == [".titanlike.lock", "step-4"]  # nothing diverged was saved

    monkeypatch.setenv("TITANLIKE_NAN_BATCHES", "2")
    proc = train_alone(tmp_path / "early", corpus, *rollback)
    assert proc.returncode == 2 and error_lines(proc) == [
        f"error: loss became nan at step 2, before the first checkpoint: nothing to roll back to "
        f"(training.nonfinite = rollback); {advice}, or save sooner with --checkpoint.interval"
    ], proc.stderr[-3000:]


@pytest.mark.gpu
def test_clip_and_step_never_syncs_on_cuda():
    """The CUDA default (fused AdamW, training.nonfinite other than skip): clipping and the update are queued
    with no host sync; with skip, the run reads the flag once a step, and a poisoned step updates nothing."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    x = torch.randn(16, 64, device="cuda")
    train_step(model, opt, x)  # creates the optimizer state
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    torch.cuda.set_sync_debug_mode("error")  # any host sync in here raises
    try:
        clip_and_step(opt, list(model.parameters()), 1.0, skip_nonfinite=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    before = [p.detach().clone() for p in model.parameters()]
    flags = []
    for poison in (True, False):
        model.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        (loss * float("nan") if poison else loss).backward()
        flags.append(clip_and_step(opt, list(model.parameters()), 1.0, skip_nonfinite=True)[1])
        if poison:
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # skipped: untouched
    assert [f.item() for f in flags] == [1.0, 0.0]
    assert not any(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the good step updated