"""Weights & Biases as a second metrics sink (`--metrics.enable_wandb`): the scalars TensorBoard gets, under
the same keys, written by the writer rank through MetricsLogger.

- W&B's files go to `<dump_folder>/wandb/`, beside the run's other records, so a run's history stays in one
  folder (and a fresh run into the folder moves them to earlier-runs/ with the rest: records/folder.py).
- The W&B run id is kept in `<dump_folder>/wandb/titanlike-run-id`: a resumed run continues that W&B run.
- Every record carries the training step as `step`, the x-axis of every chart (`define_metric`): W&B's own
  step counter only grows, so a resumed run re-logging the steps after its checkpoint would be dropped
  if the training step were W&B's step.
- W&B's own settings still come from its environment variables: WANDB_MODE (offline: no account, no
  network), WANDB_ENTITY, WANDB_API_KEY, ...

Plain Python at import (the preflight calls `check_installed`); wandb is imported when a run opens.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import secrets
import sys
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

from titanlike import fs
from titanlike.errors import UserError

INSTALL = "pip install 'titanlike[wandb]'"
ID_FILE = "titanlike-run-id"


def check_installed() -> None:
    """For the preflight and the trainer's start: one line when wandb is not there (nothing imported)."""
    if importlib.util.find_spec("wandb") is None:
        raise UserError(f"metrics.enable_wandb needs the wandb package, which is not installed: {INSTALL}")


class WandbSink:
    def __init__(self, dump_folder: str, project: str, name: str):
        try:
            import wandb
        except ImportError as e:
            raise UserError(f"metrics.enable_wandb: cannot import wandb ({e}): {INSTALL}") from None
        folder = os.path.join(dump_folder, "wandb")
        os.makedirs(folder, exist_ok=True)
        id_path = os.path.join(folder, ID_FILE)
        # A resumed run finds the id its first attempt stored (a fresh run moved the folder aside).
        run_id = _read(id_path) or secrets.token_hex(4)
        fs.write_text(id_path, run_id + "\n")
        config: dict[str, Any] = {}
        config_path = os.path.join(dump_folder, "config.toml")
        if os.path.isfile(config_path):
            with open(config_path, "rb") as f:
                config = tomllib.load(f)
        try:
            # console="off": W&B keeps away from stdout and stderr (the progress line, the one-line errors).
            self.run = wandb.init(project=project, name=name or os.path.basename(os.path.abspath(dump_folder)),
                                  dir=dump_folder, id=run_id, resume="allow", config=config,
                                  settings=wandb.Settings(console="off"))
        except Exception as e:  # not logged in, no network, a bad WANDB_* value: W&B's own errors
            raise UserError(f"metrics.enable_wandb: W&B could not start a run ({_one_line(e)}); log in with "
                            f"`wandb login`, or set WANDB_MODE=offline to write it under {folder} only") from None
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if scalars:
            self.run.log({"step": step, **scalars})

    def close(self) -> None:
        try:
            self.run.finish()
        except Exception as e:  # at exit: the run's own records are written; say what W&B may have lost
            logging.getLogger("titanlike").warning(f"W&B did not finish its run ({_one_line(e)}): its last "
                                                   f"records may be missing from {self.run.dir}")


def _read(path: str) -> str:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return ""
    return text if text.isalnum() else ""


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text[:300] or type(e).__name__
