"""Distributed checkpoints you can trust: save, async save, exact resume, resharding, preemption.

Layout under the checkpoint folder:

    step-200/            a complete checkpoint (below)
    step-300.tmp/        a save in progress, or one a crash interrupted: never loaded, reported
    step-400.abandoned/  set aside: a resume from an earlier step (checkpoint.load_step) went another way
    step-500.damaged/    set aside: its files do not match its manifest

A step folder holds the DCP files (model, optimizer moments, float8 history: tensors only),
`model_args.json` (the model's shape), `trainer_state.json` (step, tokens, data position, the
settings it trained with), `rng-rank{R}.json` per rank, and `manifest.json` (checkpoint_manifest.py):
every file's size and CRC-32, written last by rank 0. A save writes into `step-N.tmp` and becomes `step-N` by one atomic
rename after every rank has written and the manifest is complete, so a `step-N` folder is always
whole; a load verifies the manifest first, and a damaged step is set aside for the newest intact one.

What is trusted (docs/checkpointing.md): DCP's `.metadata` is a Python pickle, and unpickling runs
code. The run's own checkpoint folder is trusted, as is a folder whose manifest this user's key
signed (titanlike wrote it here); a DCP folder from elsewhere loads only with
`--checkpoint.trust_pickled_dcp`. Everything else is JSON or tensors read with weights_only.

The data position is a number (global batches read): the loader seeks to it, so any world size
and any number of loader workers resume with the samples of the uninterrupted run (data.py).
"""

from __future__ import annotations

import base64
import datetime
import errno
import json
import logging
import os
import random
import re
import resource
import shutil
import time
import warnings
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Protocol, cast

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from titanlike.checkpoint_manifest import (  # noqa: F401 (check_trusted_dcp: re-exported)
    MANIFEST,
    UntrustedCheckpoint,
    check_trusted_dcp,
    describe_files,
    owner,
    read_manifest,
    verify_files,
    write_manifest,
)
from titanlike.checkpoint_staging import HostCopyStager
from titanlike.errors import UserError
from titanlike.optim import resume_schedule
from titanlike.run_folder import write_probe

logger = logging.getLogger("titanlike")
# DCP warns that a single-process save is single-process (its background thread ignores no_dist).
warnings.filterwarnings("ignore", message="torch.distributed is disabled")

STEP_DIR = re.compile(r"^step-(\d+)$")
TMP_DIR = re.compile(r"^step-(\d+)\.tmp$")
TRAINER_STATE = "trainer_state.json"
MODEL_ARGS = "model_args.json"
RNG_FILE = "rng-rank{}.json"


class CheckpointError(UserError):
    pass


class CheckpointMismatch(CheckpointError):
    """The checkpoint on disk does not fit this run; every rank reads the same files, rank 0 reports."""

    same_on_all_ranks = True


# ---- the pieces a checkpoint holds ------------------------------------------------------------


class Stateful(Protocol):
    """torch.distributed.checkpoint.stateful.Stateful: what the Checkpointer is handed."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0
    data_offset: int = 0  # global batches the data is ahead of `step`: those rollbacks did not replay
    skipped_steps: int = 0  # updates skipped for a non-finite gradient (training.nonfinite = skip)

    @property
    def batches_read(self) -> int:
        """The data position: global batches read so far (what the loader seeks to)."""
        return self.step + self.data_offset

    def state_dict(self) -> dict[str, int]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for f in fields(self):  # a field a checkpoint predates keeps its default
            setattr(self, f.name, int(state.get(f.name, f.default)))


class ModelState:
    """The model's parameters, sharded as they are (DCP reshards them on load)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, torch.Tensor]:
        return _plain_tensors(get_model_state_dict(self.model))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state)


class OptimizerState:
    """The optimizer's per-parameter tensors (AdamW moments and step counts). Its hyperparameters are
    not saved here: a resumed run uses the configured ones (trainer_state.json records the old)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        return {"state": get_optimizer_state_dict(self.model, self.optimizer)["state"]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        current = get_optimizer_state_dict(self.model, self.optimizer)  # param_groups: this run's config
        current["state"] = state["state"]
        set_optimizer_state_dict(self.model, self.optimizer, current)


@dataclass
class RunFacts:
    """What this run is, for the checks and the log at resume."""

    model_args: Any  # the model's shape (a ModelArgs; model_args.json)
    global_batch: int
    dp_world: int
    optimizer_state_dtype: str = "fp32"  # optimizer.state_dtype: 8-bit moments cannot become fp32 ones, nor back
    # The settings a resume may change, by their config names ("optimizer.lr": 3e-4, ...): each change
    # is logged in one line; the configured value applies.
    settings: dict = field(default_factory=dict)


def _plain_tensors(sd: dict) -> dict:
    """Float8 all-gather wraps weights in a tensor subclass; checkpoints hold plain tensors."""
    from torch.distributed.tensor import DTensor

    out = {}
    for k, v in sd.items():
        if isinstance(v, DTensor) and type(v._local_tensor) is not torch.Tensor and hasattr(v._local_tensor, "_tensor"):
            v = DTensor.from_local(v._local_tensor._tensor, v.device_mesh, v.placements,
                                   shape=v.shape, stride=v.stride(), run_check=False)
        elif type(v) is not torch.Tensor and isinstance(v, torch.Tensor) and hasattr(v, "_tensor"):
            v = v._tensor
        out[k] = v
    return out


# ---- RNG states as JSON ---------------------------------------------------------------------------


def _rng_state() -> dict:
    version, keys, gauss = random.getstate()
    np_state = np.random.get_state(legacy=True)
    assert isinstance(np_state, tuple)  # legacy=True: the tuple form, never the dict
    name, np_keys, pos, has_gauss, cached = np_state
    state = {
        "python": [version, list(keys), gauss],
        "numpy": [name, np_keys.tolist(), pos, has_gauss, cached],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def _bytes_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def _set_rng_state(state: dict) -> None:
    version, keys, gauss = state["python"]
    random.setstate((version, tuple(keys), gauss))
    name, np_keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(np_keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_bytes_tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(_bytes_tensor(state["cuda"]))


# ---- a checkpoint's model shape against this run's --------------------------------------------------------------


def check_model_shape(model: torch.nn.Module, margs, path: str) -> None:
    """Name the first mismatching parameter rather than let DCP fail deep inside."""
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    args_file = os.path.join(path, MODEL_ARGS)
    if margs.tie_embeddings and os.path.isfile(args_file):
        # Both names are in a tied model's state dict: an untied checkpoint would load its
        # embedding and its output layer into the one shared tensor, the last one winning.
        with open(args_file) as f:
            if not json.load(f).get("tie_embeddings", False):
                raise CheckpointMismatch(f"{path} was saved with untied embeddings (an output layer of its own); "
                                         f"run with --model.tie_embeddings false")
    # DCP types a state dict's values broadly (tensors, numbers, strings, containers); a model's holds tensors.
    params = cast("dict[str, torch.Tensor]", get_model_state_dict(model))
    for name, tensor in params.items():
        saved = meta.get(f"model.{name}")
        if saved is None and name.endswith("attention.wqkv.weight") and f"model.{name.replace('wqkv', 'wq')}" in meta:
            # Earlier titanlike versions had three Linears (wq, wk, wv). Hugging Face folders hold them
            # apart too, and import stacks them: that is the way across.
            raise CheckpointMismatch(
                f"{path} was saved by an earlier titanlike, with separate wq/wk/wv projections (now one "
                f"stacked wqkv): export it with that version's scripts/export_safetensors.py and start from "
                f"the export with --checkpoint.initial_load_path")
        if not isinstance(saved, TensorStorageMetadata):  # absent (None), or saved as bytes: not a tensor
            raise CheckpointMismatch(f"{path} has no parameter {name}: it was saved from a different model")
        if tuple(saved.size) != tuple(tensor.shape):
            raise CheckpointMismatch(
                f"{path} was saved from a different model shape: {name} is {tuple(saved.size)} there, "
                f"{tuple(tensor.shape)} here (check --model.flavor / --model.vocab_size)"
            )
    if os.path.isfile(args_file):
        # Same tensor shapes can hold another model (8 heads × 32 or 4 × 64; another rope_theta).
        from titanlike.model_shape import shape_difference

        with open(args_file) as f:
            diff = shape_difference(json.load(f), margs)
        if diff:
            raise CheckpointMismatch(f"{path} was saved from a different model shape: {diff} "
                                     f"(resume with the [model] options it was trained with)")


def load_initial_weights(model: torch.nn.Module, margs, path: str, *, trust_pickled_dcp: bool = False,
                         process_group=None) -> None:
    """Model weights only, for a new run: a safetensors (Hugging Face) folder, or a DCP step folder
    that is trusted (check_trusted_dcp)."""
    if os.path.isfile(os.path.join(path, ".metadata")):
        check_trusted_dcp(path, trust_pickled_dcp)
        check_model_shape(model, margs, path)
        state: dict[str, Any] = {"model": ModelState(model).state_dict()}
        dcp.load(state, checkpoint_id=path, process_group=process_group, no_dist=not dist.is_initialized())
        set_model_state_dict(model, state["model"])
    else:
        from titanlike.interchange import read_hf_folder

        full: dict[str, Any] = read_hf_folder(path, margs)
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))


# ---- the checkpointer -------------------------------------------------------------------------------


class Checkpointer:
    """Saves and restores the pieces it is handed (Stateful objects); it knows nothing of the trainer."""

    def __init__(self, cfg, dump_folder: str, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler, loader, train_state: TrainState, float8_state: Stateful, run: RunFacts,
                 is_main: bool, backend_timeout_s: int, cuda: bool):
        self.cfg = cfg
        self.model_state = ModelState(model)
        self.optimizer_state = OptimizerState(model, optimizer)
        self.model, self.scheduler, self.loader = model, scheduler, loader
        self.train_state, self.float8_state, self.run = train_state, float8_state, run
        self.is_main, self.cuda = is_main, cuda
        self.folder = cfg.folder if os.path.isabs(cfg.folder) else os.path.join(dump_folder, cfg.folder)
        self.sharded = dist.is_initialized()
        self.rank = dist.get_rank() if self.sharded else 0
        self.world = dist.get_world_size() if self.sharded else 1
        self.pending: tuple[int, Future] | None = None  # (step, future) of an async save in flight
        self.staging = None  # future of the host copy of an async_with_pinned_mem save
        self.stager: HostCopyStager | None = None  # keeps pinned host buffers from one save to the next
        self.resumed_from: int | None = None  # the step this run resumed from, if it did
        self.resumed_preemption_save: int | None = None  # ... when that was a preemption save (no enable)
        # Checkpoint collectives run on CPU (gloo) groups, so they never queue behind (or block) the
        # training step's NCCL work. Two of them: the main thread's (barriers, synchronous saves,
        # loads, the per-step vote) and the background saves' own. A background save runs its
        # collectives in a thread of its own; on a group shared with the per-step vote, the two
        # would be paired up in a different order on different ranks, and the run would hang.
        self.cpu_group = self.save_group = None
        if self.sharded:
            timeout = datetime.timedelta(seconds=backend_timeout_s)
            self.cpu_group = dist.new_group(backend="gloo", timeout=timeout)
            if cfg.async_mode != "disabled":  # every rank has the same config: groups are made in step
                self.save_group = dist.new_group(backend="gloo", timeout=timeout)

    # ---- paths --------------------------------------------------------------------------------

    def step_dir(self, step: int) -> str:
        return os.path.join(self.folder, f"step-{step}")

    def complete_steps(self) -> list[int]:
        if not os.path.isdir(self.folder):
            return []
        return sorted(int(m.group(1)) for m in map(STEP_DIR.match, os.listdir(self.folder)) if m)

    def incomplete_steps(self) -> list[int]:
        if not os.path.isdir(self.folder):
            return []
        return sorted(int(m.group(1)) for m in map(TMP_DIR.match, os.listdir(self.folder)) if m)

    def check_writable(self) -> None:
        """Before step 1: a checkpoint folder that cannot be written is found now, not after the steps."""
        if not self.cfg.enable:
            return  # (a preemption save without it makes the folder when it is needed)
        try:
            write_probe(self.folder, f".write-test-rank{self.rank}")
        except OSError as e:
            raise CheckpointError(f"checkpoint folder {self.folder} is not writable ({e.strerror}: "
                                  f"{e.filename or self.folder}); set --checkpoint.folder to a writable path") from None

    # ---- saving ----------------------------------------------------------------------------------

    def due(self, step: int, last: bool) -> bool:
        return self.cfg.enable and (step % self.cfg.interval == 0 or last)

    def save(self, step: int, final: bool = False, preemption: bool = False) -> None:
        start = time.perf_counter()
        self.wait_and_publish()  # one save in flight at a time
        tmp = self.step_dir(step) + ".tmp"
        try:
            if self.is_main:
                self._prune(keep=self.cfg.keep_latest_k - 1, below=step)  # room for the new one first
                shutil.rmtree(tmp, ignore_errors=True)  # a previous attempt at this step that died
                os.makedirs(tmp)
                self._write_json(os.path.join(tmp, MODEL_ARGS), asdict(self.run.model_args))
                self._write_json(os.path.join(tmp, TRAINER_STATE), {
                    "train_state": self.train_state.state_dict(), "dp_world": self.run.dp_world,
                    "global_batch": self.run.global_batch, "settings": self.run.settings,
                    "optimizer_state_dtype": self.run.optimizer_state_dtype, "preemption": preemption,
                })
            self._barrier()
            self._write_json(os.path.join(tmp, RNG_FILE.format(self.rank)), _rng_state())
        except OSError as e:
            self._fail(step, e)
        state = {"model": self.model_state.state_dict(), "optimizer": self.optimizer_state.state_dict()}
        if f8 := self.float8_state.state_dict():
            state["float8"] = f8
        use_async = self.cfg.async_mode != "disabled" and not final
        try:
            if use_async:
                self.pending = (step, self._async_save(state, tmp))
            else:
                dcp.save(state, checkpoint_id=tmp, process_group=self.cpu_group, no_dist=not self.sharded)
                self._publish(step)
                if preemption and not self.cfg.enable and self.resumed_preemption_save not in (None, step):
                    self._remove(self.resumed_preemption_save)  # superseded by this one
        except (Exception, CheckpointException) as e:  # DCP's exception is a BaseException
            self._fail(step, e)
        self.last_stall_s = time.perf_counter() - start
        if self.is_main:
            how = "background save started" if use_async else "saved"
            logger.info(f"checkpoint step {step}: {how}; training stalled {self.last_stall_s:.2f}s")

    @staticmethod
    def _write_json(path: str, obj: object) -> None:
        with open(path, "w") as f:
            json.dump(obj, f)

    def _async_save(self, state: dict, tmp: str):
        """Start a background save; returns the future of the upload (the files written)."""
        kwargs: dict = {"checkpoint_id": tmp, "process_group": self.save_group, "no_dist": not self.sharded}
        pinned = self.cuda and self.cfg.async_mode == "async_with_pinned_mem"
        if pinned or self.run.optimizer_state_dtype == "8bit":
            # titanlike's stager (checkpoint_staging.py): pinned buffers kept between saves, copied on a
            # side stream while training goes on; and torchao's 8-bit state, which DCP cannot copy.
            if self.stager is None:
                self.stager = HostCopyStager(pinned=pinned)
            kwargs["async_stager"] = self.stager
        result = dcp.async_save(state, **kwargs)
        # A stager that stages in the background makes torch return both the staging and the upload futures.
        self.staging = getattr(result, "staging_completion", None)
        return getattr(result, "upload_completion", result)

    def before_update(self) -> None:
        """Called before each optimizer step: a background copy of the weights must be complete."""
        if self.staging is not None:
            start = time.perf_counter()
            self.staging.result()
            self.staging = None
            if self.is_main:
                waited = time.perf_counter() - start
                logger.info(f"checkpoint staging to host memory done; the update waited {waited:.2f}s")

    def wait_and_publish(self) -> None:
        """Wait for a background save in flight, then publish it (make step-N visible)."""
        if self.pending is None:
            return
        step, future = self.pending
        self.pending = None
        try:
            future.result()
        except (Exception, CheckpointException) as e:
            self._fail(step, e)
        self._publish(step)

    def _publish(self, step: int) -> None:
        """All ranks have written: checksum every file (each rank its own), write the manifest, make the
        checkpoint visible by one rename, then prune old ones."""
        self._barrier()
        tmp = self.step_dir(step) + ".tmp"
        try:
            names = sorted(os.listdir(tmp))
            mine: dict[str, Any] = describe_files(tmp, [n for n in names if owner(n, self.world) == self.rank])
        except OSError as e:
            mine = {"error": f"{e.strerror}: {e.filename}"}  # this rank's failure, for all to see
        parts: list[Any] = [mine]
        if self.sharded:
            parts = [None] * self.world
            dist.all_gather_object(parts, mine, group=self.cpu_group)
        if self.is_main:
            try:
                if any("error" in p for p in parts):
                    raise OSError(next(p["error"] for p in parts if "error" in p))
                write_manifest(tmp, step, {k: v for p in parts for k, v in p.items()})
                final = self.step_dir(step)
                if os.path.exists(final):
                    shutil.rmtree(final)
                os.replace(tmp, final)
                logger.info(f"checkpoint saved: {final}")
                self._prune(keep=self.cfg.keep_latest_k, below=step + 1)
            except OSError as e:
                failed: BaseException | None = e
            else:
                failed = None
        else:
            failed = None
        flag = torch.tensor([int(failed is not None)])
        if self.sharded:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.cpu_group)
        if flag.item():
            self._fail(step, failed or OSError("rank 0 could not publish the checkpoint"))

    def _prune(self, keep: int, below: int) -> None:
        """keep_latest_k: delete all but the newest `keep` complete steps before step `below`. Only older
        steps than the one being written: never the newest (a resume set the later ones aside), and
        never fewer than one, so that a failed save always leaves a checkpoint behind."""
        if not self.cfg.keep_latest_k:
            return
        older = [s for s in self.complete_steps() if s < below]
        for old in older[: -max(keep, 1)]:
            shutil.rmtree(self.step_dir(old), ignore_errors=True)

    def _fail(self, step: int, e: BaseException) -> None:
        if self.is_main:
            shutil.rmtree(self.step_dir(step) + ".tmp", ignore_errors=True)
        previous = [s for s in self.complete_steps() if s != step]
        kept = (f"the previous checkpoint {self.step_dir(previous[-1])} is intact" if previous
                else "no earlier checkpoint exists")
        raise CheckpointError(f"saving the checkpoint of step {step} to {self.folder} failed: "
                              f"{self._save_failure_cause(e, previous)}; {kept}") from None

    def _save_failure_cause(self, e: BaseException, previous: list[int]) -> str:
        """One readable cause: the OSError's text and path where there is one, else what the file
        system says (free space, the file size limit), else the first line of the message."""
        free_mb = shutil.disk_usage(self.folder).free / 2**20 if os.path.isdir(self.folder) else float("inf")
        size_mb = (sum(f.stat().st_size for f in os.scandir(self.step_dir(previous[-1])) if f.is_file()) / 2**20
                   if previous and os.path.isdir(self.step_dir(previous[-1])) else 0.0)
        errors: list[BaseException] = []
        todo: list[BaseException] = [e]
        while todo and len(errors) < 50:  # DCP wraps each rank's error: (exception, traceback) per rank
            x = todo.pop()
            errors.append(x)
            for wrapped in (getattr(x, "failures", None) or {}).values():
                todo.append(wrapped[0] if isinstance(wrapped, tuple) else getattr(wrapped, "exc", wrapped))
            todo += [c for c in (x.__cause__, x.__context__) if c is not None]
        os_error = next((x for x in errors if isinstance(x, OSError) and x.strerror), None)
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if (os_error and os_error.errno == errno.ENOSPC) or "No space left" in str(e) or free_mb < 64:
            k = self.cfg.keep_latest_k
            advice = (f"free space, or keep fewer checkpoints: with --checkpoint.keep_latest_k {max(1, (k or 3) - 1)} "
                      f"older ones are deleted before each save" if k != 1 else
                      "free space or point --checkpoint.folder at a larger disk")
            need = f", a checkpoint takes {size_mb:.0f} MB" if size_mb else ""
            return f"No space left on device: {free_mb:.0f} MB free{need}; {advice}"
        size_limit = (f"this process may write files of at most {limit / 2**20:.0f} MB (ulimit -f); raise the limit"
                      if limit != resource.RLIM_INFINITY else "")
        if os_error:
            cause = f"{os_error.strerror}: {os_error.filename or self.folder}"
            return f"{cause}: {size_limit}" if os_error.errno == errno.EFBIG and size_limit else cause
        if size_limit:
            return f"a file could not be written in full: {size_limit}"
        # The error a rank met, not DCP's wrapper around it; its type named (a KeyError's text alone is a key).
        inner = next((x for x in errors if not isinstance(x, CheckpointException) and str(x).strip()), e)
        text = (str(inner).strip().splitlines() or [""])[0][:200]
        return f"{type(inner).__name__}: {text}" if text else type(inner).__name__

    def _barrier(self) -> None:
        if self.sharded:
            dist.barrier(group=self.cpu_group)

    # ---- loading -----------------------------------------------------------------------------------

    def resume_or_start(self, initial_load_path: str = "", trust_pickled_dcp: bool = False) -> None:
        """Resume from the newest intact checkpoint (or checkpoint.load_step); else start from
        initial_load_path, if set. Without checkpoint.enable, only a preemption save is resumed from."""
        for step in self.incomplete_steps():
            if self.is_main:
                logger.warning(f"ignoring {self.step_dir(step)}.tmp: a save that never completed")
        steps = self.complete_steps()
        if not self.cfg.enable:
            if steps and self._trainer_state(steps[-1]).get("preemption"):
                self._resume([steps[-1]])
                self.resumed_preemption_save = steps[-1]
                if self.is_main:
                    logger.info(f"{self.step_dir(steps[-1])} is the save of a preempted run: resumed from it "
                                f"(checkpoint.enable is off: once this run completes, it is removed)")
            elif initial_load_path:
                self.load_weights(initial_load_path, trust_pickled_dcp)
            return
        if self.cfg.load_step >= 0:
            if self.cfg.load_step not in steps:
                have = ", ".join(map(str, steps)) or "none"
                raise CheckpointMismatch(
                    f"checkpoint.load_step = {self.cfg.load_step}: no complete checkpoint "
                    f"{self.step_dir(self.cfg.load_step)} "
                    f"(complete steps in {self.folder}: {have})"
                )
            self._resume([self.cfg.load_step])
        elif steps:
            self._resume(steps[::-1])
        elif initial_load_path:
            self.load_weights(initial_load_path, trust_pickled_dcp)

    def _resume(self, candidates: list[int]) -> None:
        """Load the first intact step of `candidates`; set damaged ones aside, then later ones."""
        damaged = []
        for step in candidates:
            problem = self._verify(step)
            if problem is None:
                try:
                    self.load(step)
                except (Exception, CheckpointException) as e:  # damage the manifest could not see
                    if isinstance(e, UserError):
                        raise
                    cause = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
                    problem = f"{self.step_dir(step)} cannot be read ({cause})"
            if problem is None:
                self.resumed_from = step
                self._set_aside_later(step)
                return
            aside = self._set_aside(step, "damaged")
            damaged.append(step)
            if self.is_main:
                logger.warning(f"checkpoint damaged: {problem}; set aside as {aside}")
            if self.cfg.load_step >= 0:
                raise CheckpointError(f"checkpoint.load_step = {step}: {problem}")
            if self.is_main and step != candidates[-1]:
                logger.warning(f"falling back to the newest intact checkpoint before step {step}")
        raise CheckpointError(f"no intact checkpoint in {self.folder}: steps {', '.join(map(str, damaged))} are "
                              f"damaged (set aside as step-N.damaged); remove --checkpoint.enable or use another "
                              f"--checkpoint.folder to start afresh")

    def _verify(self, step: int) -> str | None:
        """Check the step's files against its manifest (ranks share the files), same answer on every rank."""
        path = self.step_dir(step)
        manifest = read_manifest(path)
        if manifest is None:
            problem = None if not os.path.exists(os.path.join(path, TRAINER_STATE)) else f"{path}/{MANIFEST} is missing"
            if problem is None and not os.path.isfile(os.path.join(path, ".metadata")):
                problem = f"{path}/.metadata is missing"
            if problem is None and self.is_main:
                logger.info(f"{path} has no manifest (saved by an earlier titanlike): its files are not verified")
        elif manifest.get("unreadable"):
            problem = f"{path}/{MANIFEST} is unreadable"
        else:
            names = sorted(manifest["files"])
            problem = verify_files(path, names[self.rank :: self.world], manifest)
            if problem is None:
                extra = {".metadata", TRAINER_STATE, MODEL_ARGS} - set(names)
                problem = f"{path}/{sorted(extra)[0]} is not in the manifest" if extra else None
        if self.sharded:
            problems = [None] * self.world
            dist.all_gather_object(problems, problem, group=self.cpu_group)
            problem = next((p for p in problems if p), None)
        return problem

    def _set_aside(self, step: int, why: str) -> str:
        """Rename step-N so that it is never loaded again, keeping its bytes: step-N.<why>[.k]."""
        base = self.step_dir(step) + f".{why}"
        target, k = base, 1
        while os.path.exists(target):
            k += 1
            target = f"{base}.{k}"
        if self.is_main:
            os.replace(self.step_dir(step), target)
        self._barrier()
        return target

    def _set_aside_later(self, step: int) -> None:
        """A resume from an older step starts a new branch: the later checkpoints must never be resumed
        from again (nor count for keep_latest_k), but their bytes stay."""
        self._barrier()  # every rank lists the folder before rank 0 renames anything in it
        later = [s for s in self.complete_steps() if s > step]
        if not later:
            return
        names = [os.path.basename(self._set_aside(s, "abandoned")) for s in later]
        if self.is_main:
            logger.warning(f"resumed from step {step}: set aside the later checkpoints as {', '.join(names)} "
                           f"(never resumed from again; delete them when you no longer need them)")

    def _trainer_state(self, step: int) -> dict:
        try:
            with open(os.path.join(self.step_dir(step), TRAINER_STATE)) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def load(self, step: int, restore_data: bool = True) -> None:
        """Restore everything saved at `step`; with restore_data=False (a rollback) the data loader
        and RNG stay where they are."""
        path = self.step_dir(step)
        check_model_shape(self.model, self.run.model_args, path)
        saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        trainer = self._trainer_state(step)
        # Before reading any tensor: the saved moments have another layout, which DCP would only call missing keys.
        saved_dtype = trainer.get("optimizer_state_dtype", "fp32")  # older checkpoints: fp32 AdamW
        if saved_dtype != self.run.optimizer_state_dtype:
            raise CheckpointMismatch(
                f"{path} keeps AdamW's moments in {saved_dtype}, this run in {self.run.optimizer_state_dtype}: "
                f"resume with --optimizer.state_dtype {saved_dtype} (the moments cannot be converted)"
            )
        state: dict = {"model": self.model_state.state_dict(), "optimizer": self.optimizer_state.state_dict()}
        # Delayed scaling's history, where the checkpoint has one of this shape (else it starts afresh).
        f8 = {k: v for k, v in self.float8_state.state_dict().items()
              if tuple(getattr(saved.get(f"float8.{k}"), "size", ())) == tuple(v.shape)}
        if f8:
            state["float8"] = f8
        if not trainer:
            # Saved by an earlier titanlike: its step counts are DCP objects (a checkpoint of this
            # run's own folder, so trusted); its data position comes from the step.
            legacy = {**self.train_state.state_dict(), "dp_world": 0, "global_batch": 0}
            state["train_state"] = {k: v for k, v in legacy.items() if f"train_state.{k}" in saved}
        dcp.load(state, checkpoint_id=path, process_group=self.cpu_group, no_dist=not self.sharded)
        self.model_state.load_state_dict(state["model"])
        self.optimizer_state.load_state_dict(state["optimizer"])
        self.float8_state.load_state_dict(state.get("float8", {}))
        if trainer:
            ts, dp_world, global_batch = trainer["train_state"], trainer["dp_world"], trainer["global_batch"]
        else:
            ts = state["train_state"]
            dp_world, global_batch = ts.pop("dp_world", 0), ts.pop("global_batch", 0)
        self.train_state.load_state_dict(ts)
        if int(global_batch) != self.run.global_batch:
            raise CheckpointMismatch(
                f"{path} was trained with global batch {global_batch}, this run has {self.run.global_batch}: "
                f"resume with --training.global_batch_size {global_batch} (the LR schedule and data order depend on it)"
            )
        # The LR schedule is this run's (its settings may have changed), at the step reached.
        resume_schedule(self.scheduler, self.train_state.step)
        if not restore_data:
            if self.is_main:
                logger.info(f"reloaded {path} (step {self.train_state.step}), data position kept")
            return
        self.loader.seek(self.train_state.batches_read)
        rng_file = os.path.join(path, RNG_FILE.format(self.rank))
        if int(dp_world) == self.run.dp_world and os.path.isfile(rng_file):
            with open(rng_file) as f:
                _set_rng_state(json.load(f))
            how = "data position and RNG restored"
        elif trainer:
            how = f"saved on {dp_world} data-parallel ranks, now {self.run.dp_world}: data position from the step"
        else:
            how = "saved by an earlier titanlike: data position from the step, RNG afresh"
        if self.is_main:
            logger.info(f"resumed from {path} at step {self.train_state.step} ({how})")
            for key, now in self.run.settings.items():
                before = trainer.get("settings", {}).get(key, now)
                if before != now:
                    logger.info(f"{key}: checkpoint {before} → config {now}")

    def load_weights(self, path: str, trust_pickled_dcp: bool = False) -> None:
        """Model weights only, for a new run: from a safetensors export, or a trusted checkpoint step folder."""
        load_initial_weights(self.model, self.run.model_args, path,
                             trust_pickled_dcp=trust_pickled_dcp, process_group=self.cpu_group)
        if self.is_main:
            logger.info(f"initial weights loaded from {path}")

    def remove_consumed_preemption_save(self) -> None:
        """Without checkpoint.enable, a completed run removes the preemption save it resumed from: else
        the same command would resume from it again."""
        if self.resumed_preemption_save is None or self.cfg.enable:
            return
        self._remove(self.resumed_preemption_save)

    def _remove(self, step: int) -> None:
        self._barrier()
        if self.is_main:
            shutil.rmtree(self.step_dir(step), ignore_errors=True)
            logger.info(f"removed the preemption save {self.step_dir(step)}: this run got past it")

    # ---- preemption, Ctrl-C ---------------------------------------------------------------------------

    def stop_requested_and_publish(self, request: int) -> int:
        """The largest stop request (stopping.py: none, preempted, interrupted) of any rank, given this
        rank's: every rank gets the same answer, as all must stop after the same step.

        One small all-reduce on the CPU group per step also tells whether every rank has finished
        writing a background save, so that all of them publish it at the same step (here).
        """
        writing = self.pending is not None and not self.pending[1].done()
        flags = torch.tensor([request, int(writing)])
        if self.sharded:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.cpu_group)
        if self.pending is not None and not flags[1]:
            self.wait_and_publish()
        return int(flags[0])

    def finish_and_publish(self) -> None:
        """Wait for a background save to land and publish it (end of run, preemption)."""
        self.wait_and_publish()
        if self.stager is not None:
            self.stager.close()
            self.stager = None

