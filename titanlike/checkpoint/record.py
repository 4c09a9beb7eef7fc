"""What a checkpoint says of its run beside the states: the run record compared at a resume, what a
step ends with, and the trainer state file of an earlier layout read as today's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from titanlike.config.optimizer import UNRECORDED

TRAINER_STATE = "trainer_state.json"


@dataclass
class RunRecord:
    """What this run is, saved with every step and compared at a resume."""

    global_batch: int
    dp_world: int
    seed: int
    optimizer_state_dtype: str = "fp32"
    """8-bit moments cannot become fp32 ones, nor back."""
    optimizer: str = UNRECORDED
    """optimizer.name: one optimizer's state is not another's (a record without it is from before the name)."""
    settings: dict = field(default_factory=dict)
    """What a resume may change, by config name ("optimizer.lr": 3e-4, ...): each change is one line."""
    load_step: int = -1
    """The checkpoint.load_step this run's line of checkpoints began with (applied once: -1 when none)."""
    run_id: str = ""
    """Which run saved it: drawn when a run starts afresh (or branches from another run's step), kept in its
    dump folder (records/folder.py) and carried on by every resume of it."""
    dump_folder: str = ""
    """That run's dump folder (absolute), for the line that names a checkpoint's run."""

    def saved(self) -> dict:
        return {"global_batch": self.global_batch, "dp_world": self.dp_world, "seed": self.seed,
                "optimizer_state_dtype": self.optimizer_state_dtype, "optimizer": self.optimizer,
                "settings": self.settings,
                "load_step": self.load_step, "run_id": self.run_id, "dump_folder": self.dump_folder}


class Due(NamedTuple):
    """What a step ends with, the same on every rank."""

    save: bool
    """This step is saved: at the interval, at the last step, or on a stop request."""
    stop: int
    """The stop request all ranks agreed on (0: none, train on; run/stopping.py names the others)."""
    last: bool
    """The last step of training."""


def from_earlier_layout(record: dict, step: int, data_state_at: Callable[[int], dict]) -> dict:
    """trainer_state.json as titanlike wrote it before it saved each state under its own name: the data
    position was the counters' (`data_state_at(batches_read)`: the loader's state at it)."""
    ts = record.get("train_state", {})
    return {"states": {"train_state": ts, "lr_scheduler": {"steps_done": step},
                       "dataloader": data_state_at(step + int(ts.get("data_offset", 0)))},
            "run": {k: record.get(k) for k in ("global_batch", "dp_world", "settings")} | {
                "optimizer_state_dtype": record.get("optimizer_state_dtype", "fp32")},
            "preemption": record.get("preemption", False)}
