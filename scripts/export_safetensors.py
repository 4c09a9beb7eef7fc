"""Export a training checkpoint to a Hugging Face Llama folder (safetensors + config.json).

    python scripts/export_safetensors.py outputs/debug/checkpoint/step-150 exported/ [--dtype bf16|fp32]

The step folder is a DCP checkpoint written by any number of ranks, with or without float8:
the model weights are read whole into a plain CPU model built from its model_args.json, so
no process group and no GPU are needed, and the optimizer state is never read. The result
loads in transformers' LlamaForCausalLM, and back into titanlike with
`--checkpoint.initial_load_path <out folder>`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from titanlike.errors import UserError  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def load_checkpoint_model(step_dir: str, trust_pickled_dcp: bool = False):
    """(ModelArgs, full CPU state dict under our parameter names) of a checkpoint step folder."""
    import torch.distributed.checkpoint as dcp

    from titanlike.checkpoint_manifest import check_trusted_dcp
    from titanlike.model import ModelArgs, Transformer

    if not os.path.isdir(step_dir):
        raise UserError(f"{step_dir}: no such folder")
    if step_dir.rstrip("/").endswith(".tmp"):
        raise UserError(f"{step_dir} is a save that never completed; export a complete step-N folder")
    has_meta = os.path.isfile(os.path.join(step_dir, ".metadata"))
    args_file = os.path.join(step_dir, "model_args.json")
    if not (has_meta and os.path.isfile(args_file)):
        steps = sorted((p for p in Path(step_dir).glob("step-*") if p.is_dir() and p.name[5:].isdigit()),
                       key=lambda p: int(p.name[5:]))
        if steps:
            raise UserError(f"{step_dir} holds checkpoints, it is not one: pass a step folder, e.g. {steps[-1]}")
        missing = ".metadata" if not has_meta else "model_args.json"
        raise UserError(f"{step_dir} is not a titanlike checkpoint step folder (no {missing})")
    try:
        with open(args_file) as f:
            margs = ModelArgs(**json.load(f))
    except (TypeError, ValueError) as e:
        raise UserError(f"{args_file} does not describe a model ({e})") from None

    # DCP's .metadata is a pickle: only from titanlike on this account, or with --trust-pickled-dcp.
    check_trusted_dcp(step_dir, trust_pickled_dcp, flag="--trust-pickled-dcp")
    with torch.device("meta"):
        model = Transformer(margs)
    model.to_empty(device="cpu")
    saved = dcp.FileSystemReader(step_dir).read_metadata().state_dict_metadata
    state = {}
    for name, tensor in model.state_dict().items():
        meta = saved.get(f"model.{name}")
        if meta is None:
            if margs.tie_embeddings and name == "output.weight":
                continue  # the same tensor as the embedding
            raise UserError(f"{step_dir} has no parameter {name}: model_args.json does not match its weights")
        if tuple(meta.size) != tuple(tensor.shape):
            raise UserError(f"{step_dir}: {name} is {tuple(meta.size)} in the checkpoint, "
                            f"{tuple(tensor.shape)} from model_args.json")
        state[name] = tensor
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled": expected, one process
        dcp.load({"model": state}, checkpoint_id=step_dir, no_dist=True)
    return margs, state


def export(step_dir: str, out_dir: str, dtype: torch.dtype, trust_pickled_dcp: bool = False) -> list[str]:
    from titanlike.interchange import write_hf_folder

    if os.path.isfile(os.path.join(out_dir, ".metadata")):
        raise UserError(f"{out_dir} is a checkpoint; the output must be another folder")
    margs, state = load_checkpoint_model(step_dir, trust_pickled_dcp)
    return write_hf_folder(state, margs, out_dir, dtype)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a checkpoint step folder, e.g. outputs/debug/checkpoint/step-150")
    p.add_argument("out", help="the Hugging Face folder to write")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                   help="dtype of the exported weights (default bf16; fp32 keeps the trained values exactly)")
    p.add_argument("--trust-pickled-dcp", action="store_true",
                   help="export a checkpoint that titanlike did not write on this account: its .metadata is a "
                        "Python pickle, and loading it can run any code its author put there")
    a = p.parse_args(argv)
    try:
        files = export(a.checkpoint, a.out, DTYPES[a.dtype], a.trust_pickled_dcp)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {a.checkpoint} to {a.out} ({a.dtype}): {', '.join(files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
