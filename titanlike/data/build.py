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
from typing import Any, cast

import numpy as np

from titanlike.config.sources import SINGLE, DataSchedule
from titanlike.config.stages import Stage, Stages
from titanlike.data.loader import (
    GlobalBatchSampler,
    MixedWindows,
    TokenWindows,
    TrainLoader,
    open_dataset,
    resolve_paths,
)
from titanlike.data.mixture import MixturePlan
from titanlike.data.shards import DataError


@dataclass
class Segment:
    """The stages of one seq_len in a row (config/stages.py): the sources' windows at that length, the
    sample plan over them, and what each source had been read before the segment."""

    seq_len: int
    train: list[TokenWindows]
    val: dict[str, TokenWindows]
    """Each source's held-out windows (sources without a val/ split are left out)."""
    plan: MixturePlan
    tokens_before: np.ndarray
    """Tokens read from each source in earlier segments."""


@dataclass
class RunData:
    names: list[str]
    """The sources, in the plan's order."""
    segments: list[Segment]
    segment_of_stage: list[int]
    loader: TrainLoader
    mixed: bool
    """Named by data.mix (or a schedule): validation reports each source and their weighted total."""

    @property
    def plan(self) -> MixturePlan:
        """The first segment's sample plan (the only one without stages)."""
        return self.segments[0].plan

    def _here(self) -> tuple[Segment, int]:
        """The segment of the next global batch, and the plan position of its first sample."""
        return (self.segments[self.segment_of_stage[self.loader.stage]],
                self.loader.sampler.position(self.loader.batches_read))

    @property
    def train(self) -> list[TokenWindows]:
        return self._here()[0].train

    @property
    def val(self) -> dict[str, TokenWindows]:
        """Held-out windows at the seq_len of the last batch read (the model's, at a validation after it)."""
        last = max(0, self.loader.batches_read - 1)
        stage = max(i for i, (_, s) in enumerate(self.loader.parts) if s.first_batch <= last)
        return self.segments[self.segment_of_stage[stage]].val

    def read_by_source(self) -> dict[str, dict]:
        """Tokens read from each source so far (inputs: seq_len a window) and the epochs that makes (in
        windows of the current length)."""
        segment, position = self._here()
        uses = segment.plan.uses_before(position)
        tokens = segment.tokens_before + (uses - segment.plan.before[0]) * segment.seq_len
        return {"tokens_by_source": {n: int(t) for n, t in zip(self.names, tokens)},
                "epochs_by_source": {n: round(int(u) / len(t), 4) for n, u, t in zip(self.names, uses, segment.train)}}

    def next_sources(self) -> np.ndarray:
        """The source (index into `names`) of each sample of the micro-batch the loader hands out next."""
        plan = cast("MixturePlan", self.loader.sampler.plan)  # only a mixture's trainer asks
        return plan.sources_and_uses(self.loader.next_positions())[0]

    def val_weights(self) -> dict[str, float]:
        """The weights of validation's total: the current phase's shares of the sources that have
        validation data, normalised (equal, if the phase reads none of them)."""
        segment, position = self._here()
        shares = dict(zip(self.names, segment.plan.phase_weights(position).tolist()))
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


@dataclass(frozen=True)
class DataSpec:
    """What the run's data is built from: the config's [data] and what the resolved run made of it, and
    where this rank reads."""

    data: Any
    """The config's [data] section (paths, num_workers, val_path)."""
    schedule: DataSchedule
    """Its sources and phases, as the resolved run parsed them."""
    stages: Stages
    """The run's stages (config/stages.py): each one's seq_len and batch."""
    vocab_size: int
    """The model's vocabulary: every token id is checked against it."""
    seed: int
    """job.seed: the sample order."""
    dp_rank: int = 0
    """This rank's data-parallel rank (the cp ranks of a group read the same samples)."""
    dp_world: int = 1
    validation: bool = True
    """Open each source's held-out windows."""
    tokenizer: tuple[int, str] | None = None
    """(its ids, its dataset.json), when the data has one (loader.open_dataset checks every window)."""
    pin_memory: bool = False

    @classmethod
    def of_run(cls, run: Any, dp_rank: int, pin_memory: bool) -> DataSpec:
        """From the resolved run (config/run.py ResolvedRun) at this rank."""
        cfg, dataset = run.cfg, run.model.dataset
        return cls(cfg.data, run.schedule, run.stages, run.model.args.vocab_size, cfg.job.seed, dp_rank,
                   run.dims.dp, cfg.validation.enable, (dataset.vocab_size, dataset.path) if dataset else None,
                   pin_memory)


def _positions(stages: list[Stage]) -> list[int]:
    """Each stage's first plan position within its segment (stages of one seq_len read one plan on)."""
    out: list[int] = []
    for i, st in enumerate(stages):
        same = i > 0 and stages[i - 1].seq_len == st.seq_len
        out.append(out[-1] + (st.first_batch - stages[i - 1].first_batch) * stages[i - 1].global_batch if same else 0)
    return out


def build_run_data(spec: DataSpec) -> RunData:
    """The sources' windows at each stage's seq_len, the sample plans and the loader over them."""
    sources, data = spec.schedule.sources, spec.data
    builder = _SegmentBuilder(spec)
    staged, first_position = list(spec.stages.stages), _positions(list(spec.stages.stages))
    segments: list[Segment] = []
    segment_of_stage: list[int] = []
    parts = []
    for k, st in enumerate(staged):
        end = staged[k + 1].first_batch if k + 1 < len(staged) else None
        if k == 0 or staged[k - 1].seq_len != st.seq_len:  # a new slicing of the token streams
            last = k
            while last + 1 < len(staged) and staged[last + 1].seq_len == st.seq_len:
                last += 1
            segments.append(builder.segment(st.seq_len, [(staged[j], first_position[j]) for j in range(k, last + 1)],
                                            staged[last + 1].first_batch if last + 1 < len(staged) else None,
                                            segments[-1] if segments else None,
                                            _end_position(staged, first_position, k)))
        segment_of_stage.append(len(segments) - 1)
        segment = segments[-1]
        dataset = MixedWindows(segment.train) if len(segment.train) > 1 else segment.train[0]
        sampler = GlobalBatchSampler(segment.plan, st.local_batch, st.global_batch, spec.dp_rank, spec.dp_world,
                                     first_batch=st.first_batch, first_position=first_position[k], end_batch=end)
        if len(dataset) < st.global_batch:
            where = "data.seq_len" if k == 0 else f"the stage from step {st.start_step}'s seq_len {st.seq_len}"
            raise DataError(
                f"the training data has {len(dataset)} samples of {where} + 1 tokens, fewer than one global batch "
                f"of {st.global_batch}; use more data, a shorter seq_len or a smaller batch")
        parts.append((dataset, sampler))
    loader = TrainLoader(*parts[0], data.num_workers, spec.pin_memory, later=parts[1:])
    return RunData([s.name for s in sources], segments, segment_of_stage, loader, spec.schedule.mixed)


def _end_position(stages: list[Stage], first_position: list[int], k: int) -> int | None:
    """The plan position where the segment before stage k ended (None for the first stage)."""
    if k == 0:
        return None
    prev = stages[k - 1]
    return first_position[k - 1] + (stages[k].first_batch - prev.first_batch) * prev.global_batch


class _SegmentBuilder:
    """Where each source's splits are, and the mixtures by first batch: the same for every segment."""

    def __init__(self, spec: DataSpec):
        self.spec = spec
        data, schedule = spec.data, spec.schedule
        if schedule.mixed:
            # data.path in a schedule validates on data.val_path, as without one; a mixture's sources on their val/.
            self.splits = [(s.splits()[0], data.val_path) if s.name == SINGLE and not data.mix else s.splits()
                           for s in schedule.sources]
            self.what = [f"data source {s.name}" for s in schedule.sources]
        else:  # data.path as it always was: the embedded corpus when empty, data.val_path for validation
            self.splits, self.what = [resolve_paths(data.path, data.val_path)], ["data.path"]
        index = {s.name: i for i, s in enumerate(schedule.sources)}
        self.mixes = [(p.start_step - 1, {index[s.name]: s.weight for s in p.sources}) for p in schedule.phases]

    def segment(self, seq_len: int, stages: list[tuple[Stage, int]], end_batch: int | None,
                before: Segment | None, before_end: int | None) -> Segment:
        """The windows and plan of one seq_len's stages (with their first plan positions), which read the
        global batches up to `end_batch`. The mixtures are placed at their plan positions; a source goes
        on, in windows of the new length, from the tokens read of it before (`before`, which ended at
        plan position `before_end`)."""
        spec, sources, mixed = self.spec, self.spec.schedule.sources, self.spec.schedule.mixed
        train = [open_dataset(path, seq_len, spec.vocab_size, w, spec.tokenizer)
                 for (path, _), w in zip(self.splits, self.what)]
        val = {s.name: open_dataset(v, seq_len, spec.vocab_size, f"{w} (its val/ split)" if mixed else "data.val_path",
                                    spec.tokenizer)
               for s, (_, v), w in zip(sources, self.splits, self.what) if v and spec.validation}
        first_batch = stages[0][0].first_batch
        phases = []
        for batch, weights in self.mixes:
            if batch <= first_batch:  # the mixture in force when the segment begins
                phases = [(0, weights)]
            elif end_batch is None or batch < end_batch:
                st, position = next((st, p) for st, p in stages[::-1] if st.first_batch <= batch)
                phases.append((position + (batch - st.first_batch) * st.global_batch, weights))
        n = len(train)
        if before is None:
            tokens_before, start_uses = np.zeros(n, dtype=np.int64), None
        else:
            assert before_end is not None
            uses = before.plan.uses_before(before_end)
            tokens_before = before.tokens_before + (uses - before.plan.before[0]) * before.seq_len
            start_uses = (tokens_before // seq_len).tolist()
        plan = MixturePlan([len(t) for t in train], phases, spec.seed, [s.salt for s in sources],
                           start_uses=start_uses)
        return Segment(seq_len, train, val, plan, tokens_before)
