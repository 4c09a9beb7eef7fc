"""Test-only fault injection: TITANLIKE_NAN_BATCHES="7,9" makes the training loss that rank 0 computes
on global batches 7 and 9 (numbered from 1 in data order: batch s feeds step s until a rollback skips
some) NaN, as a diverging step's would; its gradients, and so the global gradient norm, follow. Read
at each loss, so a test may set or clear it between runs; unset, nothing happens.

titanlike itself knows nothing of it: conftest.py installs it into the test process, and
sitecustomize.py beside this file into every process a test starts (conftest puts this folder on
their PYTHONPATH).
"""

from __future__ import annotations

import os
import sys

ENV = "TITANLIKE_NAN_BATCHES"


def listed() -> frozenset[int]:
    raw = os.environ.get(ENV, "")
    return frozenset(int(b) for b in raw.split(",") if b.strip())


def poisoned(loss_fn, reading: dict):
    """`loss_fn` whose training losses (gradients on) on rank 0 are NaN while `reading["batch"]` is listed."""
    import torch
    import torch.distributed as dist

    def loss_with_injected_nans(*args, **kwargs):
        loss = loss_fn(*args, **kwargs)
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        if torch.is_grad_enabled() and rank0 and reading["batch"] in listed():
            return loss * float("nan")
        return loss

    return loss_with_injected_nans


def install() -> None:
    """Patch the training loader (which global batch is being read) and build_loss (the training loss)."""
    from titanlike.data import loader
    from titanlike.model import loss as loss_module

    if getattr(loader.TrainLoader, "nan_probe", False):
        return
    reading = {"batch": 0}
    plain_next, plain_build = loader.TrainLoader.__next__, loss_module.build_loss

    def next_micro_batch(self):
        reading["batch"] = self.batches_read + 1  # the global batch this micro-batch belongs to
        return plain_next(self)

    def build_loss(*args, per_token=False, **kwargs):
        if per_token:  # a mixture's per-source reading: the training loss beside it is the one poisoned
            return plain_build(*args, per_token=True, **kwargs)
        return poisoned(plain_build(*args, **kwargs), reading)

    loader.TrainLoader.__next__ = next_micro_batch  # type: ignore[method-assign]
    loader.TrainLoader.nan_probe = True  # type: ignore[attr-defined]
    loss_module.build_loss = build_loss
    train = sys.modules.get("titanlike.train")
    if train is not None:  # imported already: it holds build_loss under its own name
        train.build_loss = build_loss  # type: ignore[attr-defined]
