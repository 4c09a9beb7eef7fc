"""Hostile use: what a crafted, edited, shared or symlinked file, or an absurd argument, does to a run.

Each test is one attack and asserts what happens now: no code runs from a checkpoint's pickle, an
edited checkpoint is refused, one run owns a checkpoint folder, no file is written through a link,
every load checks the manifest, and bad input is one `error:` line with exit 2 and nothing changed
on disk. docs/troubleshooting.md has the table of attacks and results. One rank, in this process
(train_here), on copies of the test run's trained run (conftest).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import zlib
from pathlib import Path

import pytest

from conftest import SMALL, call, copy_run, error_lines, losses, train_here
from titanlike.errors import UserError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

MORE = ("--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval", "2")


def train(dump: Path, corpus, *extra: str, check: bool = True):
    return train_here(dump, *SMALL, *extra, corpus=corpus, check=check)


def steps_in(folder: Path) -> list[str]:
    return sorted((n for n in os.listdir(folder) if n.startswith("step-")),
                  key=lambda n: (int(n.split("-")[1].split(".")[0]), n))


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` and its bytes: to assert that a refusal changed nothing."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != ".titanlike.lock"}


class Payload:
    """Unpickling this creates `marker`: the stand-in for any command a crafted pickle could run."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def plant_pickle(step: Path, marker: Path) -> None:
    (step / ".metadata").write_bytes(pickle.dumps(Payload(marker)))


# ---- no code from any checkpoint ---------------------------------------------------------------------


def test_a_pickle_in_the_runs_own_checkpoint_folder_never_runs(trained_run, tmp_path, corpus):
    """A planted step-99 (no manifest) and step-98 (a copied manifest, a swapped .metadata) are newer
    than the real steps: they are set aside by their manifests alone, unread, and the run resumes."""
    from titanlike.hf import generate

    dump = copy_run(trained_run, tmp_path / "run")
    marker = tmp_path / "code-ran"
    no_manifest = dump / "checkpoint" / "step-99"
    no_manifest.mkdir()
    shutil.copy(dump / "checkpoint" / "step-4" / "__0_0.distcp", no_manifest)
    plant_pickle(no_manifest, marker)
    swapped = dump / "checkpoint" / "step-98"
    shutil.copytree(dump / "checkpoint" / "step-4", swapped)
    plant_pickle(swapped, marker)

    for source in (no_manifest, swapped):  # generate reads a step folder through the same gate
        rc, err = call(generate.main, str(source), "--prompt", "a", "--max-new-tokens", "2", "--device", "cpu")
        assert rc == 2 and len(error_lines(err)) == 1 and not marker.exists()

    proc = train(dump, corpus, *MORE)
    assert not marker.exists()
    assert f"resumed from {dump}/checkpoint/step-4 at step 4" in proc.stderr
    assert steps_in(dump / "checkpoint") == ["step-2", "step-4", "step-6", "step-98.damaged", "step-99.damaged"]


def assert_refused_as_unsigned(dump: Path, corpus, step: Path) -> None:
    """The run stops in one line naming `step`'s manifest as not signed with this user's key, before
    any training step, and changes nothing in its folder."""
    before = snapshot(dump)
    proc = train(dump, corpus, *MORE, check=False)
    assert proc.returncode == 2
    (line,) = error_lines(proc.stderr)
    assert line.startswith(f"error: {step}/manifest.json is not signed with this user's checkpoint key")
    assert "train step" not in proc.stderr
    assert snapshot(dump) == before


def test_an_edited_trainer_state_with_fresh_checksums_is_refused(trained_run, tmp_path, corpus):
    """Editing trainer_state.json and recomputing its size and checksums in the manifest breaks the
    manifest's signature: the run refuses in one line and changes nothing."""
    dump = copy_run(trained_run, tmp_path / "run")
    step = dump / "checkpoint" / "step-4"
    state = json.loads((step / "trainer_state.json").read_text())
    state["step"] = 2
    raw = json.dumps(state).encode()
    (step / "trainer_state.json").write_bytes(raw)
    manifest = json.loads((step / "manifest.json").read_text())
    entry = manifest["files"]["trainer_state.json"]
    entry.update(size=len(raw), crc32=f"{zlib.crc32(raw):08x}")
    if "sha256" in entry:
        entry["sha256"] = hashlib.sha256(raw).hexdigest()
    (step / "manifest.json").write_text(json.dumps(manifest))
    assert_refused_as_unsigned(dump, corpus, step)


def test_every_load_checks_the_checksums(trained_run, tmp_path, corpus):
    """4 KiB zeroed in a shard: resume falls back, and initial_load_path, export and generate refuse."""
    from titanlike.hf import export, generate

    dump = copy_run(trained_run, tmp_path / "run")
    step = dump / "checkpoint" / "step-4"
    with open(step / "__0_0.distcp", "r+b") as f:
        f.seek(1 << 20)
        f.write(bytes(4096))
    expected = f"error: {step}/__0_0.distcp does not match its checksum (its bytes changed after the save); " \
               f"it cannot be loaded"

    started = train(tmp_path / "other", corpus, "--training.steps", "1", "--checkpoint.initial_load_path", str(step),
                    check=False)
    assert started.returncode == 2 and error_lines(started.stderr) == [expected]
    for main, argv in ((export.main, [str(step), str(tmp_path / "hf")]),
                       (generate.main, [str(step), "--prompt", "a", "--max-new-tokens", "2", "--device", "cpu"])):
        rc, err = call(main, *argv)
        assert rc == 2 and error_lines(err) == [expected]
    assert not (tmp_path / "hf").exists()

    resumed = train(dump, corpus, *MORE)
    assert f"resumed from {dump}/checkpoint/step-2 at step 2" in resumed.stderr
    assert steps_in(dump / "checkpoint") == ["step-2", "step-4", "step-4.damaged", "step-6"]


@pytest.mark.parametrize("put", ["link to a copy", "folder", "nothing"])
def test_a_file_of_a_step_that_is_not_the_saved_file_is_named_for_what_it_is(tmp_path, put):
    """A step's shard replaced by a link to a copy of its own bytes (or a folder) was reported "is missing"; the
    line now says what is there. A missing file is still "missing"."""
    from conftest import seal
    from titanlike.checkpoint.manifest import inspect

    step = tmp_path / "step-2"
    step.mkdir()
    for name in (".metadata", "trainer_state.json", "model_args.json", "__0_0.distcp"):
        (step / name).write_bytes(name.encode() * 100)
    seal(str(step), 2)
    shard = step / "__0_0.distcp"
    copy = tmp_path / "copy.distcp"
    shutil.copyfile(shard, copy)
    shard.unlink()
    if put == "link to a copy":
        shard.symlink_to(copy)
    elif put == "folder":
        shard.mkdir()
    said = {"link to a copy": "is a symbolic link, where the save wrote a file",
            "folder": "is a folder, where the save wrote a file", "nothing": "is missing"}[put]
    finding = inspect(str(step))
    assert (finding.kind, finding.problem) == ("damaged", f"{shard} {said}")


def test_a_step_without_manifest_and_trainer_state_is_damaged(trained_run, tmp_path, corpus):
    """Advice to resume with another batch size looped; such a step is damaged and the run falls back."""
    dump = copy_run(trained_run, tmp_path / "run")
    for name in ("manifest.json", "trainer_state.json"):
        (dump / "checkpoint" / "step-4" / name).unlink()
    proc = train(dump, corpus, *MORE)
    assert f"resumed from {dump}/checkpoint/step-2 at step 2" in proc.stderr
    assert "global_batch_size" not in proc.stderr
    assert steps_in(dump / "checkpoint") == ["step-2", "step-4", "step-4.damaged", "step-6"]



def test_a_step_folder_under_another_name_is_set_aside(trained_run, tmp_path, corpus):
    """`cp -a step-2 step-100`: the folder's name is not the step its signed trainer_state.json holds. It
    is set aside in one warning line and the run resumes from the newest step whose name is true."""
    dump = copy_run(trained_run, tmp_path / "run")
    shutil.copytree(dump / "checkpoint" / "step-2", dump / "checkpoint" / "step-100")
    proc = train(dump, corpus, *MORE)
    step = dump / "checkpoint" / "step-100"
    assert (f"checkpoint damaged: {step} holds step 2 (its signed trainer_state.json says so): a step folder "
            f"copied or renamed under another name; set aside as {step}.damaged") in proc.stderr
    assert f"resumed from {dump}/checkpoint/step-4 at step 4" in proc.stderr
    assert "at step 100" not in proc.stderr
    assert steps_in(dump / "checkpoint") == ["step-2", "step-4", "step-6", "step-100.damaged"]


def test_a_step_folder_signed_with_another_key_is_refused(trained_run, tmp_path, corpus):
    """A step folder from another account or machine (its manifest signed with another key), newer than
    the run's own: the run refuses in one line and changes nothing."""
    from titanlike.checkpoint.manifest import sign

    dump = copy_run(trained_run, tmp_path / "run")
    foreign = dump / "checkpoint" / "step-8"
    shutil.copytree(dump / "checkpoint" / "step-4", foreign)
    manifest = json.loads((foreign / "manifest.json").read_text())
    manifest["signature"] = sign(b"another account's key", manifest["files"], manifest["metadata_sha256"])
    (foreign / "manifest.json").write_text(json.dumps(manifest))
    assert_refused_as_unsigned(dump, corpus, foreign)

# ---- one owner per checkpoint folder -------------------------------------------------------------------


def test_two_runs_cannot_share_a_checkpoint_folder(trained_run, tmp_path, corpus):
    """Another run holds the checkpoint folder (its lock, taken here as that run would): a second run
    with another dump folder but the same --checkpoint.folder stops before it writes anything."""
    from titanlike.fs import FolderLock

    shared = copy_run(trained_run, tmp_path / "first") / "checkpoint"
    before = snapshot(shared)
    holder = FolderLock(str(shared), "checkpoint.folder")
    holder.acquire()
    try:
        proc = train(tmp_path / "second", corpus, *MORE, "--checkpoint.folder", str(shared), check=False)
    finally:
        holder.release()
    assert proc.returncode == 2
    (line,) = error_lines(proc.stderr)
    assert line.startswith(f"error: checkpoint.folder {shared} is in use by another run (pid {os.getpid()} on ")
    assert line.endswith("wait for it, stop it, or use another --checkpoint.folder")
    assert snapshot(shared) == before


# ---- never through a symlink ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tokenizer.json", "config.toml", "metrics.jsonl"])
def test_no_run_file_is_written_through_a_symlink(prepared, tmp_path, name):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    dump = tmp_path / "run"
    dump.mkdir()
    (dump / name).symlink_to(victim)
    train(dump, None, "--training.steps", "2", "--data.path", str(prepared / "train"))
    assert victim.read_text() == "precious"
    assert not (dump / name).is_symlink() and (dump / name).stat().st_size > 0  # the run's own file


@pytest.mark.parametrize("where", ["dump", "checkpoint"])
def test_a_symlinked_lock_file_is_refused(tmp_path, corpus, where):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    folder = tmp_path / "run" if where == "dump" else tmp_path / "run" / "checkpoint"
    folder.mkdir(parents=True)
    (folder / ".titanlike.lock").symlink_to(victim)
    proc = train(tmp_path / "run", corpus, *MORE, check=False)
    assert proc.returncode == 2
    (line,) = error_lines(proc.stderr)
    assert line.endswith(f"cannot be locked: {folder}/.titanlike.lock: a symbolic link, and titanlike writes only "
                         f"files it created (remove the link)")
    assert victim.read_text() == "precious"


# ---- nothing a run saved is lost -----------------------------------------------------------------------


def test_a_non_finite_abort_publishes_the_background_save(tmp_path, corpus, monkeypatch):
    """The loss turns NaN the step after a background save started: the run stops in one line and the
    saved step is published, not left as step-4.tmp."""
    monkeypatch.setenv("TITANLIKE_NAN_BATCHES", "5")
    dump = tmp_path / "run"
    proc = train(dump, corpus, "--training.steps", "8", "--checkpoint.enable", "--checkpoint.interval", "4",
                 "--checkpoint.async_mode", "async", check=False)
    assert proc.returncode == 2
    (line,) = error_lines(proc.stderr)
    assert line.startswith("error: loss became nan at step 5")
    assert steps_in(dump / "checkpoint") == ["step-4"]
    monkeypatch.delenv("TITANLIKE_NAN_BATCHES")
    resumed = train(dump, corpus, "--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval", "4")
    assert f"resumed from {dump}/checkpoint/step-4 at step 4" in resumed.stderr


def test_load_step_applies_once_and_the_runs_later_saves_win(trained_run, tmp_path, corpus):
    """A run started with load_step 2 and stopped after saving step 6 (a preemption, or a requeue) goes
    on from step 6 when started again with the same command, instead of going back to step 2."""
    dump = copy_run(trained_run, tmp_path / "run")
    command = (*MORE, "--checkpoint.load_step", "2")
    first = train(dump, corpus, *command)
    assert "resumed from step 2: set aside the later checkpoints as step-4.abandoned" in first.stderr
    assert steps_in(dump / "checkpoint") == ["step-2", "step-4", "step-4.abandoned", "step-6"]
    again = train(dump, corpus, *command[:1], "8", *command[2:])
    assert ("checkpoint.load_step = 2 was applied by an earlier attempt of this run, which saved step 6 since: "
            "resuming from the newest") in again.stderr
    assert f"resumed from {dump}/checkpoint/step-6 at step 6" in again.stderr
    assert sorted(losses(dump)) == list(range(1, 9))


# ---- nothing silently changed --------------------------------------------------------------------------


def test_resume_with_another_seed_is_refused(trained_run, tmp_path, corpus):
    """The seed orders the data: another one on resume would train on other batches than it says."""
    dump = copy_run(trained_run, tmp_path / "run")
    before = snapshot(dump)
    proc = train(dump, corpus, *MORE, "--job.seed", "7", check=False)
    assert proc.returncode == 2
    assert error_lines(proc.stderr) == [
        f"error: {dump}/checkpoint/step-4 was trained with job.seed = 0, this run has 7: resume with --job.seed 0 "
        f"(the data order depends on it)"]
    assert snapshot(dump) == before



def test_resume_with_other_data_or_seq_len_says_what_changed(trained_run, tmp_path, corpus):
    """Another data.path, or another data.seq_len, on resume: applied, each with one line naming the old
    and new value and what becomes of the data position (docs/checkpointing.md)."""
    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.copy(corpus[0], moved / "train.bin")
    dump = copy_run(trained_run, tmp_path / "run")
    proc = train(dump, corpus, *MORE, "--data.path", str(moved))
    assert (f"data.path: checkpoint {corpus[0]} → config {moved} (the data position carries over: the run goes on "
            f"at the same global batch of the new data's order)") in proc.stderr
    assert sorted(losses(dump)) == list(range(1, 7))

    dump = copy_run(trained_run, tmp_path / "run2")
    proc = train(dump, corpus, *MORE, "--data.seq_len", "32")
    assert ("data.seq_len: checkpoint 64 → config 32 (the data position is kept in global batches, which now hold "
            "windows of 32 tokens: the run reads other samples than one at the old length would)") in proc.stderr
    assert sorted(losses(dump)) == list(range(1, 7))


def test_resume_with_a_source_in_another_folder_says_so(prepared, tmp_path):
    """A mixture's source under the same name, pointing at another folder on resume: one line."""
    other = tmp_path / "other"
    shutil.copytree(prepared, other)
    dump = tmp_path / "run"
    steps = ("--training.steps", "2", "--checkpoint.enable", "--checkpoint.interval", "1", "--validation.enable",
             "false")
    train(dump, None, *steps, "--data.mix", f"web={prepared}:1")
    proc = train(dump, None, *steps[:1], "3", *steps[2:], "--data.mix", f"web={other}:1")
    assert f"resumed from {dump}/checkpoint/step-2 at step 2" in proc.stderr
    assert (f"data source web: checkpoint {prepared} → config {other} (the data position carries over: the run "
            f"goes on at the same global batch of the new data's order)") in proc.stderr


def test_validation_without_held_out_data_says_so(tmp_path, corpus):
    """Validation on (the default) and no held-out data: one line at start, not silence."""
    data = tmp_path / "train"
    data.mkdir()
    shutil.copy(corpus[0], data / "train.bin")
    proc = train_here(tmp_path / "run", *SMALL[:-2], "--training.steps", "1", "--data.path", str(data))
    assert ("validation: no held-out data (data.val_path is unset): the run reports training loss only; set "
            "--data.val_path, or --validation.enable false to silence this") in proc.stderr
    quiet = train_here(tmp_path / "run2", *SMALL, "--training.steps", "1", "--data.path", str(data))
    assert "held-out" not in quiet.stderr

# ---- data a user was handed ----------------------------------------------------------------------------


@pytest.fixture
def prepared(tmp_path) -> Path:
    """A dataset prepared with the byte tokenizer (258 ids; the model's padded vocabulary is 320)."""
    from titanlike.data.prepare import cli as prepare

    text = tmp_path / "in"
    text.mkdir()
    for i in range(120):
        (text / f"{i}.txt").write_text(f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * 20)
    rc, err = call(prepare.main, str(tmp_path / "data"), str(text))
    assert rc == 0, err
    return tmp_path / "data"


def test_token_ids_beyond_the_tokenizer_are_caught(prepared, tmp_path, corpus):
    import numpy as np

    from titanlike.data.shards import write_shard

    ids = (np.arange(20_000) % 250).astype(np.uint16)
    ids[5_000] = 300  # below the padded vocabulary (320), above the byte tokenizer's 258 ids
    shard = next((prepared / "train").iterdir())
    write_shard(shard, ids)
    proc = train(tmp_path / "run", None, "--training.steps", "1", "--data.path", str(prepared / "train"),
                 "--validation.enable", "false", check=False)
    assert proc.returncode == 2
    assert error_lines(proc.stderr) == [
        f"error: {shard} holds token id 300 but its tokenizer ({prepared}/dataset.json) has 258 ids; the shards do "
        f"not come from that tokenizer: re-make them with titanlike-prepare"]


@pytest.mark.parametrize("tokenizer,refused", [
    (None, "names no tokenizer"),
    ({"kind": "huggingface", "file": "ELSEWHERE"}, "must be a file name in the dataset's own folder"),
    ({"kind": "huggingface", "file": "../elsewhere/tokenizer.json"}, "must be a file name in the dataset's own folder"),
])
def test_a_dataset_json_is_read_through_one_gate(prepared, tmp_path, corpus, tokenizer, refused):
    """No tokenizer entry, or a tokenizer file outside the dataset's folder (which would be copied into
    the run folder): one line, and no tokenizer copied."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "tokenizer.json").write_text('{"secret": true}')
    info = json.loads((prepared / "dataset.json").read_text())
    if tokenizer is None:
        del info["tokenizer"]
    else:
        file = str(elsewhere / "tokenizer.json") if tokenizer["file"] == "ELSEWHERE" else tokenizer["file"]
        info["tokenizer"] = {**info["tokenizer"], **tokenizer, "file": file}
    (prepared / "dataset.json").write_text(json.dumps(info))
    dump = tmp_path / "run"
    proc = train(dump, None, "--training.steps", "1", "--data.path", str(prepared / "train"),
                 "--validation.enable", "false", check=False)
    assert proc.returncode == 2
    (line,) = error_lines(proc.stderr)
    assert line.startswith(f"error: {prepared}/dataset.json") and refused in line
    assert not (dump / "tokenizer.json").exists()


def test_a_dump_folder_whose_name_is_not_utf8_is_one_line(tmp_path, corpus):
    dump = Path(os.fsdecode(bytes(tmp_path) + b"/bad\xff"))
    proc = train(dump, corpus, "--training.steps", "1", check=False)
    assert proc.returncode == 2
    assert error_lines(proc.stderr) == [
        f"error: job.dump_folder = '{tmp_path}/bad\N{REPLACEMENT CHARACTER}': the name is not valid UTF-8; use a "
        f"folder name in UTF-8"]


# ---- generate (the export's: test_export.py) ----------------------------------------------------------


@pytest.mark.parametrize("argv,message", [
    (["--max-new-tokens", "1e12"], "argument --max-new-tokens: invalid int value: '1e12'"),
    # The context of a step folder is the longest window it trained on (64 tokens), not model.max_seq_len.
    (["--max-new-tokens", str(10**12)], "--max-new-tokens 1000000000000: the model's context is 64 tokens"),
    (["--temperature", "nan"], "--temperature nan must be 0 (greedy) or in [0.0001, 10000]"),
    (["--prompt", "\udcff\udcfe"], "--prompt is not valid UTF-8 text"),
])
def test_generate_refuses_absurd_arguments_in_one_line(trained_run, argv, message):
    from titanlike.hf import generate

    rc, err = call(generate.main, str(trained_run / "checkpoint" / "step-4"), "--device", "cpu", *argv)
    assert rc == 2
    (line,) = error_lines(err)
    assert line.startswith(f"error: {message}")


@pytest.mark.parametrize("command,argv,message", [
    ("generate", ["", "--prompt", "hi"], "the source is empty"),
    ("export", ["", "out"], "the checkpoint is empty"),
    ("export", ["step", ""], "the output folder is empty"),
])
def test_an_empty_path_argument_is_named_not_printed_as_nothing(tmp_path, monkeypatch, command, argv, message):
    """An empty argument (an unset shell variable, say) is said to be empty: not `error: : no such folder`;
    nothing is written."""
    from titanlike.hf import export, generate

    monkeypatch.chdir(tmp_path)
    main = {"generate": generate.main, "export": export.main}[command]
    rc, err = call(main, *argv)
    assert rc == 2 and error_lines(err) == err.strip().splitlines(), err
    (line,) = error_lines(err)
    assert line.startswith(f"error: {message}: give "), line
    assert os.listdir(tmp_path) == []


def test_generates_advice_for_a_foreign_checkpoint_names_its_own_flag(trained_run, tmp_path):
    """The refusal of a folder not written on this account names a flag generate accepts, and it works."""
    from titanlike.hf import generate

    foreign = tmp_path / "foreign"
    shutil.copytree(trained_run / "checkpoint" / "step-4", foreign)
    (foreign / "manifest.json").unlink()
    argv = (str(foreign), "--prompt", "a", "--max-new-tokens", "2", "--temperature", "0", "--device", "cpu")
    rc, err = call(generate.main, *argv)
    assert rc == 2 and "--trust-pickled-dcp" in error_lines(err)[0]
    rc, err = call(generate.main, *argv, "--trust-pickled-dcp")
    assert rc == 0, err


# ---- importing a Hugging Face folder -------------------------------------------------------------------


@pytest.fixture
def hf_folder(trained_run, tmp_path) -> Path:
    from titanlike.hf import export

    rc, err = call(export.main, str(trained_run / "checkpoint" / "step-4"), str(tmp_path / "hf"))
    assert rc == 0, err
    return tmp_path / "hf"


def test_a_pytorch_bin_only_folder_says_how_to_convert(hf_folder, tmp_path, corpus):
    import torch

    (hf_folder / "model.safetensors").unlink()
    marker = tmp_path / "code-ran"
    torch.save({"payload": Payload(marker)}, hf_folder / "pytorch_model.bin")
    proc = train(tmp_path / "run", corpus, "--training.steps", "1", "--model.flavor", "hf",
                 "--checkpoint.initial_load_path", str(hf_folder), check=False)
    assert proc.returncode == 2 and not marker.exists()
    (line,) = error_lines(proc.stderr)
    assert line.startswith(f"error: {hf_folder} holds pytorch_model.bin but no .safetensors: titanlike reads "
                           f"safetensors only")
    assert "save_pretrained" in line


def test_an_hf_shape_holds_the_samples_to_its_limit_as_a_preset_does(hf_folder):
    """The limit is read from config.json (or model.max_seq_len) only when the run is resolved: the same one
    line as for a preset, from the same check."""
    from titanlike.config import ConfigError, load_config
    from titanlike.config.run import resolve_run

    cfg = load_config(["--model.flavor", "hf", "--checkpoint.initial_load_path", str(hf_folder),
                       "--model.max_seq_len", "64", "--data.seq_len", "128"])
    with pytest.raises(ConfigError, match="^data.seq_len = 128 exceeds model.max_seq_len = 64: set"):
        resolve_run(cfg, 1)


def test_import_advice_does_not_loop(hf_folder, tmp_path, corpus):
    """Each refusal's advice, followed, is not refused for the reason the advice gave."""
    from safetensors.torch import load_file, save_file

    vocab = train(tmp_path / "a", corpus, "--training.steps", "1", "--model.flavor", "hf", "--model.vocab_size", "512",
                  "--checkpoint.initial_load_path", str(hf_folder), check=False)
    (line,) = error_lines(vocab.stderr)
    assert "leave model.vocab_size unset" in line and "use --model.flavor hf" not in line

    weights = load_file(hf_folder / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, hf_folder / "model.safetensors", metadata={"format": "pt"})
    untied = train(tmp_path / "b", corpus, "--training.steps", "1", "--model.flavor", "hf",
                   "--checkpoint.initial_load_path", str(hf_folder), check=False)
    (line,) = error_lines(untied.stderr)
    assert "has no lm_head.weight, yet its config.json says tie_word_embeddings false" in line
    assert "--model.tie_embeddings" not in line


@pytest.mark.parametrize("kind", ["link", "dangling link", "file"])
def test_earlier_runs_that_is_not_a_folder_of_ours_is_refused_untouched(tmp_path, kind):
    """A fresh run moves another run's records to earlier-runs/<time>/: never through a link there, into
    wherever it points; nor a traceback when earlier-runs is a file."""
    from titanlike.records.folder import RunFolder

    dump, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    dump.mkdir()
    elsewhere.mkdir()
    (dump / "metrics.jsonl").write_text('{"step": 1}\n')
    if kind == "file":
        (dump / "earlier-runs").write_text("notes of the user's")
    else:
        (dump / "earlier-runs").symlink_to(elsewhere if kind == "link" else tmp_path / "nowhere")
    folder = RunFolder(str(dump), is_main=True)
    try:
        with pytest.raises(UserError) as e:
            folder.start_records(None, "0123abcd")
    finally:
        folder.close()
    assert str(e.value).startswith(f"{dump}/earlier-runs is ") and "\n" not in str(e.value), e.value
    assert os.listdir(elsewhere) == [] and not (tmp_path / "nowhere").exists()
    assert (dump / "metrics.jsonl").read_text() == '{"step": 1}\n'


@pytest.mark.parametrize("planted", ["train.log link", "metrics.jsonl link", "tb file"])
def test_a_refused_resume_from_an_earlier_step_changes_nothing(trained_run, tmp_path, corpus, planted):
    """A record the run cannot write (a link where it goes, a file where its folder goes) is refused before the
    resume from checkpoint.load_step sets the later checkpoints aside and moves the later metrics records:
    a refusal after those would have left them done, and the next plain resume would start from the earlier
    step."""
    dump = copy_run(trained_run, tmp_path / "run")
    name = planted.split()[0]
    target = dump / name
    if os.path.isdir(target):
        shutil.rmtree(target)
    elif target.exists():
        target.unlink()
    if planted.endswith("link"):
        (tmp_path / "users_file").write_text("precious")
        target.symlink_to(tmp_path / "users_file")
    else:
        target.write_text("")
    def listing():  # the lock files aside: a run takes the folders' locks first, and leaves the files
        return [sorted(n for n in os.listdir(f) if not n.startswith(".titanlike")) for f in (dump, dump / "checkpoint")]

    before = listing()
    metrics = (dump / "metrics.jsonl").read_bytes() if name != "metrics.jsonl" else None
    proc = train_here(dump, *SMALL, "--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval", "2",
                      "--checkpoint.load_step", "2", corpus=corpus, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = error_lines(proc.stderr)
    assert line.startswith(f"error: cannot write {target}: ") and line.endswith("nothing was changed"), line
    assert listing() == before
    if metrics is not None:
        assert (dump / "metrics.jsonl").read_bytes() == metrics
    if planted.endswith("link"):
        assert (tmp_path / "users_file").read_text() == "precious"
