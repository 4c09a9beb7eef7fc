"""Distributed checkpoints you can trust: save, async save, exact resume, resharding, preemption.

Layout under the checkpoint folder:

    step-200/        a complete checkpoint (DCP files + model_args.json)
    step-300.tmp/    a save in progress, or one a crash interrupted: never loaded, reported

A save writes into `step-N.tmp` and becomes `step-N` by one atomic rename, done by rank 0 only
after DCP has written the metadata, which it does after every rank has finished writing. So a
`step-N` folder is always complete, and an interrupted save cannot touch older checkpoints.

What a checkpoint holds: the model and optimizer (sharded, through DCP's get_state_dict, so
any world size can load them: DCP reshards on load), the LR scheduler, the step and tokens
seen, float8 delayed scaling's amax history when that is on, and per rank the data-loader
position and the RNG states. When the data-parallel world size changes on resume, the per-rank
parts cannot apply; the data position is then derived from the step, which gives the same samples
(see data.py: a step's samples do not depend on ranks).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import pickle
import random
import re
import shutil
import time
import warnings
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from torch.distributed.checkpoint.api import CheckpointException

from titanlike.errors import UserError

logger = logging.getLogger("titanlike")
# DCP warns that a single-process save is single-process (its background thread ignores no_dist).
warnings.filterwarnings("ignore", message="torch.distributed is disabled")

STEP_DIR = re.compile(r"^step-(\d+)$")
TMP_DIR = re.compile(r"^step-(\d+)\.tmp$")


class CheckpointError(UserError):
    pass


class CheckpointMismatch(CheckpointError):
    """The checkpoint on disk does not fit this run; every rank reads the same files, rank 0 reports."""

    same_on_all_ranks = True


@dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0
    data_offset: int = 0  # global batches the data is ahead of `step`: those rollbacks did not replay
    skipped_steps: int = 0  # updates skipped for a non-finite gradient (training.nonfinite = skip)


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


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


class Checkpointer:
    """Saves and restores the trainer's state; the trainer calls it, it never calls the trainer."""

    def __init__(self, cfg, dump_folder: str, trainer, is_main: bool):
        self.cfg = cfg
        self.trainer = trainer
        self.is_main = is_main
        self.folder = cfg.folder if os.path.isabs(cfg.folder) else os.path.join(dump_folder, cfg.folder)
        self.sharded = dist.is_initialized()
        self.rank = dist.get_rank() if self.sharded else 0
        self.pending: tuple[int, object] | None = None  # (step, future) of an async save in flight
        self.staging = None  # future of the host copy of an async_with_pinned_mem save
        self.stager = None  # keeps the pinned host buffers from one save to the next
        # Checkpoint collectives run on CPU (gloo) groups, so they never queue behind (or block) the
        # training step's NCCL work. Two of them: the main thread's (barriers, synchronous saves,
        # loads, the per-step vote) and the background saves' own. A background save runs its
        # collectives in a thread of its own; on a group shared with the per-step vote, the two
        # would be paired up in a different order on different ranks, and the run would hang.
        self.cpu_group = self.save_group = None
        if self.sharded:
            timeout = datetime.timedelta(seconds=trainer.cfg.parallel.backend_timeout_s)
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

    # ---- what is saved ------------------------------------------------------------------------------

    def _model_sd(self) -> dict:
        return _plain_tensors(get_model_state_dict(self.trainer.model))

    def _state_dict(self) -> dict:
        t = self.trainer
        per_rank = {"dataloader": t.loader.state_dict(), "rng": _rng_state()}
        return {
            "model": self._model_sd(),
            "optimizer": get_optimizer_state_dict(t.model, t.optimizer),
            "lr_scheduler": t.scheduler.state_dict(),
            "train_state": {**asdict(t.state), "dp_world": t.dims.dp, "global_batch": t.global_batch},
            **t.fp8.state_dict(),  # delayed scaling's amax history, if on
            # Unique per rank; pickled to bytes so DCP stores them as opaque objects.
            f"rank{self.rank}": pickle.dumps(per_rank),
        }

    # ---- saving ----------------------------------------------------------------------------------

    def due(self, step: int, last: bool) -> bool:
        return self.cfg.enable and (step % self.cfg.interval == 0 or last)

    def save(self, step: int, final: bool = False) -> None:
        start = time.perf_counter()
        self._complete_pending()  # one save in flight at a time
        tmp = self.step_dir(step) + ".tmp"
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # a previous attempt at this step that died
            os.makedirs(tmp)
            with open(os.path.join(tmp, "model_args.json"), "w") as f:
                json.dump(asdict(self.trainer.margs), f)
        self._barrier()
        state = self._state_dict()
        use_async = self.cfg.async_mode != "disabled" and not final
        try:
            if use_async:
                self.pending = (step, self._async_save(state, tmp))
            else:
                dcp.save(state, checkpoint_id=tmp, process_group=self.cpu_group, no_dist=not self.sharded)
                self._publish(step)
        except (Exception, CheckpointException) as e:  # DCP's exception is a BaseException
            self._fail(step, e)
        self.last_stall_s = time.perf_counter() - start
        if self.is_main:
            how = "background save started" if use_async else "saved"
            logger.info(f"checkpoint step {step}: {how}; training stalled {self.last_stall_s:.2f}s")

    def _async_save(self, state: dict, tmp: str):
        """Start a background save; returns the future of the upload (the files written)."""
        kwargs: dict = {"checkpoint_id": tmp, "process_group": self.save_group, "no_dist": not self.sharded}
        if self.cfg.async_mode == "async_with_pinned_mem":
            # The GPU→host copy runs on a side stream into pinned buffers that are kept between
            # saves, in a background thread, overlapping the next forward and backward. Only the
            # next optimizer step must wait for it (before_update), as it overwrites the weights.
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            if self.stager is None:
                cuda = self.trainer.device.type == "cuda"
                self.stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                           use_async_staging=cuda, use_non_blocking_copy=cuda))
            if self.trainer.device.type == "cuda":
                torch.cuda.synchronize()  # the step that produced these weights has finished
            kwargs["async_stager"] = self.stager
        result = dcp.async_save(state, **kwargs)
        # With async staging, torch returns both the staging and the upload futures.
        self.staging = getattr(result, "staging_completion", None)
        return getattr(result, "upload_completion", result)

    def before_update(self) -> None:
        """Called before each optimizer step: a background copy of the weights must be complete."""
        if self.staging is not None:
            start = time.perf_counter()
            self.staging.result()
            self.staging = None
            if self.is_main:
                logger.info(f"checkpoint staging to host memory done; the update waited {time.perf_counter() - start:.2f}s")

    def _complete_pending(self) -> None:
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
        """All ranks have written: make the checkpoint visible, then prune old ones."""
        self._barrier()
        if self.is_main:
            final = self.step_dir(step)
            if os.path.exists(final):
                shutil.rmtree(final)
            os.replace(final + ".tmp", final)
            logger.info(f"checkpoint saved: {final}")
            if self.cfg.keep_latest_k:
                for old in self.complete_steps()[: -self.cfg.keep_latest_k]:
                    shutil.rmtree(self.step_dir(old), ignore_errors=True)
        self._barrier()

    def _fail(self, step: int, e: BaseException) -> None:
        free_mb = shutil.disk_usage(self.folder).free / 2**20 if os.path.isdir(self.folder) else float("inf")
        if self.is_main:
            shutil.rmtree(self.step_dir(step) + ".tmp", ignore_errors=True)
        previous = [s for s in self.complete_steps() if s != step]
        kept = f"the previous checkpoint {self.step_dir(previous[-1])} is intact" if previous else "no earlier checkpoint exists"
        # DCP wraps each rank's error; a full disk often surfaces as a short write deep in the
        # serializer, so ask the file system rather than trust the message.
        failures = getattr(e, "failures", None) or {}
        inner = next(iter(failures.values()), e)
        text = str(getattr(inner, "exc", inner)) or type(inner).__name__
        if "No space left" in str(e) or free_mb < 64:
            cause = f"No space left on device: {free_mb:.0f} MB free"
        else:
            cause = text.strip().splitlines()[0][:200]
        raise CheckpointError(f"saving the checkpoint of step {step} to {self.folder} failed ({cause}); {kept}") from None

    def finish(self) -> None:
        """Wait for a background save to land (end of run, preemption)."""
        self._complete_pending()
        if self.stager is not None:
            self.stager.close()
            self.stager = None

    def _barrier(self) -> None:
        if self.sharded:
            dist.barrier(group=self.cpu_group)

    # ---- loading -----------------------------------------------------------------------------------

    def load_or_initialize(self) -> None:
        """Resume from a checkpoint if there is one; else start from checkpoint.initial_load_path, if set."""
        if not self.cfg.enable:
            if self.cfg.initial_load_path:
                self.load_weights(self.cfg.initial_load_path)
            return
        for step in self.incomplete_steps():
            if self.is_main:
                logger.warning(f"ignoring {self.step_dir(step)}.tmp: a save that never completed")
        steps = self.complete_steps()
        if self.cfg.load_step >= 0:
            if self.cfg.load_step not in steps:
                have = ", ".join(map(str, steps)) or "none"
                raise CheckpointMismatch(
                    f"checkpoint.load_step = {self.cfg.load_step}: no complete checkpoint {self.step_dir(self.cfg.load_step)} "
                    f"(complete steps in {self.folder}: {have})"
                )
            self.load(self.cfg.load_step)
        elif steps:
            self.load(steps[-1])
        elif self.cfg.initial_load_path:
            self.load_weights(self.cfg.initial_load_path)

    def _check_model_shape(self, path: str) -> None:
        """Name the first mismatching parameter rather than let DCP fail deep inside."""
        meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        args_file = os.path.join(path, "model_args.json")
        if self.trainer.margs.tie_embeddings and os.path.isfile(args_file):
            # Both names are in a tied model's state dict: an untied checkpoint would load its
            # embedding and its output layer into the one shared tensor, the last one winning.
            with open(args_file) as f:
                if not json.load(f).get("tie_embeddings", False):
                    raise CheckpointMismatch(f"{path} was saved with untied embeddings (an output layer of its own); "
                                             f"run with --model.tie_embeddings false")
        for name, tensor in get_model_state_dict(self.trainer.model).items():
            saved = meta.get(f"model.{name}")
            if saved is None and name.endswith("attention.wqkv.weight") and f"model.{name.replace('wqkv', 'wq')}" in meta:
                # Before 2026-11-22 the q, k and v projections were three Linears (wq, wk, wv). Hugging
                # Face folders hold them apart too, and import stacks them: that is the way across.
                raise CheckpointMismatch(
                    f"{path} was saved by an earlier titanlike, with separate wq/wk/wv projections (now one "
                    f"stacked wqkv): export it with that version's scripts/export_safetensors.py and start from "
                    f"the export with --checkpoint.initial_load_path")
            if saved is None:
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
                diff = shape_difference(json.load(f), self.trainer.margs)
            if diff:
                raise CheckpointMismatch(f"{path} was saved from a different model shape: {diff} "
                                         f"(resume with the [model] options it was trained with)")

    def load(self, step: int, restore_data: bool = True) -> None:
        """Restore everything saved at `step`; with restore_data=False (a rollback) the data loader
        and RNG stay where they are."""
        t = self.trainer
        path = self.step_dir(step)
        self._check_model_shape(path)
        saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        train_state = {**asdict(t.state), "dp_world": 0, "global_batch": 0}
        state = {
            "model": self._model_sd(),
            "optimizer": get_optimizer_state_dict(t.model, t.optimizer),
            "lr_scheduler": t.scheduler.state_dict(),
            # Checkpoints written before a TrainState field existed lack it: it keeps its default.
            "train_state": {k: v for k, v in train_state.items() if f"train_state.{k}" in saved},
        }
        # Delayed scaling's history, where the checkpoint has one of this shape (else it starts afresh).
        scaling = {k: v for k, v in t.fp8.state_dict().items()
                   if k in saved and tuple(saved[k].size) == tuple(v.shape)}
        state.update(scaling)
        dcp.load(state, checkpoint_id=path, process_group=self.cpu_group, no_dist=not self.sharded)
        set_model_state_dict(t.model, state["model"])
        set_optimizer_state_dict(t.model, t.optimizer, state["optimizer"])
        t.scheduler.load_state_dict(state["lr_scheduler"])
        t.fp8.load_state_dict({k: state[k] for k in scaling})
        ts = state["train_state"]
        for key, default in asdict(TrainState()).items():
            setattr(t.state, key, int(ts.get(key, default)))
        if int(ts["global_batch"]) != t.global_batch:
            raise CheckpointMismatch(
                f"{path} was trained with global batch {ts['global_batch']}, this run has {t.global_batch}: "
                f"resume with --training.global_batch_size {ts['global_batch']} (the LR schedule and data order depend on it)"
            )
        if not restore_data:
            how = "data position kept"
        elif int(ts["dp_world"]) == t.dims.dp:
            per_rank = {f"rank{self.rank}": b""}
            dcp.load(per_rank, checkpoint_id=path, process_group=self.cpu_group, no_dist=not self.sharded)
            restored = pickle.loads(per_rank[f"rank{self.rank}"])
            t.loader.load_state_dict(restored["dataloader"])
            _set_rng_state(restored["rng"])
            how = "data position and RNG restored"
        else:
            # Another world size: the per-rank states do not map; the step fixes the data position.
            t.loader.batch_sampler.start_step = t.state.step + t.state.data_offset
            how = f"saved on {ts['dp_world']} data-parallel ranks, now {t.dims.dp}: data position from the step"
        if self.is_main:
            logger.info(f"resumed from {path} at step {t.state.step} ({how})")

    def load_weights(self, path: str) -> None:
        """Model weights only, for a new run: from a checkpoint step folder or a safetensors export."""
        t = self.trainer
        if os.path.isfile(os.path.join(path, ".metadata")):
            self._check_model_shape(path)
            state = {"model": self._model_sd()}
            dcp.load(state, checkpoint_id=path, process_group=self.cpu_group, no_dist=not self.sharded)
            set_model_state_dict(t.model, state["model"])
        else:
            from titanlike.interchange import read_hf_folder

            full = read_hf_folder(path, t.margs)
            set_model_state_dict(t.model, full, options=StateDictOptions(full_state_dict=True))
        if self.is_main:
            logger.info(f"initial weights loaded from {path}")

    # ---- preemption, Ctrl-C ---------------------------------------------------------------------------

    def stop_requested(self, request: int) -> int:
        """The largest stop request (stopping.py: none, preempted, interrupted) of any rank, given this
        rank's: every rank gets the same answer, as all must stop after the same step.

        One small all-reduce on the CPU group per step also tells whether every rank has finished
        writing a background save, so that all of them publish it at the same step.
        """
        writing = self.pending is not None and not self.pending[1].done()
        flags = torch.tensor([request, int(writing)])
        if self.sharded:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.cpu_group)
        if self.pending is not None and not flags[1]:
            self._complete_pending()
        return int(flags[0])
