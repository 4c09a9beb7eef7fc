"""What a non-finite loss or gradient norm does (training.nonfinite), decided in one place.

The trainer hands in the losses and gradient norms of the steps since its last check, already
reduced over ranks (so every rank reaches the same verdict), and gets a Verdict back:

  ok        every value finite: training goes on;
  skipped   (training.nonfinite = skip) some steps' updates were skipped on the device
            (optim.clip_and_step): counted, and training goes on;
  rollback  (training.nonfinite = rollback) reload the checkpoint of step `rollback_to`;
  abort     raised as NonFiniteLoss, one line naming the step and what to change.

Skipping stops once MAX_IN_A_ROW consecutive steps had their update skipped (the weights
themselves have diverged: skipping more batches cannot help); rolling back stops once it has
rolled back MAX_IN_A_ROW times to the same checkpoint and meets a non-finite value again.

`NonFiniteGuard` gives the verdict; the trainer, which owns the checkpoint and the counters, carries
it out: it counts skipped updates, and a rollback reloads the checkpoint (weights, optimizer,
schedule, step) while the data reads on, so the batches read since that checkpoint, the offending
one among them, are never replayed. The trainer asks before it logs or saves a step, so the
weights of a diverged run are never saved.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from titanlike.errors import UserError

logger = logging.getLogger("titanlike")

MAX_IN_A_ROW = 3

ADVICE = "lower --optimizer.lr, raise --lr_scheduler.warmup_steps or check --training.max_norm"


class NonFiniteLoss(UserError):
    # Decided on the all-reduced loss and gradient norm, so every rank stops with the same words.
    same_on_all_ranks = True


@dataclass(frozen=True)
class Verdict:
    loss: float | None = None
    """The last step's loss, when training goes on as it was (ok or skipped); None with a rollback."""
    skipped: int = 0
    """Updates skipped among the steps checked (training.nonfinite = skip)."""
    rollback_to: int | None = None
    """The checkpoint step to reload (training.nonfinite = rollback)."""
    cause: tuple[int, str, float] | None = None
    """(step, "loss" or "gradient norm", value) of the first non-finite value, for a rollback's log."""
    in_a_row: int = 0
    """With a rollback: how many times in a row it went back to this checkpoint, this one included."""
    not_replayed: int = 0
    """With a rollback carried out: the batches read since that checkpoint, which are not read again."""

    @property
    def bad_step(self) -> int:
        """The step of the first non-finite value (a verdict that names a cause)."""
        assert self.cause is not None, "only a rollback verdict names a step"
        return self.cause[0]

    def rollback_record(self) -> dict:
        """The metrics record of a rollback (kind "rollback")."""
        return {"to_step": self.rollback_to, "not_replayed": self.not_replayed, "in_a_row": self.in_a_row}

    @property
    def kind(self) -> str:
        return "rollback" if self.rollback_to is not None else "skipped" if self.skipped else "ok"


class NonFinitePolicy:
    """training.nonfinite, with the counts it keeps between checks.

    `checkpoints()` lists the steps of the complete checkpoints a rollback may go back to (called
    only when one is needed; the trainer lets a background save land first); `step_dir(step)` names
    one in messages."""

    def __init__(self, mode: str, checkpoints: Callable[[], list[int]], step_dir: Callable[[int], str],
                 is_main: bool = True):
        self.mode = mode
        self.checkpoints = checkpoints
        self.step_dir = step_dir
        self.is_main = is_main
        self.skips_in_a_row = 0
        self._rollbacks = (-1, 0)  # (checkpoint step last rolled back to, times in a row)

    def judge(self, rows: Sequence[Sequence[float]], first_step: int, skipped_so_far: int = 0) -> Verdict:
        """`rows`: (loss, gradient norm, update skipped on the device: 0 or 1) of steps `first_step`,
        `first_step` + 1, ...; `skipped_so_far`: updates skipped before these (for the log).
        Raises NonFiniteLoss to abort."""
        skipped = 0
        for i, (loss, grad_norm, skipped_on_device) in enumerate(rows):
            bad = [(what, v) for what, v in (("loss", loss), ("gradient norm", grad_norm)) if not math.isfinite(v)]
            if not bad:
                self.skips_in_a_row = 0
                continue
            (what, value), step = bad[0], first_step + i
            if self.mode == "rollback":
                return self._rollback(step, what, value)
            if self.mode == "skip" and skipped_on_device > 0:
                skipped += 1
                self.skips_in_a_row += 1
                if self.skips_in_a_row >= MAX_IN_A_ROW:
                    raise NonFiniteLoss(
                        f"{what} became {value} at step {step}: {self.skips_in_a_row} steps in a row had their "
                        f"update skipped (training.nonfinite = skip), so the weights themselves have diverged; {ADVICE}"
                    )
                if self.is_main:
                    logger.warning(f"step {step}: {what} became {value}; update skipped (training.nonfinite = skip, "
                                   f"{skipped_so_far + skipped} skipped so far)")
                continue
            raise NonFiniteLoss(
                f"{what} became {value} at step {step}; {ADVICE} (last checkpoint kept; --training.nonfinite "
                f"skip or rollback would go on past such steps)"
            )
        return Verdict(loss=rows[-1][0], skipped=skipped)

    def _rollback(self, step: int, what: str, value: float) -> Verdict:
        """The newest checkpoint before `step`, unless there is none or it has failed too often."""
        earlier = [s for s in self.checkpoints() if s < step]
        if not earlier:
            raise NonFiniteLoss(
                f"{what} became {value} at step {step}, before the first checkpoint: nothing to roll back to "
                f"(training.nonfinite = rollback); {ADVICE}, or save sooner with --checkpoint.interval"
            )
        target = earlier[-1]
        times = self._rollbacks[1] + 1 if self._rollbacks[0] == target else 1
        if times > MAX_IN_A_ROW:
            raise NonFiniteLoss(
                f"{what} became {value} at step {step} after {times - 1} rollbacks in a row to "
                f"{self.step_dir(target)} (training.nonfinite = rollback): other data does not help; {ADVICE}"
            )
        self._rollbacks = (target, times)
        self.skips_in_a_row = 0
        return Verdict(rollback_to=target, cause=(step, what, value), in_a_row=times)


class Counters(Protocol):
    """The run's counters as the guard reads them (run/state.py)."""

    @property
    def step(self) -> int: ...
    @property
    def skipped_steps(self) -> int: ...
    @property
    def data_offset(self) -> int: ...


class NonFiniteGuard:
    """training.nonfinite over the run: judges the steps since the last check and says what to do. It
    changes nothing of the run itself: whoever owns the checkpoint and the counters carries a verdict
    out (the trainer: a rollback restores the checkpoint and leaves the data where it is), then tells
    the guard (`rolled_back`) for the line that says so."""

    def __init__(self, mode: str, *, complete_steps: Callable[[], list[int]], step_dir: Callable[[int], str],
                 counters: Counters, is_main: bool = True):
        """`complete_steps()`: the checkpoints a rollback may go back to; `step_dir(step)`: one's folder,
        for messages; `counters`: the run's (read only)."""
        self.mode, self.counters, self.is_main = mode, counters, is_main
        self.policy = NonFinitePolicy(mode, complete_steps, step_dir, is_main=is_main)

    def check(self, rows: Sequence[Sequence[float]]) -> Verdict:
        """`rows`: (loss, gradient norm, skipped) of the steps since the last check, ending at the
        counters' step, reduced over ranks. Raises NonFiniteLoss to abort."""
        c = self.counters
        return self.policy.judge(rows, c.step - len(rows) + 1, c.skipped_steps)

    def rolled_back(self, verdict: Verdict, where: str, batches_read: int) -> Verdict:
        """A rollback verdict, carried out: the checkpoint `where` was reloaded while the data had read
        `batches_read` global batches, which it goes on from. Says so; returns the verdict with the
        batches not replayed."""
        assert verdict.rollback_to is not None and verdict.cause is not None, "a rollback verdict"
        target, (step, what, value) = verdict.rollback_to, verdict.cause
        if self.is_main:
            logger.warning(
                f"{what} became {value} at step {step}: rolled back to {where} ({verdict.in_a_row} of at most "
                f"{MAX_IN_A_ROW} in a row); training goes on with batch {batches_read + 1}: the "
                f"{batches_read - target} batches read since step {target} are not replayed")
        return replace(verdict, not_replayed=batches_read - target)

    def counts(self) -> dict:
        """For the log record: updates skipped, or batches left behind by rollbacks, so far."""
        if self.mode == "skip":
            return {"skipped_steps": self.counters.skipped_steps}
        return {"batches_skipped": self.counters.data_offset} if self.mode == "rollback" else {}
