"""How one step folder is written and published: in the foreground or the background, into
step-N.tmp, then every rank's files checksummed, the signed manifest written last, and one rename to
step-N. A failure at any point is one CheckpointError line naming the cause, and the previous
checkpoint stays intact. When to save is the manager's decision (manager.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from titanlike import fs
from titanlike.checkpoint.folder import StepFolders, failure_cause
from titanlike.checkpoint.manifest import MANIFEST, describe_files, owner, write_manifest
from titanlike.checkpoint.staging import HostCopyStager
from titanlike.checkpoint.states import rng_state
from titanlike.errors import UserError

logger = logging.getLogger("titanlike")

RNG_FILE = "rng-rank{}.json"


class CheckpointError(UserError):
    pass


def tensor_bytes(value: Any) -> int:
    """Bytes of the tensors (a DTensor's local shard) in nested dicts and lists of a state."""
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(tensor_bytes(v) for v in value)
    if isinstance(value, torch.Tensor):
        local = value.to_local() if hasattr(value, "to_local") else value
        return local.numel() * local.element_size()
    return 0


class StepWriter:
    """Writes step folders into `steps`; one background save in flight at a time. Collectives run on
    `group` (the main thread's) and `save_group` (a background save's own). `keep_latest_k`: the
    complete steps kept (0: all); `pinned`: background saves copy to pinned host buffers of ours."""

    def __init__(self, steps: StepFolders, *, keep_latest_k: int, pinned: bool, rank: int, world: int, group,
                 save_group, cuda: bool, eight_bit: bool):
        self.steps, self.keep_latest_k, self.pinned, self.rank, self.world = steps, keep_latest_k, pinned, rank, world
        self.group, self.save_group, self.cuda, self.eight_bit = group, save_group, cuda, eight_bit
        self.is_main, self.sharded = rank == 0, world > 1
        # (step, future) of a background save: the upload, then this rank's checksums of what it wrote
        self.pending: tuple[int, Future] | None = None
        self.staging: Future | None = None  # its host copy, which the next update must wait for
        self.stager: HostCopyStager | None = None  # pinned host buffers kept from one save to the next
        self.checksummer: ThreadPoolExecutor | None = None  # checksums a background save's files once written
        self.estimate_mb = 0.0  # what the save under way takes, about: the failure line of a first save says it

    def barrier(self) -> None:
        """All ranks here (on the main thread's group; the manager's barriers too)."""
        if self.sharded:
            dist.barrier(group=self.group)

    @property
    def writing(self) -> bool:
        """A background save is still writing (or checksumming what it wrote) on this rank."""
        return self.pending is not None and not self.pending[1].done()

    def write(self, step: int, tensors: dict, files: dict[str, Any], background: bool) -> float:
        """Save step-N: `tensors` with DCP, `files` (name → JSON, or text as it is; rank 0's) beside them,
        this rank's RNG.
        In the background, only the copy to host memory stalls training. Returns the stall in seconds."""
        start = time.perf_counter()
        self.estimate_mb = tensor_bytes(tensors) * self.world / 2**20  # ranks hold shards of one size
        self.wait_and_publish()  # one save in flight at a time
        tmp = self.steps.step_dir(step) + ".tmp"
        try:
            if self.is_main:
                if self.keep_latest_k:  # room for the new one first (0 keeps every checkpoint)
                    self.steps.prune(keep=self.keep_latest_k - 1, below=step)
                shutil.rmtree(tmp, ignore_errors=True)  # a previous attempt at this step that died
                os.makedirs(tmp)
                for name, value in files.items():
                    if isinstance(value, str):
                        fs.write_text(os.path.join(tmp, name), value)
                    else:
                        fs.write_json(os.path.join(tmp, name), value)
            self.barrier()
            fs.write_json(os.path.join(tmp, RNG_FILE.format(self.rank)), rng_state())
        except (OSError, UserError) as e:
            self._fail(step, e)
        try:
            if background:
                self.pending = (step, self._async_save(tensors, tmp))
            else:
                dcp.save(tensors, checkpoint_id=tmp, process_group=self.group, no_dist=not self.sharded)
                self._publish(step)
        except (Exception, CheckpointException) as e:  # DCP's exception is a BaseException
            self._fail(step, e)
        return time.perf_counter() - start

    def _async_save(self, state: dict, tmp: str) -> Future:
        """Start a background save; returns the future of this rank's checksums of what it wrote, which
        follow the upload (the files written) in a thread of their own."""
        kwargs: dict = {"checkpoint_id": tmp, "process_group": self.save_group, "no_dist": not self.sharded}
        pinned = self.cuda and self.pinned
        if pinned or self.eight_bit:
            # titanlike's stager (staging.py): pinned buffers kept between saves, copied on a side
            # stream while training goes on; and torchao's 8-bit state, which DCP cannot copy.
            if self.stager is None:
                self.stager = HostCopyStager(pinned=pinned)
            kwargs["async_stager"] = self.stager
        result = dcp.async_save(state, **kwargs)
        if isinstance(result, Future):
            upload = result
        else:  # a stager that stages in the background: torch returns the staging and the upload futures
            self.staging = result.staging_completion
            upload = result.upload_completion
        # Reading every file back for its checksum took a fifth to a third of a save
        # (docs/benchmarks/2026-12-02-checkpoint-hash-cost.md): done here, off the training thread, the
        # publish at a later step only gathers the results.
        if self.checksummer is None:
            self.checksummer = ThreadPoolExecutor(1, thread_name_prefix="titanlike-checksum")
        return self.checksummer.submit(self._checksums_after, upload, tmp)

    def _checksums_after(self, upload: Future[Any], tmp: str) -> dict[str, Any]:
        upload.result()  # what the upload raised, the publish raises
        return self._my_checksums(tmp)

    def _my_checksums(self, tmp: str) -> dict[str, Any]:
        """Size and checksums of the files of step-N.tmp that this rank wrote (manifest.owner). Complete once
        this rank's part of the save is: DCP's coordinator (rank 0) writes `.metadata` before its save returns."""
        try:
            names = sorted(os.listdir(tmp))
            return describe_files(tmp, [n for n in names if owner(n, self.world) == self.rank])
        except OSError as e:
            return {"error": f"{e.strerror}: {e.filename}"}  # this rank's failure, for all to see

    def wait_for_staging(self) -> None:
        """Before each optimizer step: a background copy of the tensors the update overwrites must be
        complete."""
        if self.staging is not None:
            start = time.perf_counter()
            self.staging.result()
            self.staging = None
            waited = time.perf_counter() - start
            if self.is_main and waited > 0.01:
                logger.info(f"the update waited {waited:.2f}s for the checkpoint's copy to host memory")

    def wait_and_publish(self) -> None:
        """Wait for a background save in flight, then publish it (make step-N visible)."""
        if self.pending is None:
            return
        step, future = self.pending
        self.pending = None
        try:
            mine = future.result()
        except (Exception, CheckpointException) as e:
            self._fail(step, e)
        self._publish(step, mine)

    def _publish(self, step: int, mine: dict[str, Any] | None = None) -> None:
        """All ranks have written: gather every rank's checksums of its files (`mine`, made in the
        background; else made here), write the signed manifest, make the checkpoint visible by one
        rename, then prune old ones."""
        self.barrier()
        tmp = self.steps.step_dir(step) + ".tmp"
        if mine is None:
            mine = self._my_checksums(tmp)
        parts: list[Any] = [mine]
        if self.sharded:
            parts = [None] * self.world
            dist.all_gather_object(parts, mine, group=self.group)
        failed: BaseException | None = None
        if self.is_main:
            try:
                if any("error" in p for p in parts):
                    raise OSError(next(p["error"] for p in parts if "error" in p))
                write_manifest(tmp, step, {k: v for p in parts for k, v in p.items() if k != MANIFEST})
                final = self.steps.step_dir(step)
                if os.path.exists(final):
                    shutil.rmtree(final)
                os.replace(tmp, final)
                if self.keep_latest_k:
                    self.steps.prune(keep=self.keep_latest_k, below=step + 1)
            except (OSError, UserError) as e:
                failed = e
        flag = torch.tensor([int(failed is not None)])
        if self.sharded:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if flag.item():
            self._fail(step, failed or OSError("rank 0 could not publish the checkpoint"))

    def _fail(self, step: int, e: BaseException) -> None:
        if self.is_main:
            shutil.rmtree(self.steps.step_dir(step) + ".tmp", ignore_errors=True)
        previous = [s for s in self.steps.complete() if s != step]
        kept = (f"the previous checkpoint {self.steps.step_dir(previous[-1])} is intact" if previous
                else "no earlier checkpoint exists")
        size = self.steps.size_mb(previous[-1]) if previous else self.estimate_mb
        cause = failure_cause(e, self.steps.folder, self.keep_latest_k, size, on_disk=len(previous))
        raise CheckpointError(f"saving the checkpoint of step {step} to {self.steps.folder} failed: {cause}; "
                              f"{kept}") from None

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()
            self.stager = None
        if self.checksummer is not None:  # a save left unpublished stays step-N.tmp: nothing to wait for here
            self.checksummer.shutdown(wait=False, cancel_futures=True)
            self.checksummer = None
