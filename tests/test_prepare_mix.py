"""titanlike-prepare for mixtures: the text field found or named per input, each input's token count,
and `--mix-report` (what folders hold, and the epochs a mixture would make of them)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from conftest import run_python
from test_prepare import documents, shard_tokens
from titanlike.data.prepare.cli import main
from titanlike.data.prepare.driver import prepare
from titanlike.data.tokenizer import ByteTokenizer
from titanlike.errors import UserError


def jsonl(path: Path, field: str, docs: list[str], opener=open) -> str:
    with opener(path, "wt", encoding="utf-8") as f:
        f.write("".join(json.dumps({"id": i, field: d}) + "\n" for i, d in enumerate(docs)))
    return str(path)


def test_the_text_field_is_found_per_file_or_named_per_input(tmp_path):
    web = [f"web page {i}" for i in range(6)]
    code = [f"def f{i}(): pass" for i in range(4)]
    books = [f"Chapter {i}." for i in range(3)]
    inputs = [jsonl(tmp_path / "web.jsonl", "text", web), jsonl(tmp_path / "code.jsonl", "content", code),
              jsonl(tmp_path / "books.jsonl.gz", "raw_content", books, opener=gzip.open)]
    info = prepare(str(tmp_path / "auto"), inputs, workers=1, val_fraction=0)
    assert documents(shard_tokens(tmp_path / "auto" / "train"), ByteTokenizer()) == web + code + books
    assert [s["text_fields"] for s in info["sources"]] == [["text"], ["content"], ["raw_content"]]
    assert [s["documents"] for s in info["sources"]] == [6, 4, 3]
    assert sum(s["tokens"] for s in info["sources"]) == info["splits"]["train"]["tokens"]
    # Named per input, in order; a field the usual names miss.
    odd = jsonl(tmp_path / "odd.jsonl", "words", ["odd one"])
    info = prepare(str(tmp_path / "named"), [inputs[0], odd], text_field=["text", "words"], workers=1, val_fraction=0)
    assert [s["text_fields"] for s in info["sources"]] == [["text"], ["words"]]
    with pytest.raises(UserError, match="odd.jsonl has none of the usual text fields .*its fields: id, words"):
        prepare(str(tmp_path / "missing"), [odd], workers=1, val_fraction=0)
    with pytest.raises(UserError, match="--text-field is given 2 times for 3 inputs: give it once"):
        prepare(str(tmp_path / "count"), inputs, text_field=["text", "content"], workers=1, val_fraction=0)


def test_inputs_split_at_their_boundaries_give_the_same_shards(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(6):
        (folder / f"{i}.txt").write_text(f"document {i} " * 10)
    prepare(str(tmp_path / "one"), [str(folder)], workers=1, val_fraction=0.2)
    prepare(str(tmp_path / "two"), [str(folder / f"{i}.txt") for i in range(6)], workers=2, val_fraction=0.2)
    for split in ("train", "val"):
        assert (shard_tokens(tmp_path / "one" / split) == shard_tokens(tmp_path / "two" / split)).all()


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("report")
    out = {}
    for name, n, text in (("web", 40, "a web page about things "), ("code", 8, "def f(): return 1\n")):
        jsonl(root / f"{name}.jsonl", "text", [text * 5 for _ in range(n)])
        prepare(str(root / name), [str(root / f"{name}.jsonl")], workers=1, val_fraction=0.1)
        out[name] = str(root / name)
    return out


def test_the_summary_names_each_inputs_tokens(tmp_path, folders):
    a = jsonl(tmp_path / "a.jsonl", "text", ["x" * 100] * 3)
    b = jsonl(tmp_path / "b.jsonl", "content", ["y" * 50] * 2)
    proc = run_python("-m", "titanlike.data.prepare", str(tmp_path / "out"), a, b, "--val-fraction", "0")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert f"  {a}: 3 documents, 306 tokens (74.6%), text from text" in lines
    assert f"  {b}: 2 documents, 104 tokens (25.4%), text from content" in lines


def test_mix_report_lists_folders_and_the_epochs_a_mixture_makes(folders, capsys):
    web, code = folders["web"], folders["code"]
    assert main(["--mix-report", web, code]) == 0
    out = capsys.readouterr().out.splitlines()
    train = {n: json.loads(Path(f, "dataset.json").read_text())["splits"]["train"]["tokens"]
             for n, f in folders.items()}
    assert out[0].split() == ["source", "train", "tokens", "val", "tokens", "documents", "tokenizer"]
    assert out[1].startswith("web") and f"{train['web']:,}" in out[1] and "byte, 258 ids" in out[1]
    steps, per_step = 100, 64
    assert main(["--mix-report", "--mix", f"web={web}:0.7,code={code}:0.3", "--steps", str(steps),
                 "--tokens-per-step", str(per_step)]) == 0
    out = capsys.readouterr().out
    code_epochs = 0.3 * steps * per_step / train["code"]
    assert f"training on {steps * per_step:,} tokens:" in out
    assert f"code would repeat {code_epochs:.1f} times" in out and f"{code_epochs:8.2f} epochs" in out


def test_mix_report_refuses_what_training_would(tmp_path, folders, capsys):
    assert main(["--mix-report", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (f"error: {tmp_path} has no dataset.json: give folders "
                                               f"titanlike-prepare wrote")
    assert main(["--mix-report", "--mix", f"web={folders['web']}:0"]) == 2
    assert "source web's weight 0 must be a finite number > 0" in capsys.readouterr().err
    other = tmp_path / "other"
    (other / "train").mkdir(parents=True)
    record = json.loads(Path(folders["code"], "dataset.json").read_text())
    (other / "dataset.json").write_text(json.dumps({**record, "vocab_size": 300}))
    assert main(["--mix-report", "--mix", f"web={folders['web']}:1,other={other}:1"]) == 2
    assert "were tokenized differently" in capsys.readouterr().err


@pytest.mark.parametrize("tokens", ["1e400", "nan", "inf", "-1"])
def test_mix_report_refuses_a_token_count_that_is_not_a_number_in_one_line(folders, tokens):
    from conftest import call

    rc, err = call(main, "--mix-report", "--mix", f"web={folders['web']}:1", "--tokens", tokens)
    assert rc == 2
    assert err.startswith(f"error: argument --tokens: {tokens} must be a finite number >= 0") and \
        err.count("\n") == 1, err


def test_mix_report_checks_the_recorded_tokens_against_the_shards(tmp_path, folders, capsys):
    import shutil

    edited = tmp_path / "edited"
    shutil.copytree(folders["code"], edited)
    record = json.loads((edited / "dataset.json").read_text())
    have = record["splits"]["train"]["tokens"]
    record["splits"]["train"]["tokens"] = have * 1000
    (edited / "dataset.json").write_text(json.dumps(record))
    assert main(["--mix-report", "--mix", f"web={folders['web']}:1,code={edited}:1", "--tokens", "1e6"]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: {edited}/dataset.json records {have * 1000:,} training tokens but its train/ shards "
                   f"hold {have:,}: the record was edited or the shards changed; re-make the data with "
                   f"titanlike-prepare\n"), err
