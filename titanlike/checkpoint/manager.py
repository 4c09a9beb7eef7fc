"""The checkpoint manager: built in one call from the parts of a run, it decides when to save, saves,
publishes, verifies, resumes, falls back and owns its folder. The trainer calls it at a few points:

    manager = CheckpointManager(run, SavedParts(model, optimizer, scheduler, loader, counters, converters), ...)
    manager.load_or_start()        resume from the newest intact step (or checkpoint.load_step, or a
                                   stopped run's save); None if there is nothing to resume
    manager.before_update()        before each optimizer step: a background save's copy of the tensors
                                   the update overwrites is complete
    manager.due(step, ...)         every step: agree on a stop request over ranks, publish background
                                   saves that landed; whether this step saves and whether the run stops
    manager.save(step, due)        save step-N (in the foreground or the background)
    manager.restore(step)          a rollback (training.nonfinite): that step's weights, optimizer,
                                   schedule and counters; the data position stays
    manager.close(...)             publish what is in flight, remove a consumed preemption save, unlock

A save writes into step-N.tmp and becomes step-N by one rename after every rank has written and the
signed manifest (manifest.py) is complete, so a step-N folder is always whole. A load passes the
manifest gate before anything is unpickled.

What is trusted, and the layout of a step folder: docs/checkpointing.md.
"""

from __future__ import annotations

import datetime
import logging
import os
import shutil
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from titanlike import fs
from titanlike.checkpoint import states as stateful
from titanlike.checkpoint.folder import StepFolders, unloadable
from titanlike.checkpoint.identity import other_run, run_after_load
from titanlike.checkpoint.manifest import ensure_signing_key, inspect, read_manifest
from titanlike.checkpoint.record import TRAINER_STATE, Due, RunRecord, from_earlier_layout
from titanlike.checkpoint.states import ModelState, OptimizerState, SchedulerState, holds_tensors, set_rng_state
from titanlike.checkpoint.weights import MODEL_ARGS, CheckpointMismatch, check_model_shape, check_tokenizer
from titanlike.checkpoint.writer import RNG_FILE, CheckpointError, StepWriter
from titanlike.config import changed_settings, resumable_settings
from titanlike.config.optimizer import UNRECORDED
from titanlike.config.run import ResolvedRun
from titanlike.errors import UserError

logger = logging.getLogger("titanlike")
# DCP warns that a single-process save is single-process (its background thread ignores no_dist).
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


class DataPosition(Protocol):
    """What the checkpoint needs of the data's position (the loader): its state, saved and restored as
    it is, and the number of global batches a saved state has read (the weights' stage follows from it)."""

    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...
    def batches_in(self, state: dict) -> int: ...
    def state_at(self, batches_read: int) -> dict: ...


@dataclass(frozen=True)
class SavedParts:
    """The parts of a run a checkpoint saves and restores, in the order a load restores them (weights
    before what is derived from them: a converter's scales)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    """The LR schedule (its position)."""
    loader: DataPosition
    """The data position: its state is saved as it is."""
    counters: Any
    """The run's counters (step, tokens, ...: run/state.py)."""
    converters: Mapping[str, stateful.ConverterState]
    """The model converters by name, each its own entry (model/converter.py)."""


class CheckpointManager:
    def __init__(self, run: ResolvedRun, parts: SavedParts, *, shape_after: Callable[[int], Any], is_main: bool,
                 cuda: bool, folder_run: str | None = None, step_files: dict[str, str] | None = None):
        """`run`: the resolved run (its [checkpoint] section and folder, and what a resume compares);
        `parts`: what it saves and restores. `shape_after(n)`: the model's shape once n global batches
        trained it (its stage's RoPE base: model_args.json). `folder_run`: the run id the dump folder
        records (rank 0 reads it; None: none), compared with the checkpoint's. `step_files`: files every
        step folder carries as they are (name → text: the run's tokenizer)."""
        cfg = run.cfg
        self.cfg, self.is_main, self.cuda = cfg.checkpoint, is_main, cuda
        self.states: dict[str, Any] = {
            "model": ModelState(parts.model), "optimizer": OptimizerState(parts.model, parts.optimizer),
            "lr_scheduler": SchedulerState(parts.scheduler), "dataloader": parts.loader,
            "train_state": parts.counters}
        assert not self.states.keys() & parts.converters.keys(), "a converter named as one of the run's states"
        self.states.update(parts.converters)
        self.run = RunRecord(run.global_batch, run.dims.dp, cfg.job.seed, cfg.optimizer.state_dtype,
                             cfg.optimizer.name, resumable_settings(cfg, run.schedule, run.stages),
                             dump_folder=os.path.abspath(cfg.job.dump_folder))
        self.data, self.shape_after, self.step_files = parts.loader, shape_after, dict(step_files or {})
        self.folder_run = folder_run
        self.branched = False  # resumed from another run's step that checkpoint.load_step named: a new run
        self.folder = run.checkpoint_folder
        fs.check_path_text(self.folder, "checkpoint.folder")
        self.steps = StepFolders(self.folder, is_main)
        self.sharded = dist.is_initialized()
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if self.sharded else (0, 1)
        self.resumed_from: int | None = None
        self.preemption_save: int | None = None  # resumed from a stop's save without checkpoint.enable
        self.lock = fs.FolderLock(self.folder, "checkpoint.folder")
        # Checkpoint collectives run on CPU (gloo) groups, so they never queue behind (or block) the
        # training step's NCCL work. Two of them: the main thread's (barriers, synchronous saves, loads,
        # the per-step vote) and the background saves' own; on one shared group the two threads'
        # collectives would pair up in a different order on different ranks, and the run would hang.
        self.cpu_group = self.save_group = None
        if self.sharded:
            timeout = datetime.timedelta(seconds=cfg.parallel.backend_timeout_s)
            self.cpu_group = dist.new_group(backend="gloo", timeout=timeout)
            if self.cfg.async_mode != "disabled":  # every rank has the same config: groups are made in step
                self.save_group = dist.new_group(backend="gloo", timeout=timeout)
        self.writer = StepWriter(self.steps, keep_latest_k=self.cfg.keep_latest_k,
                                 pinned=self.cfg.async_mode == "async_with_pinned_mem", rank=self.rank,
                                 world=self.world, group=self.cpu_group, save_group=self.save_group, cuda=cuda,
                                 eight_bit=self.run.optimizer_state_dtype == "8bit")
        if is_main:
            ensure_signing_key()  # before step 1: a save must be able to sign its manifest
            if self.cfg.enable or os.path.isdir(self.folder):
                self._own_folder()

    def _own_folder(self) -> None:
        """Rank 0 locks the folder (one run per checkpoint folder) and checks that it is writable."""
        if self.lock._fd is not None:
            return
        try:  # before the lock, which needs a folder it can write in
            fs.write_probe(self.folder, f".write-test-{os.getpid()}")
        except OSError as e:
            raise CheckpointError(f"checkpoint folder {self.folder} is not writable "
                                  f"({fs.describe_os_error(e, self.folder)}); set --checkpoint.folder to a "
                                  f"writable path") from None
        self.lock.acquire()

    def step_dir(self, step: int) -> str:
        return self.steps.step_dir(step)

    def complete_steps(self) -> list[int]:
        return self.steps.complete()

    # ---- resuming ------------------------------------------------------------------------------------

    def load_or_start(self) -> int | None:
        """Resume from the newest intact checkpoint (or checkpoint.load_step, once). Without
        checkpoint.enable only a stop's save is resumed from. Returns the step resumed from, or None:
        then the run starts afresh (or from checkpoint.initial_load_path's weights: the trainer's)."""
        for step in self.steps.incomplete():
            if self.is_main:
                logger.warning(f"ignoring {self.step_dir(step)}.tmp: a save that never completed")
        if self.sharded:  # rank 0 read the dump folder's run: every rank decides a resume alike
            box = [self.folder_run]
            dist.broadcast_object_list(box, src=0, group=self.cpu_group)
            self.folder_run = box[0]
        try:
            return self._load_or_start()
        finally:
            resumed = None if self.resumed_from is None else self._record(self.resumed_from).get("run", {})
            self.run.run_id = run_after_load(resumed, self.folder_run, self.branched)

    def _load_or_start(self) -> int | None:
        steps = self.steps.complete()
        if not self.cfg.enable:
            if steps and self._record(steps[-1]).get("preemption"):
                self._resume([steps[-1]])
                self.preemption_save = steps[-1]
                if self.is_main:
                    logger.info(f"{self.step_dir(steps[-1])} is the save of a stopped run: resumed from it (once "
                                f"this run completes it is removed; to start over instead, remove it)")
            return self.resumed_from
        if not steps and self.steps.damaged():
            raise CheckpointError(
                f"every checkpoint in {self.folder} is damaged ({', '.join(self.steps.damaged())}): nothing to "
                f"resume from; to start afresh, move them out of the folder or use another --checkpoint.folder")
        load_step = self.cfg.load_step
        if load_step >= 0:
            newest = steps[-1] if steps else -1
            if newest > load_step and self._record(newest).get("run", {}).get("load_step") == load_step:
                # An earlier attempt of this run applied load_step and saved since: that save wins.
                if self.is_main:
                    logger.info(f"checkpoint.load_step = {load_step} was applied by an earlier attempt of this "
                                f"run, which saved step {newest} since: resuming from the newest")
                self.run.load_step = load_step
                self._resume(steps[::-1])
            elif load_step not in steps:
                raise CheckpointMismatch(
                    f"checkpoint.load_step = {load_step}: no complete checkpoint {self.step_dir(load_step)} "
                    f"(complete steps in {self.folder}: {', '.join(map(str, steps)) or 'none'})")
            else:
                self.run.load_step = load_step
                self._resume([load_step])
        elif steps:
            self._resume(steps[::-1])
        return self.resumed_from

    def _verify(self, step: int) -> tuple[str, str]:
        """(kind, problem) of the manifest gate for step-N, the same on every rank: each rank checks
        its share of the files, rank 0 the manifest's signature too (every rank does: it is cheap)."""
        path = self.step_dir(step)
        names = sorted(self._listed(path))
        # Rank 0 verifies the manifest's signature (its key signed it); every rank checks its share of
        # the files against that manifest.
        finding = inspect(path, names[self.rank::self.world], check_signature=self.rank == 0, step=step)
        result = (finding.kind, finding.problem)
        if self.sharded:
            results: list = [None] * self.world
            dist.all_gather_object(results, result, group=self.cpu_group)
            result = next((r for r in results if r[0] == "forged"), None) or \
                next((r for r in results if r[0] != "ok"), result)
        return result

    @staticmethod
    def _listed(path: str) -> dict:
        return (read_manifest(path) or {}).get("files", {})

    def _resume(self, candidates: list[int]) -> None:
        """Load the first intact step of `candidates`; set damaged ones aside, then later ones."""
        for step in candidates:
            kind, problem = self._verify(step)
            other = None
            if kind == "forged":
                raise CheckpointError(f"{problem}; nothing was loaded or changed (a checkpoint edited after its "
                                      f"save is not resumed from)")
            if kind == "ok":
                other = other_run(self._record(step).get("run", {}), self.folder_run, self.step_dir(step),
                                  self.run.dump_folder)
                if other and self.cfg.load_step != step:
                    raise CheckpointMismatch(
                        f"{other}: another run's checkpoint is resumed from only when named: pass "
                        f"--checkpoint.load_step {step} to branch this run from it, or move it out of {self.folder}")
                if other and self.is_main:
                    logger.info(f"{other}: branching from it (checkpoint.load_step = {step}) as a new run; the "
                                f"dump folder's records of its earlier run move to earlier-runs/")
                try:
                    self._load(step)
                except (Exception, CheckpointException) as e:
                    # Every byte matched its checksum: not damage, so never set aside (folder.unloadable).
                    why = unloadable(self.step_dir(step), e)
                    if why is None:
                        raise
                    raise CheckpointError(why) from None
            if kind == "ok":
                self.resumed_from, self.branched = step, bool(other)
                self._set_aside_later(step)
                return
            aside = self._set_aside(step, "damaged")
            if self.is_main:
                logger.warning(f"checkpoint damaged: {problem}; set aside as {aside}")
            if self.cfg.load_step == step:
                raise CheckpointError(f"checkpoint.load_step = {step}: {problem}")
            if self.is_main and step != candidates[-1]:
                logger.warning(f"falling back to the newest intact checkpoint before step {step}")
        raise CheckpointError(f"no intact checkpoint in {self.folder}: steps {', '.join(map(str, candidates))} are "
                              f"damaged (set aside as step-N.damaged); to start afresh, move them out of the folder "
                              f"or use another --checkpoint.folder")

    def _set_aside(self, step: int, why: str) -> str:
        """Rename step-N so that it is never loaded again, keeping its bytes."""
        target = self.steps.aside_name(step, why)
        self.steps.set_aside(step, target)
        self.writer.barrier()
        return target

    def _set_aside_later(self, step: int) -> None:
        """A resume from an older step starts a new branch: the later checkpoints must never be resumed
        from again (nor count for keep_latest_k), but their bytes stay."""
        self.writer.barrier()  # every rank lists the folder before rank 0 renames anything in it
        later = [s for s in self.steps.complete() if s > step]
        names = [os.path.basename(self._set_aside(s, "abandoned")) for s in later]
        if names and self.is_main:
            logger.warning(f"resumed from step {step}: set aside the later checkpoints as {', '.join(names)} "
                           f"(never resumed from again; delete them when you no longer need them)")

    def _record(self, step: int) -> dict:
        """trainer_state.json of step-N (JSON, read through the gate's file checks), in today's layout."""
        try:
            record = fs.read_json(os.path.join(self.step_dir(step), TRAINER_STATE), "the trainer state")
        except UserError:
            return {}
        if not isinstance(record, dict):
            return {}
        return record if "states" in record else from_earlier_layout(record, step, self.data.state_at)

    def _load(self, step: int, keep: tuple[str, ...] = ()) -> None:
        """Restore every state but those in `keep` (and, with `keep`, this rank's RNG) from step-N."""
        path, record = self.step_dir(step), self._record(step)
        saved_run = record.get("run", {})
        self._check_compatible(path, record)
        self._load_states(path, record.get("states", {}), keep)
        self.run.load_step = saved_run.get("load_step", -1) if self.run.load_step < 0 else self.run.load_step
        if keep:
            return
        how = self._restore_rng(path, saved_run)
        if self.is_main:
            logger.info(f"resumed from {path} at step {step} ({how})")
            self._say_changed_settings(saved_run.get("settings", {}))

    def _check_compatible(self, path: str, record: dict) -> None:
        """The model's shape, and what cannot change across a resume, against this run's; one line if not."""
        saved_run, run = record.get("run", {}), self.run
        # The RoPE base the weights trained with last: the stage of the checkpoint's data position.
        read = self.data.batches_in(record.get("states", {}).get("dataloader", {}))
        check_model_shape(self.states["model"].model, self.shape_after(read), path)
        for key, ours, option in (("optimizer", run.optimizer, "optimizer.name"),
                                  ("optimizer_state_dtype", run.optimizer_state_dtype, "optimizer.state_dtype"),
                                  ("global_batch", run.global_batch, "training.global_batch_size"),
                                  ("seed", run.seed, "job.seed")):
            theirs = saved_run.get(key, UNRECORDED if key == "optimizer" else None)
            if theirs is not None and theirs != ours:
                why = {"optimizer.name": f"one optimizer's state is not another's; or start a new run from its weights "
                                         f"alone: --checkpoint.initial_load_path {path} in a new --job.dump_folder",
                       "optimizer.state_dtype": "the moments cannot be converted",
                       "training.global_batch_size": "the LR schedule and data order depend on it",
                       "job.seed": "the data order depends on it"}[option]
                raise CheckpointMismatch(f"{path} was trained with {option} = {theirs}, this run has {ours}: resume "
                                         f"with --{option} {theirs} ({why})")
        check_tokenizer(path, self.step_files)

    def _load_states(self, path: str, json_states: dict, keep: tuple[str, ...]) -> None:
        """Each state but those in `keep`: its tensors from DCP, the rest from the trainer state's JSON."""
        saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        in_dcp = {key.split(".", 1)[0] for key in saved}  # the states this checkpoint saved with DCP
        tensor_states = {}
        for name, state in self.states.items():
            if name in keep or name not in in_dcp:
                continue
            sd = state.state_dict()
            if getattr(state, "partial_load", False):  # entries the checkpoint lacks (or shaped otherwise) start afresh
                sd = {k: v for k, v in sd.items()
                      if tuple(getattr(saved.get(f"{name}.{k}"), "size", ())) == tuple(v.shape)}
            if sd:
                tensor_states[name] = sd
        dcp.load(tensor_states, checkpoint_id=path, process_group=self.cpu_group, no_dist=not self.sharded)
        for name, state in self.states.items():
            if name in keep:
                continue
            if name in tensor_states:
                state.load_state_dict(tensor_states[name])
            elif name in json_states:
                state.load_state_dict(json_states[name])
            elif getattr(state, "partial_load", False):
                state.load_state_dict({})

    def _restore_rng(self, path: str, saved_run: dict) -> str:
        """This rank's RNG, where the checkpoint has it for the same data-parallel world; says which."""
        rng_file = os.path.join(path, RNG_FILE.format(self.rank))
        if saved_run.get("dp_world") == self.run.dp_world and os.path.isfile(rng_file):
            set_rng_state(fs.read_json(rng_file, "the RNG state"))
            return "data position and RNG restored"
        return (f"data position restored; RNG afresh: saved on {saved_run.get('dp_world')} data-parallel ranks, "
                f"now {self.run.dp_world}")

    def _say_changed_settings(self, before_settings: dict) -> None:
        """One line for each setting a resume changed (checkpoint value → config value)."""
        for line in changed_settings(before_settings, self.run.settings):
            logger.info(line)

    def restore(self, step: int) -> str:
        """A rollback: step-N's weights, optimizer, schedule and counters; the data position (and RNG)
        stay where they are. Returns the folder."""
        self.writer.wait_and_publish()  # a background save of a checked step lands first
        kind, problem = self._verify(step)
        if kind != "ok":
            raise CheckpointError(f"cannot roll back: {problem}")
        self._load(step, keep=("dataloader",))
        return self.step_dir(step)

    # ---- saving ---------------------------------------------------------------------------------------

    def before_update(self) -> None:
        """Before each optimizer step: a background save's copy of the tensors the update overwrites
        must be complete (a no-op without one in flight)."""
        self.writer.wait_for_staging()

    def due(self, step: int, *, last: bool, stop_request: int) -> Due:
        """After each training step, on every rank: the largest stop request of any rank (all must stop
        after the same step), and a background save that every rank finished is published (one small
        all-reduce per step). A save is due at the interval, at the last step and on a stop request."""
        flags = torch.tensor([stop_request, int(self.writer.writing)])
        if self.sharded:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.cpu_group)
        if not flags[1]:
            self.writer.wait_and_publish()  # every rank has finished writing: publish at the same step
        stop = int(flags[0])
        save = bool(stop) or (self.cfg.enable and (step % self.cfg.interval == 0 or last))
        return Due(save, stop, last)

    def save(self, step: int, due: Due) -> str:
        """Save step-N as `due` says (a stop's save, and the last step's, in the foreground); returns
        its folder. A stopping run's save is published before this returns."""
        self._save(step, final=due.last or bool(due.stop), preemption=bool(due.stop))
        if due.stop and not due.last:
            self.writer.wait_and_publish()
        return self.step_dir(step)

    def _save(self, step: int, final: bool, preemption: bool) -> None:
        if self.is_main:
            self._own_folder()  # a stop's save without checkpoint.enable: the folder is ours from now
        states = {name: state.state_dict() for name, state in self.states.items()}
        tensors = {name: sd for name, sd in states.items() if holds_tensors(sd)}
        # The stage the weights last trained in: its RoPE base.
        files = {MODEL_ARGS: asdict(self.shape_after(self.data.batches_in(states["dataloader"]))),
                 TRAINER_STATE: {"format": 2, "step": step, "preemption": preemption, "run": self.run.saved(),
                                 "states": {name: sd for name, sd in states.items() if name not in tensors}},
                 **self.step_files}
        background = self.cfg.async_mode != "disabled" and not final
        stall = self.writer.write(step, tensors, files, background)
        if preemption and not background and not self.cfg.enable and self.preemption_save not in (None, step):
            self._remove(self.preemption_save)  # superseded by this one
        if self.is_main:  # one line a save (a background save that fails later says so in its own)
            how = "saving in the background to" if background else "saved to"
            logger.info(f"checkpoint step {step}: {how} {self.step_dir(step)} (training stalled {stall:.2f}s)")

    def _remove(self, step: int) -> None:
        self.writer.barrier()
        if self.is_main:
            shutil.rmtree(self.step_dir(step), ignore_errors=True)
            logger.info(f"removed the preemption save {self.step_dir(step)}: this run got past it")

    # ---- the end -------------------------------------------------------------------------------------

    def close(self, completed: bool, publish: bool = True) -> None:
        """At the end of the run, however it ends: a background save in flight lands and is published
        (`publish`: every rank is here, so the collectives of publishing can run), or is left as
        step-N.tmp; a stop's save that this run resumed from and got past is removed (`completed`);
        the pinned buffers are freed and the folder unlocked."""
        try:
            if publish:
                self.writer.wait_and_publish()
            if completed and self.preemption_save is not None and not self.cfg.enable:
                self._remove(self.preemption_save)
        finally:
            self.writer.close()
            self.lock.release()
