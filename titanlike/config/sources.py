"""What a run trains on, as [data] names it: one source (`data.path`) or a weighted mixture of
prepared datasets (`data.mix`), and the mixture that applies from each step on (phases).

Plain parsing (no numpy, no torch): the schema validates these strings with it, the resolved run
(run.py) parses them once into a `DataSchedule`, and data/ builds its windows and sample plan from
that. Which window each sample position reads is data/mixture.py's; this module only says what the
sources and phases are.

A mixture is spelled `NAME=FOLDER:WEIGHT,NAME=FOLDER:WEIGHT`, e.g. `web=data/web:0.7,code=data/code:0.3`:
FOLDER is what `titanlike-prepare` wrote (dataset.json, train/, val/), or its train/ folder.
"""

from __future__ import annotations

import functools
import math
import os
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

SINGLE = "data"
"""The name of `data.path`'s one source (in tokens_by_source and the like)."""
MIN_SHARE = 1e-6
"""The smallest share of a source in a mixture: below it a block of positions (mixture.py) would
have to be longer than 2^20 to give the source one slot."""
_NAME = re.compile(r"[A-Za-z0-9_.-]+\Z")  # names become metrics keys and TensorBoard tags


@dataclass(frozen=True)
class Source:
    name: str
    path: str
    """A prepared dataset's folder (or its train/ folder, or a shard file for data.path)."""
    weight: float
    """As given; mixture.py normalises the weights of a phase."""

    @property
    def salt(self) -> int:
        """Keys this source's epoch orders apart from other sources' (0 for data.path's source, whose
        order is then the one a run without a mixture always had)."""
        return 0 if self.name == SINGLE else zlib.crc32(self.name.encode())

    def splits(self, val_path: str = "") -> tuple[str, str]:
        """(training shards, validation shards or ""): a prepared folder's train/ and val/, or a train/
        folder and the val/ beside it (val/ when it holds shards; `val_path` first, if given)."""
        def shards_in(folder: str) -> bool:
            return os.path.isdir(folder) and any(n.endswith(".bin") for n in os.listdir(folder))

        path = os.path.normpath(self.path)
        if os.path.isdir(os.path.join(path, "train")):
            path = os.path.join(path, "train")
        val = os.path.join(os.path.dirname(path), "val")
        found = val if os.path.basename(path) == "train" and shards_in(val) else ""
        return path, val_path or found


@dataclass(frozen=True)
class Phase:
    start_step: int
    """The first optimizer step (numbered from 1, as the logs number them) that reads this mixture."""
    sources: tuple[Source, ...]
    option: str = "data.mix"
    """The option that names it, for messages."""


def parse_mix(text: str) -> list[Source]:
    """The sources of a mix string; a ValueError with the first problem, as one phrase. Parsed once per
    process for each text: the config checks, the resolved run and the preflight all ask."""
    return list(_parsed_mix(text))


@functools.lru_cache(maxsize=32)
def _parsed_mix(text: str) -> tuple[Source, ...]:
    return tuple(_parse_mix_text(text))


def _parse_mix_text(text: str) -> list[Source]:
    if not text.strip():
        raise ValueError("names no source")
    sources: list[Source] = []
    for item in (t.strip() for t in text.split(",")):
        name, eq, rest = item.partition("=")
        path, colon, weight_text = rest.rpartition(":")
        name, path, weight_text = name.strip(), path.strip(), weight_text.strip()
        if not eq or not colon:
            raise ValueError(f"{item!r} is not NAME=FOLDER:WEIGHT")
        if not _NAME.match(name):
            raise ValueError(f"source name {name!r} must be letters, digits, '_', '.' or '-'")
        if not path:
            raise ValueError(f"source {name} names no folder")
        try:
            weight = float(weight_text)
        except ValueError:
            raise ValueError(f"source {name}'s weight {weight_text!r} is not a number") from None
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"source {name}'s weight {weight_text} must be a finite number > 0")
        if any(s.name == name for s in sources):
            raise ValueError(f"source name {name} appears twice")
        sources.append(Source(name, path, weight))
    total = sum(s.weight for s in sources)
    if not math.isfinite(total):
        raise ValueError(f"the weights add up to more than the largest number ({total}); they are relative: "
                         f"give them on a smaller scale (0.7 and 0.3 mean the same as 70 and 30)")
    small = min(sources, key=lambda s: s.weight)
    if small.weight / total < MIN_SHARE:
        raise ValueError(f"source {small.name}'s share {small.weight / total:.2g} is below {MIN_SHARE:g}: "
                         f"drop it or raise its weight")
    return sources


def problem(parse: Callable[[str], Any], text: str) -> str | None:
    """What `parse` (parse_mix, parse_phases) finds wrong with `text`, or None."""
    try:
        parse(text)
    except ValueError as e:
        return str(e)
    return None


def mix_from_tables(value: Any) -> str:
    """`[[data.mix]]` tables (name, path, weight) in TOML, as the mix string the option holds."""
    if not isinstance(value, list) or not value or not all(isinstance(t, dict) for t in value):
        raise ValueError("must be a mix string or [[data.mix]] tables with name, path and weight")
    items = []
    for t in value:
        keys = {"name", "path", "weight"}
        if set(t) != keys:
            missing, extra = sorted(keys - set(t)), sorted(set(t) - keys)
            said = ([f"lacks {', '.join(missing)}"] if missing else []) + ([f"has {', '.join(extra)}"] if extra else [])
            raise ValueError(f"a [[data.mix]] table has keys name, path and weight (this one {' and '.join(said)})")
        if not isinstance(t["name"], str) or not isinstance(t["path"], str):
            raise ValueError("a [[data.mix]] table's name and path are strings")
        if "," in t["path"]:
            raise ValueError(f"source {t['name']}'s path {t['path']!r} holds a comma, which the mix string cannot")
        if isinstance(t["weight"], bool) or not isinstance(t["weight"], (int, float)):
            raise ValueError(f"source {t['name']}'s weight {t['weight']!r} is not a number")
        items.append(f"{t['name']}={t['path']}:{t['weight']!r}")
    return ",".join(items)


STAGE_KEYS = ("seq_len", "rope_theta", "local_batch_size", "global_batch_size")
"""What a phase may change beside the mixture, from its step on (a stage: config/stages.py): data.seq_len,
model.rope_theta, training.local_batch_size and training.global_batch_size."""


@dataclass(frozen=True)
class PhaseItem:
    """One item of data.phase as written: its step, its mixture (None: the one before goes on) and the
    stage settings it changes (a subset of STAGE_KEYS)."""

    step: int
    sources: tuple[Source, ...] | None
    settings: tuple[tuple[str, float], ...] = ()


def _setting(part: str) -> tuple[str, float] | None:
    """`key=value` for a key of STAGE_KEYS, else None (a mixture's NAME=FOLDER:WEIGHT has a colon)."""
    key, eq, value = part.partition("=")
    if not eq or ":" in part or key.strip() not in STAGE_KEYS:
        return None
    key, value = key.strip(), value.strip()
    try:
        number = float(value) if key == "rope_theta" else int(value)
    except ValueError:
        raise ValueError(f"{key} = {value!r} is not a{' number' if key == 'rope_theta' else ' whole number'}") \
            from None
    return key, number


def parse_phase_items(text: str) -> list[PhaseItem]:
    """The items of a data.phase string, "STEP:MIX;STEP:MIX", where an item may also (or only) change
    stage settings: "STEP:MIX,seq_len=32768,rope_theta=2e6" or "STEP:seq_len=32768". A ValueError with
    the first problem. Parsed once per process for each text."""
    return list(_parsed_phase_items(text))


@functools.lru_cache(maxsize=32)
def _parsed_phase_items(text: str) -> tuple[PhaseItem, ...]:
    out: list[PhaseItem] = []
    for item in (t.strip() for t in text.split(";")):
        step_text, colon, rest = item.partition(":")
        if not colon:
            raise ValueError(f"{item!r} is not STEP:MIX")
        try:
            step = int(step_text.strip())
        except ValueError:
            raise ValueError(f"phase step {step_text.strip()!r} is not a whole number") from None
        try:
            parts = [p.strip() for p in rest.split(",")]
            settings = [s for s in map(_setting, parts) if s is not None]
            mix = ",".join(p for p in parts if _setting(p) is None)
            keys = [k for k, _ in settings]
            if len(set(keys)) < len(keys):
                raise ValueError(f"{next(k for k in keys if keys.count(k) > 1)} is given twice")
            if not settings or mix:
                out.append(PhaseItem(step, tuple(parse_mix(mix)), tuple(settings)))
            else:
                out.append(PhaseItem(step, None, tuple(settings)))
        except ValueError as e:
            raise ValueError(f"the phase from step {step}: {e}") from None
    steps = [p.step for p in out]
    if steps != sorted(set(steps)):
        raise ValueError(f"phase steps {', '.join(map(str, steps))} must increase")
    return tuple(out)


def parse_phases(text: str) -> list[tuple[int, list[Source]]]:
    """The mixtures of a data.phase string (its items that name one), as (step, sources); a ValueError
    with the first problem of any item."""
    return [(p.step, list(p.sources)) for p in parse_phase_items(text) if p.sources is not None]


def phases_from_tables(value: Any) -> str:
    """`[[data.phase]]` tables in TOML (from_step; mix: a mix string or [[data.phase.mix]] tables; and any
    of STAGE_KEYS), as the phase string the option holds."""
    if not isinstance(value, list) or not value or not all(isinstance(t, dict) for t in value):
        raise ValueError("must be a phase string or [[data.phase]] tables with from_step and mix")
    items = []
    allowed = {"from_step", "mix", *STAGE_KEYS}
    for t in value:
        if "from_step" not in t or not set(t) - {"from_step"} or set(t) - allowed:
            raise ValueError(f"a [[data.phase]] table has keys from_step and mix (not {', '.join(sorted(t))}), "
                             f"and may set {', '.join(STAGE_KEYS)} (a stage, with or without mix)")
        if isinstance(t["from_step"], bool) or not isinstance(t["from_step"], int):
            raise ValueError(f"a [[data.phase]] table's from_step {t['from_step']!r} is not a whole number")
        parts = []
        if "mix" in t:
            parts.append(t["mix"] if isinstance(t["mix"], str) else mix_from_tables(t["mix"]))
        for key in STAGE_KEYS:
            if key in t:
                v = t[key]
                number = (float, int) if key == "rope_theta" else (int,)
                if isinstance(v, bool) or not isinstance(v, number):
                    raise ValueError(f"a [[data.phase]] table's {key} {v!r} is not a "
                                     f"{'number' if key == 'rope_theta' else 'whole number'}")
                parts.append(f"{key}={v!r}")
        items.append(f"{t['from_step']}:{','.join(parts)}")
    return ";".join(items)


class DataStrings(Protocol):
    """What the schedule reads of the [data] section (schema.py's Data, which imports this module)."""

    path: str
    mix: str
    anneal_mix: str
    anneal_from_step: int
    phase: str


def builtin_corpus(data: DataStrings) -> bool:
    """Whether [data] (`data`) names no data at all: neither data.path nor data.mix, so the run reads
    the embedded corpus (byte tokens, no dataset.json)."""
    return not data.path and not data.mix


@dataclass(frozen=True)
class DataSchedule:
    """The [data] strings parsed once: the run's mixtures in step order and what kind of data they name."""

    phases: tuple[Phase, ...]
    """data.mix or data.path from step 1, then data.anneal_mix from data.anneal_from_step, or each of data.phase."""
    mixed: bool
    """Named by data.mix or by phases: sources read from prepared folders, validated one by one."""
    builtin_corpus: bool
    """Neither data.path nor data.mix: the embedded corpus."""
    stage_changes: tuple[tuple[int, dict[str, float]], ...] = ()
    """(first step, the STAGE_KEYS it sets) of each data.phase item that changes stage settings: the
    resolved run makes them stages (config/stages.py)."""

    @property
    def sources(self) -> tuple[Source, ...]:
        """Every source of every phase, once each (by name), in order of appearance."""
        out: dict[str, Source] = {}
        for phase in self.phases:
            for s in phase.sources:
                out.setdefault(s.name, s)
        return tuple(out.values())

    def name_conflict(self) -> str | None:
        """A source name that two phases give different folders, as a problem line (a source is one
        dataset across the schedule: it goes on where it stopped)."""
        seen: dict[str, tuple[str, str]] = {}
        for phase in self.phases:
            for s in phase.sources:
                path, option = seen.setdefault(s.name, (s.path, phase.option))
                if path != s.path:
                    return (f"data source {s.name} is {path!r} in {option} but {s.path!r} in {phase.option}: a name "
                            f"is one dataset over the whole schedule (name the other one differently)")
        return None

    def describe(self) -> str:
        """The schedule in one line, as a resume compares it with the checkpoint's: each phase's first step,
        sources and weights (not the folders, which a user may move)."""
        return "; ".join(f"from step {p.start_step}: " + ", ".join(f"{s.name} {s.weight:g}" for s in p.sources)
                         for p in self.phases)


def schedule_of(data: DataStrings) -> DataSchedule:
    """The schedule that [data] (`data`) names; a ValueError for a string the schema would refuse."""
    first = tuple(parse_mix(data.mix)) if data.mix else (Source(SINGLE, data.path, 1.0),)
    phases = [Phase(1, first, "data.mix" if data.mix else "data.path")]
    if data.anneal_mix:
        phases.append(Phase(data.anneal_from_step, tuple(parse_mix(data.anneal_mix)), "data.anneal_from_step"))
    items = parse_phase_items(data.phase) if data.phase and not data.anneal_mix else []
    phases += [Phase(p.step, p.sources, "data.phase") for p in items if p.sources is not None]
    stages = tuple((p.step, dict(p.settings)) for p in items if p.settings)
    return DataSchedule(tuple(phases), mixed=bool(data.mix) or len(phases) > 1, builtin_corpus=builtin_corpus(data),
                        stage_changes=stages)
