"""titanlike-export: a training checkpoint to a Hugging Face folder that transformers loads.

    titanlike-export outputs/debug/checkpoint/step-150 exported/ [--dtype bf16|fp32] [--tokenizer ...]

The step folder is a DCP checkpoint written by any number of ranks, with or without float8: the
model weights are read whole into a plain CPU model built from its model_args.json, so no process
group and no GPU are needed, and the optimizer state is never read. The folder holds
model.safetensors, config.json (LlamaForCausalLM, or Qwen3ForCausalLM for a QK-norm model, with
bos/eos ids), generation_config.json and the tokenizer (tokenizer.json, tokenizer_config.json):
`AutoModelForCausalLM` and `AutoTokenizer` load it, and titanlike reads it back with
`--checkpoint.initial_load_path`.

The output folder must be new or empty: --overwrite replaces an earlier export there and keeps every
other file. An export is recognised by the record it writes last (titanlike-export.json: each file's
size and checksum); a file of an export's name that the record does not vouch for (no record, changed
since, a link, a folder) is the user's, and the export refuses, naming them, before it removes anything.

Weights that hold a NaN or an infinity (a run that diverged, saved with training.nonfinite = warn) make
no usable model: the export stops with one line naming the first such tensor, before it writes
anything, unless --allow-nonfinite asks for them as they are.

The tokenizer is the one the run trained with: the tokenizer.json that titanlike-train left in the
run folder (from the data's dataset.json, or the byte tokenizer of the built-in corpus), found next
to the checkpoint folder; --tokenizer names another (a tokenizer.json, a prepared data folder, or
'byte'), but not one with fewer ids than the run's own.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shutil
import sys
import tempfile
from pathlib import Path

from titanlike import fs
from titanlike.errors import ArgumentParser, Stopped, UserError, error_exit, stopped_exit, stops_unwind
from titanlike.model.shape import round_vocab

DTYPES = ("bf16", "fp32")


def find_run_tokenizer(step_dir: str) -> str | None:
    """The folder holding the tokenizer.json of the run that saved this step folder: the step folder
    itself (every save carries its run's tokenizer); for a step saved before saves did, the folder of
    that run's records, found by its run id: the dump folder, or the earlier-runs/ folder that a later
    fresh run moved them to. A step with no run id takes the first tokenizer.json near it."""
    here = Path(step_dir).resolve()
    if (here / "tokenizer.json").is_file():
        return str(here)
    try:
        saved = fs.read_json(here / "trainer_state.json", "the trainer state").get("run", {})
    except (UserError, AttributeError):
        saved = {}
    run_id = saved.get("run_id") if isinstance(saved, dict) else None
    dumps = [Path(saved["dump_folder"])] if isinstance(saved, dict) and saved.get("dump_folder") else []
    for dump in dict.fromkeys([*dumps, here.parent, here.parent.parent]):
        for folder in (dump, *sorted((dump / "earlier-runs").glob("*"))):
            if (folder / "tokenizer.json").is_file() and (not run_id or _records_of(folder) in (run_id, None)):
                return str(folder)
    return None


def _records_of(folder: Path) -> str | None:
    """The run id a folder of run records names (its `run-id` file), or None."""
    try:
        return fs.read_text(folder / "run-id", "the run id").strip() or None
    except UserError:
        return None


def run_tokenizer(step_dir: str, choice: str, vocab_size: int):
    """The tokenizer to ship with an export of `step_dir` (see the module docstring), checked against the model
    (tokenizer_fits)."""
    from titanlike.data.tokenizer import ByteTokenizer, load_tokenizer, tokenizer_from_folder

    folder = find_run_tokenizer(step_dir)
    if choice:
        if os.path.isdir(choice) and not os.path.isfile(os.path.join(choice, "tokenizer.json")):
            raise UserError(f"--tokenizer {choice}: that folder has no tokenizer.json")
        tok = tokenizer_from_folder(choice) if os.path.isdir(choice) else load_tokenizer(choice)
        own = None
        if folder is not None:
            with contextlib.suppress(UserError):  # the run's copy unreadable: --tokenizer may be what replaces it
                own = tokenizer_from_folder(folder)
    elif folder is None:
        if round_vocab(ByteTokenizer.vocab_size) < vocab_size:  # no guess for a model the byte tokenizer is not
            raise UserError(f"no tokenizer.json next to {step_dir}, and the model's {vocab_size} ids are more than "
                            f"the byte tokenizer's ({ByteTokenizer.vocab_size}, padded to "
                            f"{round_vocab(ByteTokenizer.vocab_size)}): name the tokenizer it trained with, "
                            f"--tokenizer tokenizer.json (or a prepared data folder)")
        print(f"note: no tokenizer.json next to {step_dir}: the byte tokenizer is assumed "
              f"(--tokenizer names another)", file=sys.stderr)
        tok = own = ByteTokenizer()
    else:
        tok = own = tokenizer_from_folder(folder)
    tokenizer_fits(tok, vocab_size, own, os.path.join(folder or step_dir, "tokenizer.json"))
    return tok


def tokenizer_fits(tok, vocab_size: int, own, own_path: str) -> None:
    """Refuse, in one line, a tokenizer that cannot be the model's: more ids than its vocabulary (ids past the
    embedding), or fewer than the tokenizer it trained with (`own`, where known, at `own_path`): the model
    would write ids it cannot decode, and every id would mean another token (--tokenizer byte on a model of
    65,536 printed garbage). Where nothing records the model's tokenizer, a smaller one is taken as given: a
    model may have more rows than its data's tokenizer (a preset's vocabulary over data without dataset.json)."""
    if tok.vocab_size > vocab_size:
        raise UserError(f"the tokenizer has {tok.vocab_size} ids but the model only {vocab_size}: "
                        f"it is not the tokenizer this model was trained with (choose one with --tokenizer)")
    if own is not None and tok.vocab_size < own.vocab_size and tok.to_json() != own.to_json():
        raise UserError(f"the tokenizer has {tok.vocab_size} ids, fewer than the {own.vocab_size} of the one this "
                        f"model trained with ({own_path}): the model would write ids it cannot decode, and the others "
                        f"would read as other tokens; leave out --tokenizer to use that one")


def trained_window_of(step_dir: str) -> int | None:
    """The longest window the step's weights trained on (data.seq_len, and any long-context stage begun by
    then), which the export writes as max_position_embeddings, at most model.max_seq_len: transformers and
    serving stacks read it as the context the model works in, and RoPE positions past the trained windows were
    never trained (131072 was written for a model trained on 128-token windows). None where the step's
    trainer_state.json records no seq_len (then model.max_seq_len)."""
    from titanlike.config.stages import trained_window

    try:
        state = fs.read_json(Path(step_dir) / "trainer_state.json", "the trainer state")
    except UserError:
        return None
    if not isinstance(state, dict) or not isinstance(state.get("run"), dict):
        return None
    step = state.get("step")
    return trained_window(state["run"].get("settings"), step if isinstance(step, int) else 2**63)


EXPORT_RECORD = "titanlike-export.json"  # written last: the files of this export, as the manifest describes them


def earlier_export(out_dir: str, overwrite: bool, staging: str | None = None) -> list[str]:
    """The files of an earlier export in `out_dir` that --overwrite removes. A folder that holds
    anything (but this export's own `staging` folder) is refused without --overwrite: writing into it
    would replace a config.json of the user's, or leave an older export's weight shards beside the new
    weights. With it, every entry of an export's name must be a file the earlier export's record
    vouches for, unchanged."""
    from titanlike.checkpoint.manifest import describe_files
    from titanlike.hf.interchange import written_by_export

    if not os.path.lexists(out_dir):
        return []
    if not os.path.isdir(out_dir):
        raise UserError(f"{out_dir} is {fs.not_a_folder(out_dir)}; choose another output folder")
    try:
        names = sorted(set(os.listdir(out_dir)) - {os.path.basename(staging or "")})
    except OSError as e:
        raise UserError(f"cannot read the output folder: {fs.describe_os_error(e, out_dir)}") from None
    if names and not overwrite:
        raise UserError(f"{out_dir} is not empty ({len(names)} entries); export into a new or empty folder, or "
                        f"pass --overwrite to replace an earlier export there (other files are kept)")
    ours = [n for n in names if written_by_export(n) or n == EXPORT_RECORD]
    vouched = _recorded_files(out_dir) if EXPORT_RECORD in ours else {}
    foreign = []
    for name in ours:
        path = os.path.join(out_dir, name)
        if name == EXPORT_RECORD and vouched is not None:
            continue
        if os.path.islink(path) or not os.path.isfile(path):
            foreign.append(f"{name} ({'a link' if os.path.islink(path) else 'not a file'})")
        elif not vouched or name not in vouched:
            foreign.append(f"{name} (no export's record names it)")
        elif describe_files(out_dir, [name])[name] != vouched[name]:
            foreign.append(f"{name} (changed since the export)")
    if foreign:
        # Without a record at all they may be an export cut short before it wrote its record (a kill while the files
        # moved in): nothing tells those from files of the user's, so say both, and what to do about each.
        fix = (f"{out_dir} has no {EXPORT_RECORD}, which an export writes last: if these are an export that was cut "
               f"short, delete them and export again; if they are yours, move them away or export into another "
               f"folder" if EXPORT_RECORD not in names else "move them away or export into another folder")
        raise UserError(f"--overwrite removes only an earlier export's own files, and these in {out_dir} are not: "
                        f"{', '.join(foreign)}; {fix} (nothing was changed)")
    return ours


def record_export(out_dir: str, files: list[str]) -> None:
    """Written last: the files of this export, which a later --overwrite may remove (a folder without
    the record is an export cut short, or none)."""
    from titanlike.checkpoint.manifest import describe_files
    from titanlike.hf.interchange import set_file_modes

    fs.write_json(os.path.join(out_dir, EXPORT_RECORD),
                  {"written_by": "titanlike-export", "files": describe_files(out_dir, files)}, indent=1)
    set_file_modes(out_dir, [EXPORT_RECORD])


def _recorded_files(out_dir: str) -> dict | None:
    """The files an earlier export's record vouches for (name → size and checksums), or None when the
    record is not one (not a regular file, not the record's shape)."""
    path = os.path.join(out_dir, EXPORT_RECORD)
    if os.path.islink(path) or not os.path.isfile(path):
        return None
    try:
        record = fs.read_json(path, "the earlier export's record")
    except UserError:
        return None
    files = record.get("files") if isinstance(record, dict) and record.get("written_by") == "titanlike-export" else None
    return files if isinstance(files, dict) else None


NONFINITE_CHUNK = 2**24  # elements checked at a time: a 16 MiB mask, whatever the tensor's size


def first_nonfinite(state: dict) -> str | None:
    """The first tensor of `state` (in its order) that holds a NaN or an infinity, said with how many of
    each; None when every value is finite. Checked a slice at a time, so a large tensor needs no mask
    of its own size."""
    import torch

    for name, tensor in state.items():
        flat = tensor.detach().reshape(-1)
        if not flat.is_floating_point():
            continue
        if all(bool(torch.isfinite(part).all()) for part in flat.split(NONFINITE_CHUNK)):
            continue
        nan = sum(int(torch.isnan(part).sum()) for part in flat.split(NONFINITE_CHUNK))
        inf = sum(int(torch.isinf(part).sum()) for part in flat.split(NONFINITE_CHUNK))
        counts = ", ".join(f"{n:,} {what}" for n, what in ((nan, "NaN"), (inf, "infinite")) if n)
        return f"{name} holds non-finite values: {counts} of its {flat.numel():,}"
    return None


def export(step_dir: str, out_dir: str, dtype: str = "bf16", tokenizer: str = "",
           trust_pickled_dcp: bool = False, overwrite: bool = False, allow_nonfinite: bool = False
           ) -> tuple[list[str], str]:
    """Write the Hugging Face folder; returns (the files written, the architecture). Weights with a NaN or
    an infinity are refused unless `allow_nonfinite`. The folder is claimed first (fs.OutputClaim): a second
    export into it stops at once, rather than both writing and the later one's files replacing the other's."""
    inside = checkpoint_around(out_dir)
    if inside == os.path.realpath(out_dir):
        raise UserError(f"{out_dir} is a checkpoint; the output must be another folder")
    if inside:
        raise UserError(f"{out_dir} is inside the checkpoint {inside}, which checkpoint.keep_latest_k deletes with "
                        f"everything in it; export to a folder outside it")
    with fs.OutputClaim(os.path.normpath(out_dir), "titanlike-export", "the export"):
        return _export(step_dir, out_dir, dtype, tokenizer, trust_pickled_dcp, overwrite, allow_nonfinite)


def _export(step_dir: str, out_dir: str, dtype: str, tokenizer: str, trust_pickled_dcp: bool, overwrite: bool,
            allow_nonfinite: bool) -> tuple[list[str], str]:
    import torch

    from titanlike.checkpoint.weights import read_model_weights, step_folder_problem, step_model_args
    from titanlike.hf.interchange import set_file_modes, write_hf_folder, write_tokenizer_files

    stale = earlier_export(out_dir, overwrite)
    problem = step_folder_problem(step_dir)
    if problem:
        raise UserError(problem)
    shape = step_model_args(step_dir)
    tok = run_tokenizer(step_dir, tokenizer, shape.vocab_size)  # before the weights: a wrong choice costs nothing
    margs, state = read_model_weights(step_dir, trust_pickled_dcp, flag="--trust-pickled-dcp")
    margs = dataclasses.replace(margs, max_seq_len=min(margs.max_seq_len, trained_window_of(step_dir) or 2**63))
    bad = None if allow_nonfinite else first_nonfinite(state)
    if bad:  # before anything is written or removed
        raise UserError(f"{step_dir}: {bad}; the run diverged before this step, so export an earlier checkpoint "
                        f"(or pass --allow-nonfinite to export the weights as they are)")
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    created = not os.path.lexists(out_dir)
    staging, untouched = None, True
    try:
        # Everything is written into a folder of its own first: a full disk or a read-only folder then fails
        # before any file of an earlier export is touched, and leaves nothing behind.
        os.makedirs(out_dir, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=".titanlike-export-", dir=out_dir)
        files = write_hf_folder(state, margs, staging, torch_dtype, bos_id=tok.bos_id, eos_id=tok.eos_id)
        files += write_tokenizer_files(staging, tok.to_json(), (tok.bos_token, tok.bos_id),
                                       (tok.eos_token, tok.eos_id), margs.max_seq_len)
        set_file_modes(staging, files)
        # Checked again: a file of the user's that came into the folder while the weights were read and written
        # is refused as one there at the start would have been.
        stale = earlier_export(out_dir, overwrite, staging)
        untouched = False  # from here on the earlier export's files are replaced
        _move_in(staging, out_dir, files, stale)
        staging = None
        record_export(out_dir, files)
    except OSError as e:
        if staging and e.filename and os.fsdecode(e.filename).startswith(staging):  # said as the file it would be
            e.filename = os.path.join(out_dir, os.path.relpath(os.fsdecode(e.filename), staging))
        raise UserError(f"cannot write the export: {fs.describe_os_error(e, out_dir)}"
                        f"{'; nothing in the output folder was changed' if untouched else ''}") from None
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
            if created:
                with contextlib.suppress(OSError):
                    os.rmdir(out_dir)  # only if empty: the folder this export made
    return files, "Qwen3ForCausalLM" if margs.qk_norm else "LlamaForCausalLM"


def _move_in(staging: str, out_dir: str, files: list[str], stale: list[str]) -> None:
    """The written files into `out_dir`, each renamed over its earlier namesake (the same file system), and the
    earlier export's other files removed. Its record goes first: a folder cut short here has no record, which
    marks an export that did not finish."""
    if EXPORT_RECORD in stale:
        os.unlink(os.path.join(out_dir, EXPORT_RECORD))
    for name in files:
        os.replace(os.path.join(staging, name), os.path.join(out_dir, name))
    for name in stale:
        if name not in files and name != EXPORT_RECORD:
            os.unlink(os.path.join(out_dir, name))
    os.rmdir(staging)


def checkpoint_around(out_dir: str) -> str | None:
    """The checkpoint step folder (one holding DCP's .metadata) that `out_dir` is, or lies inside, resolved; None
    when it is in none. Checked from the folder up, through the parts that exist yet."""
    here = os.path.realpath(out_dir)
    while True:
        if os.path.isfile(os.path.join(here, ".metadata")):
            return here
        parent = os.path.dirname(here)
        if parent == here:
            return None
        here = parent


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="titanlike-export", description=__doc__.split("\n\n")[0],
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
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier export in OUT (its weights, config and tokenizer files); other files "
                        "there are kept")
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="export weights that hold NaN or infinite values as they are (refused by default: such a "
                        "model gives NaN logits)")
    a = p.parse_args(argv)
    for what, value in (("checkpoint", a.checkpoint), ("output folder", a.out)):
        if not value:
            p.error(f"the {what} is empty: give a path")
    try:
        with stops_unwind():  # a stop removes the staging folder on its way out; an earlier export stays whole
            files, arch = export(a.checkpoint, a.out, a.dtype, a.tokenizer, a.trust_pickled_dcp, a.overwrite,
                                 a.allow_nonfinite)
    except UserError as e:
        return error_exit(e)
    except (KeyboardInterrupt, Stopped) as e:
        return stopped_exit(e, f"nothing was written to {a.out}")
    print(f"exported {a.checkpoint} to {a.out} ({a.dtype}, {arch}): {', '.join(files)}")
    note = inference_note(a.out)
    if note:
        print(note)
    return 0


def inference_note(folder: str) -> str:
    """What a model trained with document masks means at inference (config.json records the mask), or ""."""
    from titanlike.config.resolve import read_hf_config

    if read_hf_config(folder).attn_mask != "block_causal":
        return ""
    return ("note: trained with model.attn_mask = block_causal (attention within each document); at inference each "
            "prompt is one document, and plain causal attention over it, as transformers runs it, is the same")


def cli() -> None:
    """The `titanlike-export` console script: same as `python -m titanlike.hf.export`."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
