"""Validation reads each held-out window at most once an evaluation, whatever validation.steps says,
and gives way to a stop request. One rank, in this process (train_here)."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from conftest import SMALL, metrics, train_here
from titanlike import trainer
from titanlike.data.shards import write_shard

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SEQ, LOCAL = 64, 4  # SMALL's
VALIDATING = (*SMALL[:-2], "--validation.freq", "1")  # SMALL with validation on, at every step


class Reads:
    """Wraps the trainer's validation_batches: counts each evaluation's micro-batches, fails at once on a
    read past the held-out windows (rather than going on forever), and runs `then(reads)` after each."""

    def __init__(self, monkeypatch, then=lambda reads: None):
        self.evaluations: list[int] = []
        real = trainer.validation_batches

        def counted(dataset, local, rank, world, micro_batches):
            self.evaluations.append(0)
            for batch in real(dataset, local, rank, world, micro_batches):
                self.evaluations[-1] += 1
                assert self.evaluations[-1] * local * world <= len(dataset), "validation read past its windows"
                then(self)
                yield batch

        monkeypatch.setattr(trainer, "validation_batches", counted)


def test_validation_steps_past_the_held_out_data_read_it_once(tmp_path, corpus, monkeypatch):
    windows = 10
    val = tmp_path / "val.bin"
    write_shard(val, np.arange(windows * SEQ + 1) % 250)
    whole = windows // LOCAL  # global batches the set holds (one rank: a global batch is a micro-batch)
    reads = Reads(monkeypatch)
    dump = tmp_path / "run"
    proc = train_here(dump, *VALIDATING, "--training.steps", "2", "--validation.steps", "1000000000000000000",
                      "--data.path", corpus[0], "--data.val_path", str(val))
    assert reads.evaluations == [whole, whole]  # at steps 1 and 2, each the whole set once
    line = (f"validation.steps = 1,000,000,000,000,000,000 is more than the held-out data holds ({windows} windows, "
            f"{whole} global batch(es) of {LOCAL}): each evaluation reads the whole held-out set once instead "
            f"(validation.steps = 0 says so)")
    assert proc.stderr.count(line) == 1
    assert [r["step"] for r in metrics(dump, "val")] == [1, 2]


def test_a_stop_during_validation_ends_it_and_the_run_saves(tmp_path, corpus, monkeypatch):
    """SIGTERM while validation reads (here a long one): it stops within a global batch, logs nothing,
    and the run stops after its next step with a checkpoint, as any preemption."""
    asked, signalled_at = 50, 3

    def preempt(reads):
        if len(reads.evaluations) == 2 and reads.evaluations[-1] == signalled_at:  # the validation of step 2
            os.kill(os.getpid(), signal.SIGTERM)

    reads = Reads(monkeypatch, then=preempt)
    dump = tmp_path / "run"
    proc = train_here(dump, *VALIDATING, "--training.steps", "10", "--validation.steps", str(asked),
                      "--data.path", corpus[0], "--data.val_path", corpus[1])
    # Step 2's validation gave way before the forward of the batch it was signalled at (the check comes
    # before each global batch's); step 3's, with the stop agreed, before its first.
    assert reads.evaluations[0] == asked and reads.evaluations[1] == signalled_at, reads.evaluations
    assert len(reads.evaluations) == 3 and reads.evaluations[2] == 1
    assert [r["step"] for r in metrics(dump, "val")] == [1]
    assert metrics(dump)[-1]["step"] == 3
    last = proc.stderr.rstrip().splitlines()[-1]
    assert last.endswith(f"preempted: stopped after step 3; checkpoint at {dump / 'checkpoint' / 'step-3'}; run the "
                         f"same command to resume"), last
    assert (dump / "checkpoint" / "step-3").is_dir()


def test_validation_steps_never_past_the_set():
    from titanlike.data.loader import validation_clamp_line, validation_steps

    assert [validation_steps(10, 4, steps) for steps in (1, 2, 3, 0)] == [1, 2, 2, 2]
    # A set smaller than one global batch is read as one (wrapping around it), never as none.
    assert validation_steps(3, 4, 5) == validation_steps(3, 4, 0) == 1
    # 0 asks for all of it, and a count the sets hold is read as it is: nothing to say.
    assert validation_clamp_line({"web": 10, "code": 40}, 4, 0, named=True) is None
    assert validation_clamp_line({"web": 10, "code": 40}, 4, 2, named=True) is None
    assert validation_clamp_line({"web": 10, "code": 40}, 4, 3, named=True) == (
        "validation.steps = 3 is more than the held-out data holds (web: 10 windows, 2 global batch(es) of 4): each "
        "evaluation reads each of these once instead (validation.steps = 0 says so)")
