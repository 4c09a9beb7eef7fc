"""titanlike-export: a training checkpoint to a Hugging Face folder that transformers loads.

    titanlike-export outputs/debug/checkpoint/step-150 exported/ [--dtype bf16|fp32] [--tokenizer ...]

The step folder is a DCP checkpoint written by any number of ranks, with or without float8: the
model weights are read whole into a plain CPU model built from its model_args.json, so no process
group and no GPU are needed, and the optimizer state is never read. The folder holds
model.safetensors, config.json (LlamaForCausalLM, or Qwen3ForCausalLM for a QK-norm model, with
bos/eos ids), generation_config.json and the tokenizer (tokenizer.json, tokenizer_config.json):
`AutoModelForCausalLM` and `AutoTokenizer` load it, and titanlike reads it back with
`--checkpoint.initial_load_path`.

The tokenizer is the one the run trained with: the tokenizer.json that titanlike-train left in the
run folder (from the data's dataset.json, or the byte tokenizer of the built-in corpus), found next
to the checkpoint folder; --tokenizer names another (a tokenizer.json, a prepared data folder, or
'byte').
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

from titanlike.errors import UserError

DTYPES = ("bf16", "fp32")


def check_trusted(step_dir: str, trust_pickled_dcp: bool = False) -> None:
    """The one place where export (and generate) decide whether a step folder is a complete titanlike
    checkpoint that may be read: its .metadata is a pickle, so it must be one titanlike wrote on this
    account (a signed manifest), unless the user trusts it (--trust-pickled-dcp)."""
    if not os.path.isdir(step_dir):
        raise UserError(f"{step_dir}: no such folder")
    if step_dir.rstrip("/").endswith(".tmp"):
        raise UserError(f"{step_dir} is a save that never completed; export a complete step-N folder")
    has_meta = os.path.isfile(os.path.join(step_dir, ".metadata"))
    if not (has_meta and os.path.isfile(os.path.join(step_dir, "model_args.json"))):
        steps = sorted((p for p in Path(step_dir).glob("step-*") if p.is_dir() and p.name[5:].isdigit()),
                       key=lambda p: int(p.name[5:]))
        if steps:
            raise UserError(f"{step_dir} holds checkpoints, it is not one: pass a step folder, e.g. {steps[-1]}")
        missing = ".metadata" if not has_meta else "model_args.json"
        raise UserError(f"{step_dir} is not a titanlike checkpoint step folder (no {missing})")
    from titanlike.checkpoint_manifest import check_trusted_dcp

    check_trusted_dcp(step_dir, trust_pickled_dcp, flag="--trust-pickled-dcp")


def load_checkpoint_model(step_dir: str, trust_pickled_dcp: bool = False):
    """(ModelArgs, full CPU state dict under our parameter names) of a checkpoint step folder."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from titanlike.model import ModelArgs, Transformer

    check_trusted(step_dir, trust_pickled_dcp)
    args_file = os.path.join(step_dir, "model_args.json")
    try:
        with open(args_file) as f:
            margs = ModelArgs(**json.load(f))
    except (TypeError, ValueError) as e:
        raise UserError(f"{args_file} does not describe a model ({e})") from None

    with torch.device("meta"):
        model = Transformer(margs)
    model.to_empty(device="cpu")
    saved = dcp.FileSystemReader(step_dir).read_metadata().state_dict_metadata
    state = {}
    for name, tensor in model.state_dict().items():
        meta = saved.get(f"model.{name}")
        if not isinstance(meta, TensorStorageMetadata):  # absent, or bytes: not a parameter
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


def find_run_tokenizer(step_dir: str) -> str | None:
    """The folder holding the tokenizer.json of the run that wrote this step folder: the step folder
    itself, its checkpoint folder, or the run folder above (where titanlike-train leaves it)."""
    here = Path(step_dir).resolve()
    for folder in (here, here.parent, here.parent.parent):
        if (folder / "tokenizer.json").is_file():
            return str(folder)
    return None


def run_tokenizer(step_dir: str, choice: str, vocab_size: int):
    """The tokenizer to ship with an export of `step_dir` (see the module docstring)."""
    from titanlike.tokenizer import ByteTokenizer, load_tokenizer, tokenizer_from_folder

    if choice:
        if os.path.isdir(choice) and not os.path.isfile(os.path.join(choice, "tokenizer.json")):
            raise UserError(f"--tokenizer {choice}: that folder has no tokenizer.json")
        tok = tokenizer_from_folder(choice) if os.path.isdir(choice) else load_tokenizer(choice)
    else:
        folder = find_run_tokenizer(step_dir)
        if folder is None:
            print(f"note: no tokenizer.json next to {step_dir}: the byte tokenizer is assumed "
                  f"(--tokenizer names another)", file=sys.stderr)
            tok = ByteTokenizer()
        else:
            tok = tokenizer_from_folder(folder)
    if tok.vocab_size > vocab_size:
        raise UserError(f"the tokenizer has {tok.vocab_size} ids but the model only {vocab_size}: "
                        f"it is not the tokenizer this model was trained with (choose one with --tokenizer)")
    return tok


def export(step_dir: str, out_dir: str, dtype: str = "bf16", tokenizer: str = "",
           trust_pickled_dcp: bool = False) -> tuple[list[str], str]:
    """Write the Hugging Face folder; returns (the files written, the architecture)."""
    import torch

    from titanlike.interchange import set_file_modes, write_hf_folder, write_tokenizer_files

    if os.path.isfile(os.path.join(out_dir, ".metadata")):
        raise UserError(f"{out_dir} is a checkpoint; the output must be another folder")
    check_trusted(step_dir, trust_pickled_dcp)
    with open(os.path.join(step_dir, "model_args.json")) as f:
        vocab = int(json.load(f).get("vocab_size", 0))
    tok = run_tokenizer(step_dir, tokenizer, vocab)  # before the weights: a wrong choice costs nothing
    margs, state = load_checkpoint_model(step_dir, trust_pickled_dcp)
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    files = write_hf_folder(state, margs, out_dir, torch_dtype, bos_id=tok.bos_id, eos_id=tok.eos_id)
    files += write_tokenizer_files(out_dir, tok.to_json(), (tok.bos_token, tok.bos_id), (tok.eos_token, tok.eos_id),
                                   margs.max_seq_len)
    set_file_modes(out_dir, files)
    return files, "Qwen3ForCausalLM" if margs.qk_norm else "LlamaForCausalLM"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="titanlike-export", description=__doc__.split("\n\n")[0],
                                epilog="\n\n".join(__doc__.split("\n\n")[2:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a checkpoint step folder, e.g. outputs/debug/checkpoint/step-150")
    p.add_argument("out", help="the Hugging Face folder to write")
    p.add_argument("--dtype", choices=DTYPES, default="bf16",
                   help="dtype of the exported weights (default bf16; fp32 keeps the trained values exactly)")
    p.add_argument("--tokenizer", default="",
                   help="the tokenizer to ship: a tokenizer.json, a folder holding one, or 'byte' (default: the run's)")
    p.add_argument("--trust-pickled-dcp", action="store_true",
                   help="export a checkpoint that titanlike did not write on this account: its .metadata is a "
                        "Python pickle, and loading it can run any code its author put there")
    a = p.parse_args(argv)
    try:
        files, arch = export(a.checkpoint, a.out, a.dtype, a.tokenizer, a.trust_pickled_dcp)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {a.checkpoint} to {a.out} ({a.dtype}, {arch}): {', '.join(files)}")
    return 0


def cli() -> None:
    """The `titanlike-export` console script: same as `python -m titanlike.export`."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
