"""The run's data as the trainer uses it, built from the [data] section and its sources and phases as
the resolved run parsed them (config/sources.py): each source's training and validation windows, the
sample plan over the phases (mixture.py), the loader, and what has been read from each source so far
(for the metrics).

`data.path` alone is one source, named "data" (config.sources.SINGLE), and reads exactly the plain epoch
order; `data.mix` names several. Either way the loader's position is the global batches read, and
everything here is a function of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from titanlike.config.sources import SINGLE, DataSchedule
from titanlike.data.loader import (
    MixedWindows,
    TokenWindows,
    TrainLoader,
    build_train_loader,
    open_dataset,
    resolve_paths,
)
from titanlike.data.mixture import MixturePlan


@dataclass
class RunData:
    names: list[str]
    """The sources, in the plan's order."""
    train: list[TokenWindows]
    val: dict[str, TokenWindows]
    """Each source's held-out windows (sources without a val/ split are left out)."""
    plan: MixturePlan
    loader: TrainLoader
    global_batch: int
    seq_len: int
    mixed: bool
    """Named by data.mix (or a schedule): validation reports each source and their weighted total."""

    def _position(self) -> int:
        return self.loader.batches_read * self.global_batch

    def read_by_source(self) -> dict[str, dict]:
        """Tokens read from each source so far (inputs: seq_len a window) and the epochs that makes."""
        uses = self.plan.uses_before(self._position())
        return {"tokens_by_source": {n: int(u) * self.seq_len for n, u in zip(self.names, uses)},
                "epochs_by_source": {n: round(int(u) / len(t), 4) for n, u, t in zip(self.names, uses, self.train)}}

    def next_sources(self) -> np.ndarray:
        """The source (index into `names`) of each sample of the micro-batch the loader hands out next."""
        return self.plan.sources_and_uses(self.loader.next_positions())[0]

    def val_weights(self) -> dict[str, float]:
        """The weights of validation's total: the current phase's shares of the sources that have
        validation data, normalised (equal, if the phase reads none of them)."""
        shares = dict(zip(self.names, self.plan.phase_weights(self._position()).tolist()))
        total = sum(shares[n] for n in self.val)
        return {n: shares[n] / total if total else 1 / len(self.val) for n in self.val}

    def missing_validation(self) -> str | None:
        """With validation on but no held-out data anywhere: the line that says so (None otherwise)."""
        if self.val:
            return None
        where, fix = (("no source of the schedule has a val/ split", "prepare the sources with a val/ split")
                      if self.mixed else ("data.val_path is unset", "set --data.val_path"))
        return (f"validation: no held-out data ({where}): the run reports training loss only; {fix}, "
                f"or --validation.enable false to silence this")

    def val_total(self, losses: dict[str, float]) -> float:
        """Validation's total: each source's loss weighted by val_weights() (docs/data.md)."""
        return sum(w * losses[name] for name, w in self.val_weights().items())


def build_run_data(data: Any, schedule: DataSchedule, vocab_size: int, tokenizer: tuple[int, str] | None,
                   local_batch: int, global_batch: int, dp_rank: int, dp_world: int, seed: int, pin_memory: bool,
                   validation: bool) -> RunData:
    """`data`: the config's [data] section; `schedule`: its sources and phases, as the resolved run parsed
    them. `tokenizer`: (its ids, its dataset.json), when the data has one (loader.open_dataset checks every
    window against it)."""
    sources = schedule.sources
    mixed = schedule.mixed
    if mixed:
        # data.path in a schedule validates on data.val_path, as without one; a mixture's sources on their val/.
        splits = [(s.splits()[0], data.val_path) if s.name == SINGLE and not data.mix else s.splits()
                  for s in sources]
        what = [f"data source {s.name}" for s in sources]
    else:  # data.path as it always was: the embedded corpus when empty, data.val_path for validation
        splits, what = [resolve_paths(data.path, data.val_path)], ["data.path"]
    train = [open_dataset(path, data.seq_len, vocab_size, w, tokenizer) for (path, _), w in zip(splits, what)]
    val = {s.name: open_dataset(v, data.seq_len, vocab_size, f"{w} (its val/ split)" if mixed else "data.val_path",
                                tokenizer)
           for s, (_, v), w in zip(sources, splits, what) if v and validation}
    index = {s.name: i for i, s in enumerate(sources)}
    phases = [((p.start_step - 1) * global_batch, {index[s.name]: s.weight for s in p.sources})
              for p in schedule.phases]
    plan = MixturePlan([len(t) for t in train], phases, seed, [s.salt for s in sources])
    dataset = MixedWindows(train) if len(train) > 1 else train[0]
    loader = build_train_loader(dataset, local_batch, global_batch, dp_rank, dp_world, seed, data.num_workers,
                                pin_memory, plan)
    return RunData([s.name for s in sources], train, val, plan, loader, global_batch, data.seq_len, mixed)

