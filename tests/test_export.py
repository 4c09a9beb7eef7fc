"""titanlike-export carries the tokenizer and the architecture; import reads config.json back; the
output folder keeps what is not the export's; checkpoints of real runs (two ranks, float8, tied
embeddings) round-trip exactly, and a garbage or missing checkpoint is one line.

transformers checks (AutoModelForCausalLM, AutoTokenizer) skip when it is not installed."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import (
    SCHEDULE,
    STEPS,
    call,
    ckpt,
    copy_run,
    error_lines,
    load_in_process,
    resolve_model_args,
    run_python,
    run_train,
    seal,
    step_losses,
    train_here,
    words_tokenizer,
)
from titanlike.config import load_config
from titanlike.errors import UserError
from titanlike.model.decoder import Transformer
from titanlike.model.shape import model_args

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

NO_TRANSFORMERS = "transformers is not installed (pip install transformers)"
TEXT = "Hello, wörld! Ünïcode ✓ and\nnew lines\ttabs."


def synthetic_checkpoint(step_dir: Path, **overrides) -> Transformer:
    """A one-process DCP checkpoint in the trainer's layout (model + model_args.json)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    margs = dataclasses.replace(model_args("debug"), n_layers=2, **overrides)
    model = Transformer(margs)
    model.init_weights(seed=3, seq_len=64)
    with torch.no_grad():  # norm gains of ones would hide a mistake in their mapping
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(step_dir), no_dist=True)
    (step_dir / "model_args.json").write_text(json.dumps(dataclasses.asdict(margs)))
    seal(str(step_dir))  # the manifest a titanlike save writes: trusted as this account's
    return model


def export(step_dir: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    """titanlike-export's main() in this process (a new process costs seconds of imports a call; the
    command itself runs as one in `exported` and test_garbage_or_missing_checkpoint_is_one_line). An
    exception main() does not turn into an error: line fails the test as a traceback would."""
    from titanlike.hf.export import main

    argv = [str(step_dir), str(out), *extra]
    out_text, err_text = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out_text), contextlib.redirect_stderr(err_text):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse's usage errors
            rc = e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(argv, rc, out_text.getvalue(), err_text.getvalue())


def export_command(step_dir: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    """The console command as a user runs it, in a process of its own."""
    return run_python("-m", "titanlike.hf.export", str(step_dir), str(out), *extra)


def load_ours(folder: Path, like: Transformer) -> Transformer:
    """The export read back through --checkpoint.initial_load_path's loader."""
    from titanlike.hf.initial import load_initial_weights

    model = Transformer(like.args)
    model.init_weights(seed=99, seq_len=64)
    load_initial_weights(model, model.args, str(folder))
    return model


@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3"])
def test_export_writes_architecture_tokenizer_and_modes(tmp_path, qk_norm):
    original = synthetic_checkpoint(tmp_path / "step-1", qk_norm=qk_norm)
    proc = export(tmp_path / "step-1", tmp_path / "hf", "--dtype", "fp32")
    assert proc.returncode == 0, proc.stderr
    arch = "Qwen3ForCausalLM" if qk_norm else "LlamaForCausalLM"
    assert f"(fp32, {arch})" in proc.stdout
    assert "byte tokenizer is assumed" in proc.stderr  # no run folder here to say which
    hf = tmp_path / "hf"
    config = json.loads((hf / "config.json").read_text())
    assert config["architectures"] == [arch] and (config["bos_token_id"], config["eos_token_id"]) == (256, 257)
    assert json.loads((hf / "generation_config.json").read_text())["eos_token_id"] == 257
    assert json.loads((hf / "tokenizer_config.json").read_text())["eos_token"] == "<|end_of_text|>"
    modes = {name: stat.S_IMODE(os.stat(hf / name).st_mode) for name in os.listdir(hf)}
    mask = os.umask(0)
    os.umask(mask)
    assert set(modes.values()) == {0o666 & ~mask}, modes  # model.safetensors as config.json
    # Read back by titanlike: identical logits.
    tokens = torch.randint(0, 258, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(load_ours(hf, original)(tokens), original(tokens))
    # --model.flavor hf takes the whole shape from config.json.
    cfg = load_config(["--model.flavor", "hf", "--checkpoint.initial_load_path", str(hf)])
    assert resolve_model_args(cfg) == dataclasses.replace(original.args, max_seq_len=original.args.max_seq_len)


@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3"])
def test_transformers_gives_the_same_logits_and_text(tmp_path, qk_norm):
    transformers = pytest.importorskip("transformers", reason=NO_TRANSFORMERS)
    original = synthetic_checkpoint(tmp_path / "step-1", qk_norm=qk_norm)
    assert export(tmp_path / "step-1", tmp_path / "hf", "--dtype", "fp32").returncode == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    assert type(model).__name__ == ("Qwen3ForCausalLM" if qk_norm else "LlamaForCausalLM")
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    assert ids == list(TEXT.encode("utf-8"))  # the byte tokenizer, as titanlike encodes
    assert tok.decode(ids) == TEXT and (tok.bos_token_id, tok.eos_token_id) == (256, 257)
    tokens = torch.tensor([ids])
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, original(tokens), rtol=0, atol=1e-4)


@pytest.mark.parametrize("field,change,message", [
    ("rope_theta", {"rope_theta": 500000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
     "rope_theta is 500000.0 there, 10000.0 in this run (model.rope_theta)"),
    ("norm_eps", {"rms_norm_eps": 1e-6}, "rms_norm_eps is 1e-06 there, 1e-05 in this run (model.norm_eps)"),
    # 4 heads × 64 against 8 × 32: the same tensor shapes, other logits.
    ("heads", {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64},
     "num_attention_heads is 4 there, 8 in this run (model.n_heads)"),
    ("kv_heads", {"num_key_value_heads": 8}, "num_key_value_heads is 8 there, 4 in this run (model.n_kv_heads)"),
    ("qk_norm", {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]},
     "qk_norm is True there, False in this run"),
    ("vocab", {"vocab_size": 384}, "vocab_size is 384 there, 320 in this run"),
    ("tied", {"tie_word_embeddings": True}, "tie_word_embeddings is True there, False in this run"),
    ("head_dim", {"head_dim": 64}, "head_dim 64 is not hidden_size / num_attention_heads = 32"),
    ("rope_scaling", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0},
                      "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0}},
     "rotary scaling rope_parameters (rope_type 'llama3') is not implemented by titanlike's decoder"),
])
def test_import_refuses_a_config_that_disagrees(tmp_path, field, change, message):
    original = synthetic_checkpoint(tmp_path / "step-1")
    assert export(tmp_path / "step-1", tmp_path / "hf", "--dtype", "fp32").returncode == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(UserError) as e:
        load_ours(tmp_path / "hf", original)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith(f"{tmp_path}/hf/config.json")


@pytest.mark.parametrize("change, says", [
    ({"rope_theta": 0, "rope_parameters": {"rope_type": "default", "rope_theta": 0}},
     "rope_theta is 0; it must be a finite number > 0"),
    ({"rope_theta": -1.0, "rope_parameters": None}, "rope_theta is -1.0; it must be a finite number > 0"),
    ({"rope_theta": float("nan")}, "rope_theta is nan; it must be a finite number > 0"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": float("inf")}},
     "rope_parameters.rope_theta is inf; it must be a finite number > 0"),
    ({"rope_theta": "10000"}, "rope_theta is '10000'; it must be a finite number > 0"),
    ({"rope_theta": 500000.0}, "rope_theta is 500000.0 but rope_parameters' rope_theta 10000.0: transformers 4 reads"),
    ({"rms_norm_eps": float("-inf")}, "rms_norm_eps is -inf; it must be a finite number > 0"),
    ({"hidden_size": 256.5}, "hidden_size is 256.5, not a whole number"),
    ({"vocab_size": True}, "vocab_size is True, not a whole number"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings is 'false', not true or false"),
], ids=["theta-0", "theta-negative", "theta-nan", "parameters-theta-inf", "theta-string", "thetas-disagree",
        "eps-negative-inf", "fractional-width", "boolean-vocab", "string-tie"])
def test_a_config_json_with_a_number_that_is_none_is_refused_wherever_it_is_read(tmp_path, change, says):
    """Every read of a Hugging Face config.json (--model.flavor hf in the preflight and the trainer, an
    initial_load_path against a preset's shape, generate on an exported folder) goes through one reader,
    which takes no number that is not one: rope_theta 0 became 10000 unsaid, a string was converted."""
    from titanlike.config.resolve import read_hf_config
    from titanlike.hf.config import check_hf_config
    from titanlike.model.hf_names import hf_config
    from titanlike.preflight import check

    args = model_args("debug", rope_theta=10000.0)
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**hf_config(args, "float32"), **change}))
    where = f"{folder}/config.json: "
    hf_run = ["--model.flavor", "hf", "--checkpoint.initial_load_path", str(folder)]
    for read in (lambda: read_hf_config(str(folder)), lambda: check_hf_config(str(folder), args),
                 lambda: check(load_config(hf_run), 1)):
        with pytest.raises(UserError) as e:
            read()
        assert str(e.value).startswith(where) and says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_export_ships_the_runs_tokenizer_and_refuses_a_too_large_one(tmp_path):
    step_dir = tmp_path / "run" / "checkpoint" / "step-1"
    step_dir.mkdir(parents=True)
    synthetic_checkpoint(step_dir)
    from titanlike.data.tokenizer import record_tokenizer, run_tokenizer_files

    # What the trainer leaves for the built-in corpus.
    record_tokenizer(run_tokenizer_files(None, builtin_corpus=True), str(tmp_path / "run"))
    proc = export(step_dir, tmp_path / "hf", "--dtype", "fp32")
    assert proc.returncode == 0 and "assumed" not in proc.stderr, proc.stderr
    big = tmp_path / "big.json"
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"t{i}": i for i in range(400)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    tok.add_special_tokens(["</s>"])
    tok.save(str(big))
    proc = export(step_dir, tmp_path / "hf2", "--dtype", "fp32", "--tokenizer", str(big))
    assert proc.returncode == 2 and "the tokenizer has 401 ids but the model only 320" in proc.stderr
    assert not (tmp_path / "hf2").exists()


def test_a_tokenizer_smaller_than_the_models_own_is_refused(tmp_path, capsys):
    """--tokenizer byte on a model that trained with 400 ids printed garbage: a tokenizer with fewer ids than the
    one the run recorded is refused in one line, before any weight is read. A smaller one where nothing records
    the model's is taken as given (a preset's vocabulary over data without dataset.json), and none is guessed
    for a model larger than the byte tokenizer's."""
    from titanlike.data.tokenizer import ByteTokenizer, byte_tokenizer_json
    from titanlike.hf.export import run_tokenizer

    step = tmp_path / "run" / "checkpoint" / "step-1"
    words_tokenizer(step / "tokenizer.json", 400)
    with pytest.raises(UserError) as e:
        run_tokenizer(str(step), "byte", 448)
    assert str(e.value) == (f"the tokenizer has 258 ids, fewer than the 400 of the one this model trained with "
                            f"({step}/tokenizer.json): the model would write ids it cannot decode, and the others "
                            f"would read as other tokens; leave out --tokenizer to use that one")
    assert run_tokenizer(str(step), "", 448).vocab_size == 400  # its own
    assert run_tokenizer(str(step), str(step / "tokenizer.json"), 448).vocab_size == 400  # its own, named
    assert run_tokenizer(str(step), words_tokenizer(tmp_path / "more.json", 420), 448).vocab_size == 420
    # The embedded corpus's byte tokenizer under a preset's vocabulary (124m: 32768) is the run's own.
    (step / "tokenizer.json").write_text(json.dumps(byte_tokenizer_json(), ensure_ascii=False))
    assert isinstance(run_tokenizer(str(step), "", 32768), ByteTokenizer)
    assert isinstance(run_tokenizer(str(step), "byte", 32768), ByteTokenizer)
    # Nothing records the model's tokenizer: no guess past the byte tokenizer's padded 320, a choice as given.
    bare = tmp_path / "bare" / "step-1"
    bare.mkdir(parents=True)
    with pytest.raises(UserError, match="no tokenizer.json next to .*, and the model's 32768 ids are more than the "
                                        r"byte tokenizer's \(258, padded to 320\): name the tokenizer it trained with"):
        run_tokenizer(str(bare), "", 32768)
    assert isinstance(run_tokenizer(str(bare), "", 320), ByteTokenizer) and "is assumed" in capsys.readouterr().err
    assert isinstance(run_tokenizer(str(bare), "byte", 32768), ByteTokenizer)


def test_an_earlier_runs_checkpoint_exports_with_its_own_tokenizer(tmp_path, corpus):
    """A fresh run in a run folder that an earlier run used moves that run's tokenizer away with its records,
    and every step folder carries its run's tokenizer: the earlier run's checkpoints export with theirs."""
    from titanlike.data.prepare.driver import prepare
    from titanlike.data.tokenizer import ByteTokenizer
    from titanlike.hf.export import main

    tokenizers = pytest.importorskip("tokenizers")
    dump = tmp_path / "run"
    quick = ("--training.steps", "2", "--training.local_batch_size", "2", "--data.seq_len", "32",
             "--validation.enable", "false")
    # The earlier run: the built-in corpus's byte tokenizer, a checkpoint at step 2.
    train_here(dump, *quick, "--checkpoint.enable", "--checkpoint.interval", "2")  # (corpus: built once)
    step = dump / "checkpoint" / "step-2"
    assert (step / "tokenizer.json").read_text() == ByteTokenizer().to_json()
    # The next run, afresh in the same folder (no checkpoints of its own), on data with another tokenizer.
    words = {f"w{i}": i for i in range(300)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({**words, "</s>": 300}, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "words.json"))
    (tmp_path / "docs.txt").write_text("\n\n".join(" ".join(f"w{(i * j) % 300}" for j in range(200))
                                                    for i in range(20)))
    prepare(str(tmp_path / "data"), [str(tmp_path / "docs.txt")], tokenizer=str(tmp_path / "words.json"),
            workers=1, val_fraction=0.0)
    train_here(dump, *quick, "--data.path", str(tmp_path / "data" / "train"))
    assert (dump / "tokenizer.json").read_text() == (tmp_path / "words.json").read_text()
    earlier, = (dump / "earlier-runs").iterdir()
    assert (earlier / "tokenizer.json").read_text() == ByteTokenizer().to_json()
    rc, err = call(main, str(step), str(tmp_path / "hf"))
    assert rc == 0, err
    assert (tmp_path / "hf" / "tokenizer.json").read_text() == ByteTokenizer().to_json()


def test_a_step_saved_without_a_tokenizer_finds_its_runs_by_run_id(tmp_path):
    """A step folder saved before saves carried the tokenizer: the tokenizer of the records of the run that
    saved it (its run id), not the one that a later run left in the dump folder."""
    from titanlike.data.tokenizer import ByteTokenizer
    from titanlike.hf.export import find_run_tokenizer

    dump = tmp_path / "run"
    step = dump / "checkpoint" / "step-1"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text(json.dumps({"run": {"run_id": "aaa", "dump_folder": str(dump)}}))
    (dump / "run-id").write_text("bbb\n")
    (dump / "tokenizer.json").write_text('{"the later run": 1}')
    for name, run in (("1", "ccc"), ("2", "aaa")):
        (dump / "earlier-runs" / name).mkdir(parents=True)
        (dump / "earlier-runs" / name / "run-id").write_text(run + "\n")
        (dump / "earlier-runs" / name / "tokenizer.json").write_text(ByteTokenizer().to_json())
    assert find_run_tokenizer(str(step)) == str(dump / "earlier-runs" / "2")
    (dump / "earlier-runs" / "2" / "run-id").write_text("ddd\n")
    assert find_run_tokenizer(str(step)) is None  # nobody's: the export says so and assumes bytes


def test_the_export_records_the_mask_and_says_what_it_means_at_inference(tmp_path):
    from titanlike.hf.export import inference_note
    from titanlike.model.hf_names import args_from_hf_config, hf_config

    args = dataclasses.replace(model_args("debug"), attn_mask="block_causal")
    config = hf_config(args, "bfloat16")
    assert config["titanlike_attn_mask"] == "block_causal" and "titanlike_attn_mask" not in hf_config(
        model_args("debug"), "bfloat16")
    assert args_from_hf_config(config, "config.json").attn_mask == "block_causal"
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert "at inference each prompt is one document" in inference_note(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(hf_config(model_args("debug"), "bfloat16")))
    assert inference_note(str(tmp_path)) == ""


# ---- the output folder: nothing of the user's is lost ----------------------------------------------


def test_export_refuses_a_folder_that_is_not_empty(tmp_path):
    """Writing into a folder that holds files would replace the user's config.json silently, or leave an
    older export's weights beside the new ones."""
    from titanlike.hf.interchange import write_hf_folder

    model = synthetic_checkpoint(tmp_path / "step-1")
    hf, mine = tmp_path / "hf", tmp_path / "mine"
    write_hf_folder(model.state_dict(), model.args, str(hf), torch.float32)  # an earlier export, written in-process
    (hf / "README.md").write_text("the user's model card")
    mine.mkdir()
    (mine / "config.json").write_text('{"the user": "own config"}')
    for folder in (hf, mine):
        before = {name: (folder / name).read_bytes() for name in os.listdir(folder)}
        proc = export(tmp_path / "step-1", folder, "--dtype", "fp32")
        assert proc.returncode == 2, proc.stderr
        assert error_lines(proc.stderr) == proc.stderr.strip().splitlines(), proc.stderr  # one line, no traceback
        line, = error_lines(proc.stderr)
        assert f"{folder} is not empty" in line and "--overwrite" in line, line
        assert {name: (folder / name).read_bytes() for name in os.listdir(folder)} == before
    (tmp_path / "empty").mkdir()  # an empty folder is as good as a new one
    assert export(tmp_path / "step-1", tmp_path / "empty", "--dtype", "fp32").returncode == 0


def test_overwrite_replaces_an_earlier_export_and_keeps_other_files(tmp_path):
    from titanlike.hf.export import EXPORT_RECORD, record_export
    from titanlike.hf.interchange import write_hf_folder, write_tokenizer_files

    original = synthetic_checkpoint(tmp_path / "step-1")
    hf = tmp_path / "hf"
    # An earlier export of another model, sharded (one tensor a shard), beside files of the user's.
    earlier = Transformer(dataclasses.replace(original.args, n_layers=3))
    written = write_hf_folder(earlier.state_dict(), earlier.args, str(hf), torch.float32, max_shard_bytes=1)
    written += write_tokenizer_files(str(hf), "{}", ("<s>", 0), ("</s>", 1), 64)
    record_export(str(hf), written)
    assert "model.safetensors.index.json" in os.listdir(hf) and len(written) > 10
    (hf / "README.md").write_text("the user's model card")
    (hf / ".gitattributes").write_text("*.safetensors filter=lfs")
    (hf / "notes").mkdir()
    (hf / "notes" / "eval.txt").write_text("the user's results")
    proc = export(tmp_path / "step-1", hf, "--dtype", "fp32", "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(hf)) == [".gitattributes", "README.md", "config.json", "generation_config.json",
                                      "model.safetensors", "notes", EXPORT_RECORD, "tokenizer.json",
                                      "tokenizer_config.json"]
    assert (hf / "README.md").read_text() == "the user's model card"
    assert (hf / "notes" / "eval.txt").read_text() == "the user's results"
    tokens = torch.randint(0, 258, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # no weight of the earlier export is read back with the new ones
        assert torch.equal(load_ours(hf, original)(tokens), original(tokens))
    # The export just written is itself an earlier export to the next --overwrite.
    assert export(tmp_path / "step-1", hf, "--dtype", "bf16", "--overwrite").returncode == 0


def test_overwrite_refuses_files_no_export_of_ours_vouches_for(tmp_path):
    """--overwrite removes only files an earlier export recorded, unchanged: a user's config.json with no
    record, a link of an export's name (to a file elsewhere), a file changed since the export, and a
    folder named model.safetensors are each refused in one line that names them, and nothing changes."""
    from titanlike.hf.export import main

    synthetic_checkpoint(tmp_path / "step-1")
    earlier = tmp_path / "earlier"
    assert call(main, str(tmp_path / "step-1"), str(earlier), "--dtype", "fp32")[0] == 0
    elsewhere = tmp_path / "users_tokenizer_config.json"
    elsewhere.write_text("the user's shared file")

    def users_config(folder: Path) -> None:
        (folder / "config.json").write_text('{"the user": "own config"}')
        (folder / "notes.txt").write_text("kept")

    def link(folder: Path) -> None:
        (folder / "tokenizer_config.json").unlink()
        (folder / "tokenizer_config.json").symlink_to(elsewhere)

    def edit(folder: Path) -> None:
        (folder / "config.json").write_text('{"edited": "by the user"}')

    def weights_folder(folder: Path) -> None:
        (folder / "model.safetensors").unlink()
        (folder / "model.safetensors").mkdir()
        (folder / "model.safetensors" / "keep.bin").write_bytes(b"user data")

    cases = {"users_config": (users_config, "config.json (no export's record names it)"),
             "link": (link, "tokenizer_config.json (a link)"),
             "edited": (edit, "config.json (changed since the export)"),
             "folder": (weights_folder, "model.safetensors (not a file)")}
    for name, (change, named) in cases.items():
        folder = tmp_path / name
        if name == "users_config":
            folder.mkdir()  # a folder of the user's: no export was ever there
        else:
            shutil.copytree(earlier, folder)
        change(folder)
        before = snapshot(folder)
        rc, err = call(main, str(tmp_path / "step-1"), str(folder), "--dtype", "fp32", "--overwrite")
        assert rc == 2, (name, err)
        assert error_lines(err) == err.strip().splitlines(), err  # one line, no traceback
        line, = error_lines(err)
        assert named in line and "nothing was changed" in line, (name, line)
        assert snapshot(folder) == before, name
    assert elsewhere.read_text() == "the user's shared file"


def test_an_export_cut_short_before_its_record_is_said_to_be_one(tmp_path):
    """An export killed while its files moved in leaves them without titanlike-export.json (written last). --overwrite
    still refuses them (they cannot be told from files of the user's), but the line said only that no record named
    them: it now says the folder has no record, what an export cut short looks like, and what to do."""
    from titanlike.hf.export import EXPORT_RECORD, main

    synthetic_checkpoint(tmp_path / "step-1")
    out = tmp_path / "hf"
    assert call(main, str(tmp_path / "step-1"), str(out), "--dtype", "fp32")[0] == 0
    (out / EXPORT_RECORD).unlink()  # as a kill after the files moved in, before the record
    before = snapshot(out)
    rc, err = call(main, str(tmp_path / "step-1"), str(out), "--dtype", "fp32", "--overwrite")
    line, = error_lines(err)
    assert rc == 2 and "model.safetensors (no export's record names it)" in line, line
    assert line.endswith(f"; {out} has no {EXPORT_RECORD}, which an export writes last: if these are an export that "
                         f"was cut short, delete them and export again; if they are yours, move them away or export "
                         f"into another folder (nothing was changed)"), line
    assert snapshot(out) == before


def test_a_disk_that_fills_up_keeps_the_earlier_export_whole(tmp_path, monkeypatch):
    """The export is written whole before any file of the earlier one is replaced: when the disk fills up
    (safetensors' own error, naming the OS's) --overwrite stops in one line and the earlier export is as it
    was; a new output folder is not left behind, and no staging folder anywhere."""
    import safetensors.torch
    from safetensors import SafetensorError

    from titanlike.hf.export import main

    synthetic_checkpoint(tmp_path / "step-1")
    earlier = tmp_path / "earlier"
    assert call(main, str(tmp_path / "step-1"), str(earlier), "--dtype", "fp32")[0] == 0
    (earlier / "README.md").write_text("the user's model card")
    before = snapshot(earlier)

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    for folder, extra in ((earlier, ["--overwrite"]), (tmp_path / "new", [])):
        rc, err = call(main, str(tmp_path / "step-1"), str(folder), "--dtype", "bf16", "--tokenizer", "byte", *extra)
        assert rc == 2, err
        assert error_lines(err) == err.strip().splitlines(), err  # one line, no traceback
        line, = error_lines(err)
        assert f"{folder / 'model.safetensors'}: no space left on the device" in line, line
        assert "nothing in the output folder was changed" in line, line
    assert snapshot(earlier) == before
    assert not (tmp_path / "new").exists()
    monkeypatch.undo()
    # The same export with room to write: the earlier one replaced, the user's file kept, nothing else there.
    assert call(main, str(tmp_path / "step-1"), str(earlier), "--dtype", "bf16", "--overwrite")[0] == 0
    assert (earlier / "README.md").read_text() == "the user's model card"
    assert not [name for name in os.listdir(earlier) if name.startswith(".titanlike-export-")]
    assert snapshot(earlier)["model.safetensors"] != before["model.safetensors"]  # bf16 now, fp32 before


def test_a_second_export_into_the_same_folder_stops_at_once(tmp_path):
    """While an export holds the output folder's claim, another into it stops in one line naming the first,
    with nothing written (both wrote, and the first said it exported files the second had replaced); once
    the claim is released the export goes, and no lock file stays beside the folder."""
    from titanlike import fs
    from titanlike.hf.export import main

    synthetic_checkpoint(tmp_path / "step-1")
    hf = tmp_path / "hf"
    with fs.OutputClaim(str(hf), "titanlike-export", "the export"):
        rc, err = call(main, str(tmp_path / "step-1"), str(hf), "--tokenizer", "byte")
        assert rc == 2 and err.strip() == error_lines(err)[0], err
        assert f"another titanlike-export is writing {hf} (pid {os.getpid()} on " in err, err
        assert not hf.exists()
    assert call(main, str(tmp_path / "step-1"), str(hf), "--tokenizer", "byte")[0] == 0
    assert sorted(os.listdir(tmp_path)) == ["hf", "step-1"]


def test_a_file_that_comes_into_the_folder_while_exporting_is_kept(tmp_path, monkeypatch):
    """The folder is checked again once the export is written, before anything moves in: a config.json of the
    user's that came into it meanwhile is refused as one there at the start is, and kept (it was replaced)."""
    from titanlike.hf import interchange
    from titanlike.hf.export import main

    synthetic_checkpoint(tmp_path / "step-1")
    hf = tmp_path / "hf"
    real = interchange.write_hf_folder

    def write_hf_folder(state, margs, staging, *args, **kwargs):
        (hf / "config.json").write_text('{"the user": "own config"}')
        return real(state, margs, staging, *args, **kwargs)

    monkeypatch.setattr(interchange, "write_hf_folder", write_hf_folder)
    rc, err = call(main, str(tmp_path / "step-1"), str(hf), "--tokenizer", "byte")
    assert rc == 2 and err.strip() == error_lines(err)[0], err
    assert f"{hf} is not empty (1 entries)" in err, err
    assert os.listdir(hf) == ["config.json"] and (hf / "config.json").read_text() == '{"the user": "own config"}'


def test_an_export_inside_a_checkpoint_is_refused(tmp_path):
    """checkpoint.keep_latest_k deletes a step folder with everything in it: an export written inside one
    would go with it, so it is refused, as the step folder itself is."""
    from titanlike.hf.export import main

    synthetic_checkpoint(tmp_path / "step-1")
    for out in (tmp_path / "step-1", tmp_path / "step-1" / "hf", tmp_path / "step-1" / "new" / "hf"):
        rc, err = call(main, str(tmp_path / "step-1"), str(out), "--tokenizer", "byte")
        assert rc == 2, err
        line, = error_lines(err)
        assert err.strip() == line, err
        assert ("is a checkpoint" if out == tmp_path / "step-1" else "inside the checkpoint") in line, line
    assert not {"hf", "new"} & set(os.listdir(tmp_path / "step-1"))


def test_a_path_that_is_not_a_folder_is_said_as_what_it_is(tmp_path):
    """A file given as the checkpoint, to export or to generate, and a dangling link given as the output, are
    each one line naming what they are, not a missing folder."""
    from titanlike.hf.export import main
    from titanlike.hf.generate import main as generate

    synthetic_checkpoint(tmp_path / "step-1")
    (tmp_path / "afile").write_text("x")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    for tool, argv, said in ((main, [tmp_path / "afile", tmp_path / "out"], f"{tmp_path}/afile: a file, not a folder"),
                             (generate, [tmp_path / "afile"], f"{tmp_path}/afile: a file, not a folder"),
                             (main, [tmp_path / "step-1", tmp_path / "dangling", "--tokenizer", "byte"],
                              f"{tmp_path}/dangling is a link to '{tmp_path}/gone', which does not exist")):
        rc, err = call(tool, *map(str, argv))
        assert rc == 2, err
        line, = error_lines(err)
        assert err.strip() == line and line.startswith(f"error: {said}"), line
    assert not (tmp_path / "gone").exists() and not (tmp_path / "out").exists()


def snapshot(folder: Path) -> dict:
    """Every entry under `folder`: a link's target, a file's bytes, a folder's name."""
    out = {}
    for path in sorted(folder.rglob("*")):
        key = str(path.relative_to(folder))
        out[key] = (os.readlink(path) if path.is_symlink() else path.read_bytes() if path.is_file() else "folder")
    return out


# ---- checkpoints of real runs: the two-rank reference runs (conftest, slow tier) and the trained run ----


def plain_model(step_dir: Path):
    from titanlike.model.decoder import Transformer
    from titanlike.model.shape import ModelArgs

    margs = ModelArgs(**json.loads((step_dir / "model_args.json").read_text()))
    with torch.device("meta"):
        model = Transformer(margs)
    model.to_empty(device="cpu")
    model.init_weights(seed=123, seq_len=64)  # not the trained weights: loading must replace them all
    return model


TOKENS = torch.randint(0, 258, (2, 64), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def exported(ref, tmp_path_factory):
    """The reference run's last checkpoint, exported in fp32: (step folder, Hugging Face folder)."""
    step_dir, out = ckpt(ref[0]) / f"step-{STEPS}", tmp_path_factory.mktemp("export") / "hf"
    proc = export_command(step_dir, out, "--dtype", "fp32")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == (f"exported {step_dir} to {out} (fp32, LlamaForCausalLM): model.safetensors, "
                                   f"config.json, generation_config.json, tokenizer.json, tokenizer_config.json")
    return step_dir, out


def assert_round_trip(step_dir: Path, hf: Path) -> None:
    from_dcp, from_hf = plain_model(step_dir), plain_model(step_dir)
    with torch.no_grad():
        before = from_hf(TOKENS)
    load_in_process(from_dcp, step_dir)  # the checkpoint itself, read by DCP
    load_in_process(from_hf, hf)  # the export, read back through interchange.py
    for (name, a), (_, b) in zip(from_dcp.state_dict().items(), from_hf.state_dict().items()):
        assert torch.equal(a, b), name
    with torch.no_grad():
        logits = from_hf(TOKENS)
        assert torch.equal(logits, from_dcp(TOKENS))
        assert not torch.allclose(logits, before)


@pytest.mark.slow
def test_export_import_round_trip_gives_identical_logits(exported, tmp_path):
    step_dir, hf = exported
    assert sorted(os.listdir(hf)) == ["config.json", "generation_config.json", "model.safetensors",
                                      "titanlike-export.json", "tokenizer.json", "tokenizer_config.json"]
    assert_round_trip(step_dir, hf)

    # bf16 (the default): the same weights, rounded.
    assert export(step_dir, tmp_path / "hf16").returncode == 0
    from safetensors.torch import load_file

    exact, rounded = load_file(hf / "model.safetensors"), load_file(tmp_path / "hf16" / "model.safetensors")
    assert json.loads((tmp_path / "hf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert rounded.keys() == exact.keys()
    assert all(rounded[k].dtype == torch.bfloat16 and torch.equal(rounded[k], exact[k].bfloat16()) for k in exact)


@pytest.mark.slow
def test_export_of_float8_checkpoint(ref_fp8, tmp_path):
    step_dir = ckpt(ref_fp8[0]) / f"step-{STEPS}"
    assert export(step_dir, tmp_path / "hf", "--dtype", "fp32").returncode == 0
    assert_round_trip(step_dir, tmp_path / "hf")


@pytest.mark.slow
def test_two_rank_run_starts_from_export(exported, tmp_path, corpus):
    """`--checkpoint.initial_load_path <hf folder>` on two sharded ranks: the first step's loss is
    the loss of the exported weights on the first global batch, computed here in one process."""
    from titanlike.data.loader import GlobalBatchSampler, open_dataset
    from titanlike.data.order import EpochOrder
    from titanlike.model.loss import cross_entropy

    step_dir, hf = exported
    run_train(tmp_path, *SCHEDULE, "--training.steps", "1", "--checkpoint.enable", "false",
              "--checkpoint.initial_load_path", str(hf), nproc=2, corpus=corpus)
    model = plain_model(step_dir)
    load_in_process(model, hf)
    data = open_dataset(corpus[0], 64, model.args.vocab_size, "data.path")
    first = next(iter(GlobalBatchSampler(EpochOrder(len(data), 0), 8, 8, 0, 1)))
    batch = torch.stack([data[i] for i in first])
    with torch.no_grad():
        want = cross_entropy(model(batch[:, :-1]), batch[:, 1:]).item()
    assert step_losses(tmp_path)[1] == pytest.approx(want, rel=1e-5)


def test_export_tied_embeddings(tmp_path):
    step_dir = tmp_path / "step-1"
    original = synthetic_checkpoint(step_dir, tie_embeddings=True)
    assert export(step_dir, tmp_path / "hf", "--dtype", "fp32", "--trust-pickled-dcp").returncode == 0
    from safetensors.torch import load_file

    assert "lm_head.weight" not in load_file(tmp_path / "hf" / "model.safetensors")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["tie_word_embeddings"] is True
    for source in (tmp_path / "hf", step_dir):  # the export, and the checkpoint itself
        loaded = plain_model(step_dir)
        load_in_process(loaded, source, trust=True)
        assert loaded.output.weight is loaded.tok_embeddings.weight
        with torch.no_grad():
            assert torch.equal(loaded(TOKENS), original(TOKENS))


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True])
def test_export_loads_in_transformers_llama(request, tmp_path, tied):
    transformers = pytest.importorskip("transformers",
                                       reason="transformers is not installed (pip install transformers)")
    if tied:
        step_dir, hf = tmp_path / "step-1", tmp_path / "hf"
        original = synthetic_checkpoint(step_dir, tie_embeddings=True)
        assert export(step_dir, hf, "--dtype", "fp32", "--trust-pickled-dcp").returncode == 0
    else:
        step_dir, hf = request.getfixturevalue("exported")
        original = plain_model(step_dir)
        load_in_process(original, step_dir)
    model = transformers.LlamaForCausalLM.from_pretrained(str(hf), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ours, theirs = original(TOKENS), model(TOKENS).logits
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-4)


@pytest.mark.slow
def test_export_errors(tmp_path, ref, capsys):
    missing = export_command(tmp_path / "nope", tmp_path / "out")  # the real command line: exit code 2
    assert missing.returncode == 2 and error_lines(missing.stderr) == [f"error: {tmp_path}/nope: no such folder"]

    from titanlike.hf.export import main

    def one_line_error(*argv: str) -> str:
        capsys.readouterr()
        assert main([*map(str, argv)]) == 2
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1, lines
        return lines[0]

    assert one_line_error(ckpt(ref[0]), tmp_path / "out") == (
        f"error: {ckpt(ref[0])} holds checkpoints, it is not one: pass a step folder, e.g. {ckpt(ref[0])}/step-{STEPS}"
    )
    (tmp_path / "empty").mkdir()
    assert one_line_error(tmp_path / "empty", tmp_path / "out") == (
        f"error: {tmp_path}/empty is not a titanlike checkpoint step folder (no .metadata)"
    )
    shutil.copytree(ckpt(ref[0]) / f"step-{STEPS}", tmp_path / f"step-{STEPS + 2}.tmp")
    assert "a save that never completed" in one_line_error(tmp_path / f"step-{STEPS + 2}.tmp", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_of_a_run_folder_names_its_newest_intact_step(tmp_path, capsys):
    """`titanlike-export RUN_FOLDER OUT`: the dump folder, not a step folder; the line names the newest step
    of its checkpoint folder that is complete (a half-written or emptied newer one is passed over)."""
    from titanlike.hf.export import main

    run = tmp_path / "run"
    for step, files in ((4, (".metadata", "model_args.json")), (6, (".metadata", "model_args.json")), (9, ())):
        (run / "checkpoint" / f"step-{step}").mkdir(parents=True)
        for name in files:
            (run / "checkpoint" / f"step-{step}" / name).write_text("{}")
    (run / "checkpoint" / "step-12.tmp").mkdir()
    (run / "metrics.jsonl").write_text("")
    assert main([str(run), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: {run} is a run folder, not a checkpoint: pass a step folder, e.g. {run}/checkpoint/step-6"]
    assert main([str(run / "checkpoint"), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: {run}/checkpoint holds checkpoints, it is not one: pass a step folder, e.g. {run}/checkpoint/step-6"]
    assert not (tmp_path / "out").exists()


def test_the_export_says_the_longest_window_the_weights_trained_on(trained_run, tmp_path):
    """max_position_embeddings was model.max_seq_len (131072 for the presets) for a model trained on 64-token
    windows: transformers and serving stacks read it as the context the model works in. It is the longest window
    trained by the saved step, a long-context stage counted once it has begun, at most model.max_seq_len."""
    from titanlike.hf.export import main

    rc, err = call(main, str(trained_run / "checkpoint" / "step-4"), str(tmp_path / "hf"))
    assert rc == 0, err
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["max_position_embeddings"] == 64
    assert json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())["model_max_length"] == 64
    from titanlike.config.stages import Stage, trained_window

    later = "; ".join(Stage(start, seq_len, 1e6, 8, 4, 2).describe() for start, seq_len in ((5, 256), (9, 1024)))
    settings = {"data.seq_len": 64, "data.stages": later}
    assert [trained_window(settings, step) for step in (4, 5, 8, 9, 10)] == [64, 256, 256, 1024, 1024]
    assert trained_window({"data.seq_len": 64, "data.stages": "none"}, 4) == 64
    assert trained_window({}, 4) is None and trained_window(None, 4) is None  # then model.max_seq_len


def test_export_of_a_folder_with_garbage_is_one_line(trained_run, tmp_path):
    from titanlike.hf import export

    dump = copy_run(trained_run, tmp_path / "run")
    step = dump / "checkpoint" / "step-4"
    (step / "model_args.json").write_text("{garbage")
    rc, err = call(export.main, str(step), str(tmp_path / "hf"))
    assert rc == 2 and len(error_lines(err)) == 1 and "model_args.json" in error_lines(err)[0]
    # A foreign folder (no manifest) whose .metadata is not a pickle at all, exported with the trust flag.
    foreign = tmp_path / "foreign"
    shutil.copytree(trained_run / "checkpoint" / "step-4", foreign)
    (foreign / "manifest.json").unlink()
    (foreign / ".metadata").write_bytes(b"not a pickle")
    rc, err = call(export.main, str(foreign), str(tmp_path / "hf2"), "--trust-pickled-dcp")
    assert rc == 2
    (line,) = error_lines(err)
    assert line.startswith(f"error: {foreign}/.metadata cannot be read (")
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf2").exists()


# ---- the whole path -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_prepare_train_export_transformers_generate(tmp_path):
    """The README's "Train on your own data", end to end with a trained BPE tokenizer and a QK-norm shape."""
    transformers = pytest.importorskip("transformers", reason=NO_TRANSFORMERS)
    tokenizers = pytest.importorskip("tokenizers")
    from titanlike.data.corpus import stdlib_files

    texts = [f.read_text(encoding="utf-8", errors="replace") for f in stdlib_files()[:80]]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    bpe.train_from_iterator(texts, tokenizers.trainers.BpeTrainer(vocab_size=1000, special_tokens=["<|endoftext|>"],
                                                                  initial_alphabet=alphabet))
    bpe.save(str(tmp_path / "tokenizer.json"))
    data = tmp_path / "data"
    proc = run_python("-m", "titanlike.data.prepare", str(data), str(corpus), "--tokenizer",
                      str(tmp_path / "tokenizer.json"), "--workers", "2", "--val-fraction", "0.05")
    assert proc.returncode == 0, proc.stderr
    run = tmp_path / "run"
    run_train(run, "--data.path", str(data / "train"), "--data.val_path", str(data / "val"), "--model.dim", "64",
              "--model.n_heads", "4", "--model.n_kv_heads", "2", "--model.n_layers", "2", "--model.ffn_dim", "128",
              "--model.qk_norm", "--training.steps", "3", "--data.seq_len", "32", "--training.local_batch_size", "2",
              "--checkpoint.enable", "--checkpoint.interval", "3", "--validation.freq", "3", "--validation.steps", "1")
    step = run / "checkpoint" / "step-3"
    assert json.loads((step / "model_args.json").read_text())["vocab_size"] == 1024  # 1000 rounded up to 64s
    assert export(step, tmp_path / "hf", "--dtype", "fp32").returncode == 0
    hf = tmp_path / "hf"
    assert (hf / "tokenizer.json").read_text() == (tmp_path / "tokenizer.json").read_text()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(hf))
    sample = "def main():\n    return 0\n"
    ids = tok(sample, add_special_tokens=False)["input_ids"]
    assert ids == bpe.encode(sample, add_special_tokens=False).ids and tok.decode(ids) == sample
    assert tok.eos_token == "<|endoftext|>" and model.config.eos_token_id == tok.eos_token_id
    from titanlike.checkpoint.weights import read_model_weights

    margs, state = read_model_weights(str(step))
    ours = Transformer(margs)
    ours.load_state_dict(state, strict=False)
    ours.init_rope(64)
    with torch.no_grad():
        torch.testing.assert_close(model(torch.tensor([ids])).logits, ours(torch.tensor([ids])), rtol=0, atol=1e-4)
    # titanlike-generate samples from the step folder and from the export with the same greedy text.
    outs = [run_python("-m", "titanlike.hf.generate", str(src), "--prompt", "def ", "--max-new-tokens", "8",
                       "--temperature", "0") for src in (step, hf)]
    assert all(o.returncode == 0 for o in outs), [o.stderr for o in outs]
    assert outs[0].stdout == outs[1].stdout and outs[0].stdout.startswith("def ")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_export_refuses_nonfinite_weights_unless_allowed(tmp_path, bad, monkeypatch):
    """A diverged run's weights: one line naming the first tensor with a NaN or an infinity, exit 2,
    nothing written (not even the folder); --allow-nonfinite exports them as they are. The check reads
    a large tensor a slice at a time (here slices of 1000 values, so the bad value is in a later one)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from titanlike.hf import export as export_module

    model = synthetic_checkpoint(tmp_path / "good")
    with torch.no_grad():
        model.layers[1].feed_forward.w1.weight.view(-1)[5000] = bad  # the sixth slice of 1000
        model.layers[1].feed_forward.w2.weight.view(-1)[7] = bad  # a later tensor in the model's order
    step = tmp_path / "step-9"
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(step), no_dist=True)
    shutil.copy(tmp_path / "good" / "model_args.json", step / "model_args.json")
    seal(str(step))
    monkeypatch.setattr(export_module, "NONFINITE_CHUNK", 1000)

    hf = tmp_path / "hf"
    rc, err = call(export_module.main, str(step), str(hf), "--dtype", "fp32", "--tokenizer", "byte")
    assert rc == 2 and error_lines(err) == err.strip().splitlines(), err
    (line,) = error_lines(err)
    what = "NaN" if bad != bad else "infinite"
    shape = tuple(model.layers[1].feed_forward.w1.weight.shape)
    assert line == (f"error: {step}: layers.1.feed_forward.w1.weight holds non-finite values: 1 {what} "
                    f"of its {shape[0] * shape[1]:,}; the run diverged before this step, so export an earlier "
                    f"checkpoint (or pass --allow-nonfinite to export the weights as they are)"), line
    assert not hf.exists()

    rc, err = call(export_module.main, str(step), str(hf), "--dtype", "fp32", "--tokenizer", "byte",
                   "--allow-nonfinite")
    assert rc == 0, err
    from safetensors.torch import load_file

    exported = load_file(hf / "model.safetensors")["model.layers.1.mlp.down_proj.weight"]
    assert torch.equal(exported.isfinite(), model.layers[1].feed_forward.w2.weight.isfinite())
    assert export_module.first_nonfinite({"good": torch.zeros(3000), "ints": torch.arange(5)}) is None
