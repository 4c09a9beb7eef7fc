"""A new run's first weights (checkpoint.initial_load_path): a Hugging Face safetensors folder, or a
titanlike step folder (read through checkpoint/weights.py, which passes the manifest gate first)."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from titanlike.checkpoint.weights import is_dcp_folder, load_step_weights
from titanlike.hf.interchange import read_hf_folder
from titanlike.model.shape import ModelArgs

logger = logging.getLogger("titanlike")


def load_initial_weights(model: torch.nn.Module, margs: ModelArgs, path: str, *, trust_pickled_dcp: bool = False,
                         is_main: bool = True) -> None:
    """Model weights only, into the (possibly sharded) `model`; the optimizer and schedule start afresh."""
    if is_dcp_folder(path):
        load_step_weights(model, margs, path, trust_pickled_dcp=trust_pickled_dcp)
    else:
        full: dict[str, Any] = read_hf_folder(path, margs)
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))
    if is_main:
        logger.info(f"initial weights loaded from {path}")
