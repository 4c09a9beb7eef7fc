"""The pieces a checkpoint holds, each speaking torch's Stateful protocol (state_dict, load_state_dict).

The checkpoint manager wraps the model, optimizer and LR schedule in these, and takes the other
Stateful parts of a run as they are (the data loader, the float8 converter, the run's counters). A
state whose state_dict() holds tensors is saved with DCP (sharded: each rank writes its shards, and a
load reshards to any world size); one that holds only numbers is saved as JSON in trainer_state.json.
This rank's random number generators are saved per rank as JSON (rng-rank{R}.json).
"""

from __future__ import annotations

import base64
import random
from typing import Any, Protocol

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from titanlike.overrides.float8 import unwrap_weight


class ConverterState(Protocol):
    """What a checkpoint needs of a model converter (model/converter.py): its state, saved and restored as it
    is, after the weights; a checkpoint without its entry (or with another shape of it) loads as a fresh start
    (`partial_load`)."""

    partial_load: bool

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def plain_tensors(sd: dict) -> dict:
    """Float8 all-gather wraps weights in a tensor subclass; checkpoints hold plain tensors."""
    out = {}
    for k, v in sd.items():
        if isinstance(v, DTensor):
            local = v.to_local()
            plain, _ = unwrap_weight(local)
            if plain is not local:
                v = DTensor.from_local(plain, v.device_mesh, v.placements, shape=v.shape, stride=v.stride(),
                                       run_check=False)
        elif isinstance(v, torch.Tensor):
            v, _ = unwrap_weight(v)
        out[k] = v
    return out


class ModelState:
    """The model's parameters, sharded as they are (DCP reshards them on load)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, torch.Tensor]:
        return plain_tensors(get_model_state_dict(self.model))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state)


class OptimizerState:
    """The optimizer's per-parameter tensors (moments, momentum buffers, step counts). Its hyperparameters are
    not saved: a resumed run uses the configured ones (trainer_state.json records the old ones)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        return {"state": get_optimizer_state_dict(self.model, self.optimizer)["state"]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        current = get_optimizer_state_dict(self.model, self.optimizer)  # param_groups: this run's config
        current["state"] = state["state"]
        set_optimizer_state_dict(self.model, self.optimizer, current)


class SchedulerState:
    """The LR schedule's position: the updates done. A resume puts this run's schedule (its configured
    peak LR, warmup, decay and steps) at that position, so the LR settings may change on resume."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LambdaLR):
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, int]:
        return {"steps_done": int(self.scheduler.last_epoch)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from titanlike.optim import resume_schedule

        resume_schedule(self.scheduler, int(state["steps_done"]))


def holds_tensors(value: Any) -> bool:
    if isinstance(value, dict):
        return any(holds_tensors(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(holds_tensors(v) for v in value)
    return isinstance(value, torch.Tensor)


# ---- this rank's random number generators, as JSON --------------------------------------------------


def rng_state() -> dict:
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


def set_rng_state(state: dict) -> None:
    version, keys, gauss = state["python"]
    random.setstate((version, tuple(keys), gauss))
    name, np_keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(np_keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_bytes_tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(_bytes_tensor(state["cuda"]))
