"""Model weights out of a checkpoint step folder, for a new run (`checkpoint.initial_load_path`), the
export and generation; and the check that a step folder holds this run's model. This is the one
reader of step folders outside the checkpoint manager.

Every path opens the folder through the manifest gate first (manifest.inspect / check_readable):
nothing of a folder is unpickled before its manifest and bytes pass.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from titanlike import fs
from titanlike.checkpoint.manifest import TRUST_FLAG, check_readable
from titanlike.checkpoint.states import ModelState
from titanlike.errors import UserError
from titanlike.model.shape import ModelArgs, args_from_json, shape_difference

MODEL_ARGS = "model_args.json"


class CheckpointMismatch(UserError):
    """The checkpoint on disk does not fit this run; every rank reads the same files, rank 0 reports."""

    same_on_all_ranks = True


def saved_tensors(path: str) -> dict:
    """The tensor names and sizes DCP recorded (its .metadata: call only after the gate passed)."""
    return dcp.FileSystemReader(path).read_metadata().state_dict_metadata


def check_model_shape(model: torch.nn.Module, margs: ModelArgs, path: str) -> None:
    """Name the first mismatching field or parameter rather than let DCP fail deep inside."""
    args_file = os.path.join(path, MODEL_ARGS)
    saved_args = fs.read_json(args_file, "the checkpoint's model shape") if os.path.isfile(args_file) else None
    if isinstance(saved_args, dict) and margs.tie_embeddings and not saved_args.get("tie_embeddings", False):
        # Both names are in a tied model's state dict: an untied checkpoint would load its
        # embedding and its output layer into the one shared tensor, the last one winning.
        raise CheckpointMismatch(f"{path} was saved with untied embeddings (an output layer of its own); "
                                 f"run with --model.tie_embeddings false")
    meta = saved_tensors(path)
    # DCP types a state dict's values broadly (tensors, numbers, strings, containers); a model's holds tensors.
    params = cast("dict[str, torch.Tensor]", get_model_state_dict(model))
    for name, tensor in params.items():
        saved = meta.get(f"model.{name}")
        if saved is None and name.endswith("attention.wqkv.weight") and f"model.{name.replace('wqkv', 'wq')}" in meta:
            # Earlier titanlike versions had three Linears (wq, wk, wv). Hugging Face folders hold them
            # apart too, and import stacks them: that is the way across.
            raise CheckpointMismatch(
                f"{path} was saved by an earlier titanlike, with separate wq/wk/wv projections (now one stacked "
                f"wqkv): export it with that version's scripts/export_safetensors.py and start from the export "
                f"with --checkpoint.initial_load_path")
        if not isinstance(saved, TensorStorageMetadata):  # absent (None), or saved as bytes: not a tensor
            raise CheckpointMismatch(f"{path} has no parameter {name}: it was saved from a different model")
        if tuple(saved.size) != tuple(tensor.shape):
            raise CheckpointMismatch(
                f"{path} was saved from a different model shape: {name} is {tuple(saved.size)} there, "
                f"{tuple(tensor.shape)} here (check --model.flavor / --model.vocab_size)"
            )
    if isinstance(saved_args, dict):
        # Same tensor shapes can hold another model (8 heads × 32 or 4 × 64; another rope_theta).
        diff = shape_difference(saved_args, margs)
        if diff:
            raise CheckpointMismatch(f"{path} was saved from a different model shape: {diff} "
                                     f"(resume with the [model] options it was trained with)")


def is_dcp_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, ".metadata")) or os.path.isfile(os.path.join(path, "manifest.json"))


def load_step_weights(model: torch.nn.Module, margs: ModelArgs, path: str, *, trust_pickled_dcp: bool = False,
                      process_group=None) -> None:
    """Model weights only, for a new run, from a DCP step folder that passes the gate
    (manifest.check_readable); resharded to this run's ranks."""
    check_readable(path, trust_pickled_dcp)
    check_model_shape(model, margs, path)
    state: dict[str, Any] = {"model": ModelState(model).state_dict()}
    dcp.load(state, checkpoint_id=path, process_group=process_group, no_dist=not dist.is_initialized())
    set_model_state_dict(model, state["model"])


def _newest_step(folder: str) -> str | None:
    """The newest step-N folder in `folder` that is complete (its .metadata and model shape written), else
    the newest step-N of any kind, else None."""
    try:
        steps = sorted((p for p in os.scandir(folder) if p.is_dir() and p.name.startswith("step-")
                        and p.name[5:].isdigit()), key=lambda p: int(p.name[5:]))
    except OSError:
        return None
    intact = [p for p in steps if all(os.path.isfile(os.path.join(p.path, n)) for n in (".metadata", MODEL_ARGS))]
    return (intact or steps)[-1].path if steps else None


def step_folder_problem(step_dir: str) -> str | None:
    """Why `step_dir` is not a step folder to read weights from (a message), or None."""
    if not os.path.isdir(step_dir):
        return f"{step_dir}: {fs.not_a_folder(step_dir)}"
    if step_dir.rstrip("/").endswith(".tmp"):
        return f"{step_dir} is a save that never completed; use a complete step-N folder"
    if not (is_dcp_folder(step_dir) and os.path.isfile(os.path.join(step_dir, MODEL_ARGS))):
        newest = _newest_step(step_dir)
        if newest:
            return f"{step_dir} holds checkpoints, it is not one: pass a step folder, e.g. {newest}"
        # A run's dump folder: its checkpoint folder (checkpoint.folder, "checkpoint" by default) is inside.
        for sub in sorted(p.path for p in os.scandir(step_dir) if p.is_dir() and not p.is_symlink()):
            newest = _newest_step(sub)
            if newest:
                return f"{step_dir} is a run folder, not a checkpoint: pass a step folder, e.g. {newest}"
        missing = MODEL_ARGS if is_dcp_folder(step_dir) else ".metadata"
        return f"{step_dir} is not a titanlike checkpoint step folder (no {missing})"
    return None


def step_model_args(step_dir: str) -> ModelArgs:
    """The model shape a step folder records (model_args.json), read through the gate's file checks: one
    UserError line for a file that does not describe a model titanlike builds."""
    args_file = os.path.join(step_dir, MODEL_ARGS)
    try:
        return args_from_json(fs.read_json(args_file, "the checkpoint's model shape"), args_file)
    except ValueError as e:
        raise UserError(f"{e}; it does not describe a model titanlike builds") from None


def read_model_weights(step_dir: str, trust_pickled_dcp: bool = False, flag: str = TRUST_FLAG
                       ) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """(ModelArgs, full CPU fp32 state dict under our parameter names) of a checkpoint step folder
    written by any number of ranks, with or without float8; no process group, no GPU. `flag` is how
    the calling command spells the trust option (for its message)."""
    from titanlike.model.decoder import Transformer

    problem = step_folder_problem(step_dir)
    if problem:
        raise UserError(problem)
    check_readable(step_dir, trust_pickled_dcp, flag)
    margs = step_model_args(step_dir)
    with torch.device("meta"):
        model = Transformer(margs)
    model.to_empty(device="cpu")
    try:
        saved = saved_tensors(step_dir)
    except Exception as e:  # a trusted but broken .metadata: DCP's own error, in one line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise UserError(f"{step_dir}/.metadata cannot be read ({type(e).__name__}: {first})") from None
    state = {}
    for name, tensor in model.state_dict().items():
        meta = saved.get(f"model.{name}")
        if not isinstance(meta, TensorStorageMetadata):  # absent, or bytes: not a parameter
            if margs.tie_embeddings and name == "output.weight":
                continue  # the same tensor as the embedding
            raise UserError(f"{step_dir} has no parameter {name}: {MODEL_ARGS} does not match its weights")
        if tuple(meta.size) != tuple(tensor.shape):
            raise UserError(f"{step_dir}: {name} is {tuple(meta.size)} in the checkpoint, "
                            f"{tuple(tensor.shape)} from {MODEL_ARGS}")
        state[name] = tensor
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled": expected, one process
        dcp.load({"model": state}, checkpoint_id=step_dir, no_dist=True)
    return margs, state


def check_tokenizer(path: str, run_files: dict[str, str]) -> None:
    """The tokenizer step folder `path` trained with (its copy of tokenizer.json) against the run's data's
    (`run_files`, as the run leaves them in each step: data/tokenizer.py run_tokenizer_files): with another, every
    token id means other text, and a vocabulary of the same size hides it from the shape check. A checkpoint or
    data without a tokenizer record says nothing either way."""
    ours, saved = run_files.get("tokenizer.json"), os.path.join(path, "tokenizer.json")
    if ours is None or not os.path.isfile(saved) or fs.read_text(saved, "the checkpoint's tokenizer") == ours:
        return

    info = os.path.join(path, "tokenizer_info.json")
    texts = {"theirs": fs.read_text(saved, "the checkpoint's tokenizer"), "here": ours}
    words = {"theirs": _tokenizer_words(fs.read_text(info, "the checkpoint's record") if os.path.isfile(info) else ""),
             "here": _tokenizer_words(run_files.get("tokenizer_info.json", ""))}
    if words["theirs"] == words["here"]:  # two of one kind (and one dataset.json): told apart by their files
        words = {k: f"{w} (tokenizer.json {_digest(texts[k])})" for k, w in words.items()}
    raise CheckpointMismatch(
        f"{path} was trained with {words['theirs']}, but the run's data were made with {words['here']}: each token "
        f"id would mean other text; resume with the data it trained on, or start a new run from these weights with "
        f"--checkpoint.initial_load_path {path}")


def _tokenizer_words(info: str) -> str:
    """A tokenizer in words, from its tokenizer_info.json: its kind, and the dataset.json it came with."""
    try:
        record = json.loads(info)
        kind, dataset = str(record.get("kind", "unknown")), record.get("dataset")
    except (ValueError, AttributeError):
        kind, dataset = "unknown", None
    if kind == "byte":
        return "the byte tokenizer"
    what = "a Hugging Face tokenizer" if kind == "huggingface" else "a tokenizer of unknown kind"
    return f"{what} from {dataset}" if isinstance(dataset, str) and dataset else what


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]
