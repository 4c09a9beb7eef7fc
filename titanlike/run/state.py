"""The run's counters: how far training got, in steps, tokens and data. The trainer advances them; a
checkpoint saves and restores them (as the state `train_state`), and the components that need the
step (float8's schedule, the non-finite guard) read them here."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0
    data_offset: int = 0
    """Global batches the data is ahead of `step`: those rollbacks did not replay."""
    skipped_steps: int = 0
    """Updates skipped for a non-finite gradient (training.nonfinite = skip)."""

    @property
    def batches_read(self) -> int:
        """Global batches read so far (a rollback leaves the data where it was)."""
        return self.step + self.data_offset

    def state_dict(self) -> dict[str, int]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for f in fields(self):  # a field a checkpoint predates keeps its default
            setattr(self, f.name, int(state.get(f.name, f.default)))
