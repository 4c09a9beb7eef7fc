"""`--optimizer.name muon` through the real trainer: its checkpoints, a resume at another world size, a resume
with another optimizer (refused) and a new run from the other's weights (checkpoint.initial_load_path), float8
and compile, and what it logs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conftest import losses, metrics, run_train, train_here

MUON = ("--optimizer.name", "muon")
# Small steps of the debug model; no warmup, so that two steps move the weights by a visible amount.
QUICK = ("--data.seq_len", "32", "--training.local_batch_size", "2", "--metrics.log_freq", "1",
         "--validation.enable", "false", "--lr_scheduler.warmup_steps", "0", "--training.deterministic")


@pytest.fixture(scope="module")
def swaps(tmp_path_factory, corpus) -> dict:
    """A Muon run of two steps, saved; an AdamW resume of it (refused); an AdamW run from its step's weights,
    saved; a Muon run of one step from that step's weights. Each logs every step."""
    root = tmp_path_factory.mktemp("swaps")
    runs = {"muon": root / "muon", "adamw": root / "adamw", "back": root / "back"}
    saved = ("--training.steps", "2", "--checkpoint.enable", "--checkpoint.interval", "2")
    train_here(runs["muon"], *QUICK, *saved, *MUON, corpus=corpus)
    refused = train_here(runs["muon"], *QUICK, "--training.steps", "3", "--checkpoint.enable", corpus=corpus,
                         check=False)
    train_here(runs["adamw"], *QUICK, *saved, "--checkpoint.initial_load_path",
               str(runs["muon"] / "checkpoint" / "step-2"), corpus=corpus)
    train_here(runs["back"], *QUICK, "--training.steps", "1", *MUON, "--checkpoint.initial_load_path",
               str(runs["adamw"] / "checkpoint" / "step-2"), corpus=corpus)
    return {**runs, "refused": refused}


def test_a_resume_with_another_optimizer_is_refused_and_its_weights_start_a_new_run(swaps):
    """A Muon checkpoint resumed by AdamW: one line naming both and the way to its weights alone. That way,
    checkpoint.initial_load_path, starts an AdamW run from the Muon step and a Muon run from the AdamW step: each
    first loss is below the first loss of the run whose weights it took (the same batch from the same initial
    weights; only the two loaded updates differ)."""
    step, refused = swaps["muon"] / "checkpoint" / "step-2", swaps["refused"]
    lines = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr[-3000:]
    assert (f"{step} was trained with optimizer.name = muon, this run has adamw: resume with --optimizer.name muon "
            in lines[0]) and f"--checkpoint.initial_load_path {step} in a new --job.dump_folder" in lines[0]
    assert step.is_dir()  # refused, not set aside as damaged
    muon, adamw, back = (losses(swaps[name]) for name in ("muon", "adamw", "back"))
    assert adamw[1] < muon[1] and back[1] < adamw[1], (muon, adamw, back)


def test_each_log_record_has_the_update_rms_by_kind_and_the_optimizers_share_of_the_step(swaps):
    """Muon's records carry each kind's update RMS per unit of lr, within what each update can be: Muon's at
    most 0.2 (match_rms_adamw's RMS of an orthogonal update) times the largest singular value Newton–Schulz's
    polynomials (the default's, composed over its steps) make of values in [0, 1] (bf16 aside); AdamW's
    normalised moment m̂/sqrt(v̂) at most (1 - β1)/sqrt(1 - β2)/sqrt(1 - β1²/β2) (Cauchy–Schwarz over the
    moments' sums; bias correction keeps it under that). AdamW alone measures none. Both carry the clip and
    update's seconds and its share of the step."""
    from titanlike.config.optimizer import Optimizer
    from titanlike.optim.orthogonalize import ns_schedule

    section = Optimizer()
    schedule = ns_schedule(section.ns_coefficients, section.ns_steps)

    def composed(x: float) -> float:
        for step in range(section.ns_steps):
            a, b, c = schedule[min(step, len(schedule) - 1)]
            x = a * x + b * x**3 + c * x**5
        return x

    widest = max(composed(i / 10000) for i in range(10001))
    b1, b2 = 0.9, 0.95
    adamw_bound = (1 - b1) / (1 - b2) ** 0.5 / (1 - b1**2 / b2) ** 0.5
    assert 1.1 < widest < 1.3 and 1.1 < adamw_bound < 1.2  # the bounds mean something
    for name, kinds in (("muon", ("muon", "adamw")), ("back", ("muon", "adamw")), ("adamw", ())):
        records = metrics(swaps[name])
        assert records and all(f"update_rms_{k}" in r for r in records for k in kinds), (name, records)
        assert {k for r in records for k in r if k.startswith("update_rms")} == {f"update_rms_{k}" for k in kinds}
        for r in records:
            if kinds:
                assert 0 < r["update_rms_muon"] <= 0.2 * widest * 1.01, (name, r)  # 1 %: bf16's rounding
                assert 0 < r["update_rms_adamw"] <= adamw_bound, (name, r)
            assert r["optimizer_s"] > 0 and 0 < r["optimizer_share"] < 1, (name, r)


def test_steps_that_are_not_logged_are_not_timed(tmp_path, corpus, monkeypatch):
    """The update is timed only at log steps (the first, every metrics.log_freq-th, the last): the other steps
    make no timer, so no CUDA event and no sync on a GPU."""
    from titanlike import trainer
    from titanlike.records.metrics import StepTimer

    made = []

    class Counted(StepTimer):
        def __init__(self, device):
            made.append(device)
            super().__init__(device)

    monkeypatch.setattr(trainer, "StepTimer", Counted)
    train_here(tmp_path, *QUICK, "--training.steps", "5", "--metrics.log_freq", "2", corpus=corpus)
    assert sorted(losses(tmp_path)) == [1, 2, 4, 5] and len(made) == 4
    assert all("optimizer_share" in r for r in metrics(tmp_path))


def copy_step(src: Path, step: int, dst: Path) -> None:
    shutil.copytree(src / "checkpoint" / f"step-{step}", dst / "checkpoint" / f"step-{step}")


@pytest.mark.slow  # two two-rank runs and three in this process: about 50 s
def test_a_muon_run_resumes_at_another_world_size(tmp_path, corpus):
    """Saved at step 3 on two gloo ranks and resumed on one, and saved on one and resumed on two: steps 4-6
    take the losses of the uninterrupted run, to the order of fp32 reductions (the ranks sum the gradients in
    another order; Muon's momentum and AdamW's moments reshard as DTensors). Resumed at the world size that
    saved it (one rank here; two in test_muon.py's sharded checkpoint test), bit for bit the same."""
    args = (*QUICK, *MUON, "--training.steps", "6", "--training.global_batch_size", "4", "--checkpoint.enable",
            "--checkpoint.interval", "3")
    runs = {name: tmp_path / name for name in ("two", "one", "one_from_two", "two_from_one", "one_again")}
    run_train(runs["two"], *args, nproc=2, corpus=corpus)
    train_here(runs["one"], *args, corpus=corpus)
    for resumed, source, nproc in (("one_from_two", "two", 1), ("two_from_one", "one", 2), ("one_again", "one", 1)):
        copy_step(runs[source], 3, runs[resumed])
        if nproc == 1:
            train_here(runs[resumed], *args, corpus=corpus)
        else:
            run_train(runs[resumed], *args, nproc=2, corpus=corpus)
    got = {name: losses(path) for name, path in runs.items()}
    assert got["one_again"] == {s: got["one"][s] for s in (4, 5, 6)}, got
    for resumed, source in (("one_from_two", "two"), ("two_from_one", "one")):
        assert sorted(got[resumed]) == [4, 5, 6]
        # Same samples, same weights; another batch would change a loss by ~0.1, far outside this tolerance.
        for s in (4, 5, 6):
            assert got[resumed][s] == pytest.approx(got[source][s], rel=2e-5, abs=0), (resumed, s, got)


FP8 = ("--fp8.recipe", "tensorwise", "--fp8.emulate", "--fp8.auto_filter", "false", "--compile.enable")


def assert_trains(dump: Path) -> None:
    """Every logged loss finite, and the last below the first by more than step-to-step noise (0.5 nats: the
    debug model's first steps fall from ln(320) = 5.8 by about 2 in 12 steps at this learning rate)."""
    got = losses(dump)
    assert sorted(got) == list(range(1, 13)) and all(v == v and abs(v) < float("inf") for v in got.values()), got
    assert got[12] < got[1] - 0.5, got


@pytest.mark.slow  # compiled, two gloo ranks
def test_muon_trains_compiled_float8_with_float8_all_gather_on_two_ranks(tmp_path, corpus):
    """Tensorwise float8 (emulated) and compile on two ranks, where the weights are gathered in float8 with
    scales the converter precomputes after each of Muon's steps (its post-step hook)."""
    proc = run_train(tmp_path, *QUICK, *MUON, *FP8, "--training.steps", "12", "--training.global_batch_size", "4",
                     nproc=2, corpus=corpus)
    started = proc.stderr
    assert "float8 tensorwise (emulated): " in started and "float8 all-gather on" in started, started[-3000:]
    assert_trains(tmp_path)


@pytest.mark.slow  # compiled
def test_muon_trains_compiled_float8_with_delayed_scaling(tmp_path, corpus):
    """Delayed scaling on one process: the converter's hook rolls the amax history after each of Muon's steps."""
    proc = train_here(tmp_path, *QUICK, *MUON, *FP8, "--fp8.scaling", "delayed", "--training.steps", "12",
                      corpus=corpus)
    assert "delayed scaling (amax history" in proc.stderr, proc.stderr[-3000:]
    assert_trains(tmp_path)
