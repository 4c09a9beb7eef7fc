"""titanlike-prepare: every input format, both tokenizer kinds, identical shards for any number of
workers, dataset.json and what training reads from it, and one clear line for each bad input."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import numpy as np
import pytest

from conftest import resolve_model_args, run_python
from titanlike.config import ConfigError, load_config
from titanlike.data.prepare import readers
from titanlike.data.prepare.driver import prepare
from titanlike.data.prepare.readers import ALL_SUFFIXES
from titanlike.data.shards import find_shards
from titanlike.data.tokenizer import ByteTokenizer, HFTokenizer
from titanlike.errors import UserError

DOCS = [f"Document {i}: " + "the quick brown fox jumps over the lazy dog, naïvely. " * (i % 5 + 1) + "✓"
        for i in range(60)]


def shard_tokens(folder: Path) -> np.ndarray:
    return np.concatenate([np.asarray(s.tokens, dtype=np.int64) for s in find_shards(str(folder))])


def documents(tokens: np.ndarray, tok) -> list[str]:
    """Split a token stream at EOS, drop BOS, decode each document."""
    ends = np.flatnonzero(tokens == tok.eos_id)
    out, start = [], 0
    for end in ends:
        doc = tokens[start:end]
        if tok.bos_id is not None:
            assert doc[0] == tok.bos_id
            doc = doc[1:]
        out.append(tok.decode(doc))
        start = end + 1
    assert start == tokens.size
    return out


def write_inputs(root: Path) -> list[str]:
    """DOCS spread over every format, in this order: txt, md, jsonl, jsonl.gz, jsonl.zst, parquet."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "a.txt").write_text(DOCS[0], encoding="utf-8")
    (root / "b.md").write_text(DOCS[1], encoding="utf-8")
    lines = lambda docs: "".join(json.dumps({"text": d, "id": 1}) + "\n" for d in docs)  # noqa: E731
    (root / "c.jsonl").write_text(lines(DOCS[2:20]), encoding="utf-8")
    with gzip.open(root / "d.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(lines(DOCS[20:30]))
    zstandard = pytest.importorskip("zstandard")
    (root / "e.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines(DOCS[30:40]).encode()))
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": DOCS[40:60], "n": list(range(20))}), root / "f.parquet", row_group_size=6)
    return [str(root / n) for n in ("a.txt", "b.md", "c.jsonl", "d.jsonl.gz", "e.jsonl.zst", "f.parquet")]


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory) -> str:
    """A small byte-level BPE trained on the spot (no download): its tokenizer.json."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(DOCS * 3, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


# ---- formats and tokenizers -----------------------------------------------------------------------



# titanlike-prepare whose workers never finish a chunk: a run to signal, or to hold OUT, while it tokenizes.
HANGING_PREPARE = ("import sys, time\n"
                   "import titanlike.data.prepare.workers as w\n"
                   "w.read_chunk = lambda chunk: time.sleep(600)\n"
                   "from titanlike.data.prepare.cli import main\n"
                   "sys.exit(main(sys.argv[1:]))\n")

def test_every_format_with_the_byte_tokenizer(tmp_path):
    inputs = write_inputs(tmp_path / "in")
    info = prepare(str(tmp_path / "out"), inputs, workers=1, val_fraction=0)
    tok = ByteTokenizer()
    assert documents(shard_tokens(tmp_path / "out" / "train"), tok) == DOCS
    assert info["documents"] == 60 and info["vocab_size"] == 258 and (info["bos_id"], info["eos_id"]) == (256, 257)
    recorded = json.loads((tmp_path / "out" / "dataset.json").read_text())
    assert recorded["splits"]["train"]["tokens"] == sum(len(d.encode()) + 2 for d in DOCS)
    assert recorded["tokenizer"]["kind"] == "byte"
    assert not (tmp_path / "out" / "val").exists()


def test_folders_and_globs(tmp_path):
    write_inputs(tmp_path / "in")
    (tmp_path / "in" / "notes.csv").write_text("not read")
    from_folder = prepare(str(tmp_path / "a"), [str(tmp_path / "in")], workers=1, val_fraction=0)
    from_glob = prepare(str(tmp_path / "b"), [str(tmp_path / "in" / "*")], workers=1, val_fraction=0)
    assert from_folder["files"] == from_glob["files"] == 6
    assert (shard_tokens(tmp_path / "a" / "train") == shard_tokens(tmp_path / "b" / "train")).all()


def test_hf_tokenizer_and_dataset_json(tmp_path, hf_tokenizer):
    inputs = write_inputs(tmp_path / "in")
    info = prepare(str(tmp_path / "out"), inputs, tokenizer=hf_tokenizer, workers=1, val_fraction=0.1)
    tok = HFTokenizer(hf_tokenizer)
    assert tok.bos_id is None and tok.eos_token == "<|endoftext|>"
    train = shard_tokens(tmp_path / "out" / "train")
    val = shard_tokens(tmp_path / "out" / "val")
    # A document drawn (with probability 0.1, by its place), or any while val is empty, is held out while val,
    # with it, keeps within twice 10 % of the tokens so far; the rest train, each tokenized exactly as the
    # tokenizer does.
    from titanlike.data.prepare.driver import Holdout

    drawn = Holdout(0.1, 1).draw(0, len(DOCS)) < 0.1
    held, kept, total, held_tokens, places = [], [], 0, 0, []
    for i, d in enumerate(DOCS):
        n = len(tok.tok.encode(d, add_special_tokens=False).ids) + 1
        total += n
        if (drawn[i] or not held_tokens) and held_tokens + n <= 2 * 0.1 * total:
            held.append(d)
            places.append(i)
            held_tokens += n
        else:
            kept.append(d)
    expected = np.concatenate([np.append(tok.tok.encode(d, add_special_tokens=False).ids, tok.eos_id) for d in kept])
    np.testing.assert_array_equal(train, expected)
    assert documents(val, tok) == held
    out = tmp_path / "out"
    # Which documents went to val, per INPUT (write_inputs: a.txt, b.md, then 18, 10, 10 and 20 lines or rows).
    firsts = [0, 1, 2, 20, 30, 40]
    recorded = json.loads((out / "val_documents.json").read_text())["inputs"]
    assert [r["input"] for r in recorded] == [os.path.abspath(i) for i in inputs]
    assert sorted(firsts[k] + j for k, r in enumerate(recorded) for j in r["val_documents"]) == places
    assert (out / "tokenizer.json").read_text() == Path(hf_tokenizer).read_text()
    vocab = tok.tok.get_vocab_size()
    assert info["splits"]["val"]["documents"] == len(held) >= 4 and info["vocab_size"] == vocab and 320 < vocab <= 384
    # Training reads dataset.json: the vocabulary is the tokenizer's rounded up to a multiple of 64.
    assert resolve_model_args(load_config(["--data.path", str(out / "train")])).vocab_size == 384
    larger = load_config(["--data.path", str(out / "train"), "--model.vocab_size", "512"])
    assert resolve_model_args(larger).vocab_size == 512
    with pytest.raises(ConfigError, match=f"model.vocab_size = 300 is smaller than the tokenizer's {vocab} ids"):
        resolve_model_args(load_config(["--data.path", str(out / "train"), "--model.vocab_size", "300"]))


def test_a_tokenizer_without_end_of_text_lists_its_special_tokens(tmp_path):
    """The line names the tokens --eos-token could be (the tokenizer's special ones), not only the usual names
    it looked for."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<doc_end>", "<pad>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(DOCS, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("some text")
    with pytest.raises(UserError, match=r"its special tokens: <doc_end>, <pad>\)?; name the one that separates "
                                        r"documents with --eos-token"):
        prepare(str(tmp_path / "out"), [str(tmp_path / "a.txt")], str(tmp_path / "tokenizer.json"))


def test_workers_give_identical_shards(tmp_path, hf_tokenizer, monkeypatch):
    # Small chunks and shards, so that 4 workers really share the work and shards split mid-stream.
    monkeypatch.setattr(readers, "CHUNK_BYTES", 2048)
    inputs = write_inputs(tmp_path / "in")
    for n in (1, 4):
        prepare(str(tmp_path / f"w{n}"), inputs, tokenizer=hf_tokenizer, workers=n, val_fraction=0.2, shard_tokens=997)
    for split in ("train", "val"):
        one, four = sorted((tmp_path / "w1" / split).iterdir()), sorted((tmp_path / "w4" / split).iterdir())
        assert [p.name for p in one] == [p.name for p in four] and len(one) > (split == "train")
        assert all(a.read_bytes() == b.read_bytes() for a, b in zip(one, four))


def test_shards_are_cut_at_shard_tokens(tmp_path):
    inputs = write_inputs(tmp_path / "in")
    prepare(str(tmp_path / "one"), inputs, workers=1, val_fraction=0)
    prepare(str(tmp_path / "many"), inputs, workers=1, val_fraction=0, shard_tokens=1000)
    shards = find_shards(str(tmp_path / "many" / "train"))
    assert [s.count for s in shards[:-1]] == [1000] * (len(shards) - 1)
    np.testing.assert_array_equal(shard_tokens(tmp_path / "many" / "train"), shard_tokens(tmp_path / "one" / "train"))


# ---- the command: output handling and bad input --------------------------------------------------------


def cmd(*args: str):
    return run_python("-m", "titanlike.data.prepare", *args)


def one_error(proc, *fragments: str) -> str:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def test_help_lists_every_extension():
    out = cmd("--help").stdout
    for suffix in ALL_SUFFIXES:
        assert suffix in out


def test_usage_names_both_forms(capsys):
    """The usage line (printed with --help and over every argument error) names --mix-report too."""
    from titanlike.data.prepare.cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    usage = capsys.readouterr().out.split("\n\n")[0]
    assert "usage: titanlike-prepare " in usage and "titanlike-prepare --mix-report FOLDER" in usage, usage


def test_refuses_to_overwrite_and_overwrite_replaces(tmp_path):
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "b.txt").write_text("second")
    assert cmd(str(tmp_path / "out"), str(tmp_path / "a.txt"), "--val-fraction", "0").returncode == 0
    one_error(cmd(str(tmp_path / "out"), str(tmp_path / "b.txt")), "exists", "--overwrite")
    assert cmd(str(tmp_path / "out"), str(tmp_path / "b.txt"), "--overwrite", "--val-fraction", "0").returncode == 0
    assert documents(shard_tokens(tmp_path / "out" / "train"), ByteTokenizer()) == ["second"]
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "b.txt", "out"]  # no temporary or old folder left


def test_no_validation_documents_says_how_to_get_some(tmp_path):
    (tmp_path / "one.txt").write_text("a single document")
    proc = cmd(str(tmp_path / "out"), str(tmp_path / "one.txt"))
    assert proc.returncode == 0
    assert "no validation data" in proc.stderr and "give more documents" in proc.stderr
    assert "--data.val_path" not in proc.stdout
    for i in range(5):
        (tmp_path / f"doc{i}.txt").write_text(f"document {i}")
    proc = cmd(str(tmp_path / "out5"), *[str(tmp_path / f"doc{i}.txt") for i in range(5)])
    assert "pass --val-fraction 0.4" in proc.stderr
    proc = cmd(str(tmp_path / "out5b"), *[str(tmp_path / f"doc{i}.txt") for i in range(5)], "--val-fraction", "0.4")
    assert f"--data.val_path {tmp_path}/out5b/val" in proc.stdout


def test_val_fraction_is_a_share_of_tokens(tmp_path):
    """One long document where every 100th would be held out no longer puts a third of the tokens into val:
    --val-fraction 0.01 holds out about 1 % of the tokens (whole documents, the long one kept in train)."""
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(3000):
        (docs / f"{i:04d}.txt").write_text(("long text " * 20000) if i == 99 else f"short document {i:04d} " * 5)
    info = prepare(str(tmp_path / "out"), [str(docs)], workers=1, val_fraction=0.01)
    train, val = info["splits"]["train"]["tokens"], info["splits"]["val"]["tokens"]
    assert 0.005 < val / (train + val) <= 0.02 and val < 200_000, (train, val)
    assert info["val_fraction"] == 0.01


def test_val_holds_documents_at_random_whatever_their_length(tmp_path):
    """Short and long documents, interleaved: val's documents are as long as train's on average (holding out
    the first document that fit drew the short ones: man pages in val averaged 530 tokens, 3,215 in train)."""
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(2000):
        (docs / f"{i:04d}.txt").write_text("word " * (20 if i % 2 else 400))  # 100 and 2,000 bytes
    info = prepare(str(tmp_path / "out"), [str(docs)], workers=1, val_fraction=0.05)
    train, val = info["splits"]["train"], info["splits"]["val"]
    mean_train, mean_val = train["tokens"] / train["documents"], val["tokens"] / val["documents"]
    assert val["documents"] >= 60 and abs(mean_val / mean_train - 1) < 0.25, (train, val)
    recorded = json.loads((tmp_path / "out" / "val_documents.json").read_text())["inputs"]
    assert len(recorded[0]["val_documents"]) == val["documents"]


def bad_inputs(root: Path) -> list[tuple[list[str], tuple[str, ...]]]:
    root.mkdir()
    (root / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (root / "bad.jsonl").write_text('{"text": "ok"}\n{"txt": "no text field"}\n')
    (root / "empty.txt").write_text("")
    (root / "empty_dir").mkdir()
    (root / "csv_only").mkdir()
    (root / "csv_only" / "x.csv").write_text("a,b")
    (root / "broken.json").write_text("{ this is not json")
    (root / "trunc.jsonl.gz").write_bytes(gzip.compress(b'{"text": "x"}\n' * 100)[:40])
    (root / "surrogate.jsonl").write_text('{"text": "fine"}\n{"text": "half a pair: \\ud800"}\n')
    cases = [
        ([str(root / "latin1.txt")], ("latin1.txt: not UTF-8 text (byte 0xe9 at offset 3)",)),
        ([str(root / "bad.jsonl")], ("bad.jsonl:2 is not a JSON object with a 'text' field",)),
        ([str(root / "empty.txt")], ("no documents", "nothing to train on")),
        ([str(root / "empty_dir")], ("empty_dir: no input files in this folder", ".parquet")),
        ([str(root / "csv_only")], ("csv_only: no input files in this folder",)),
        ([str(root / "nothing*.jsonl")], ("nothing*.jsonl: no input files match",)),
        ([str(root / "missing.txt")], ("missing.txt: no such file or folder",)),
        ([str(root / "csv_only" / "x.csv")], ("x.csv: unknown input format",)),
        ([str(root / "trunc.jsonl.gz")], ("trunc.jsonl.gz",)),
        ([str(root / "surrogate.jsonl")], ("surrogate.jsonl:2: field 'text' holds a lone surrogate (\\ud800)",)),
        ([str(root / "latin1.txt"), "--tokenizer", "/dev/null"],
         ("tokenizer '/dev/null': a character device, not a file",)),
        ([str(root / "latin1.txt"), "--tokenizer", str(root / "broken.json")],
         ("broken.json is not a tokenizer.json that the tokenizers package reads",)),
    ]
    try:
        import zstandard

        whole = zstandard.ZstdCompressor().compress(b'{"text": "a line of text"}\n' * 1000)
        (root / "trunc.jsonl.zst").write_bytes(whole[:len(whole) // 2])  # zstandard's reader stops there quietly
        cases.append(([str(root / "trunc.jsonl.zst")], ("trunc.jsonl.zst: cannot decompress", "cut short")))
    except ImportError:
        pass
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq

        not_utf8 = pa.array([b"ok", b"bad \xff"], pa.binary()).view(pa.string())  # pyarrow takes it unchecked
        pq.write_table(pa.table({"text": not_utf8}), root / "not_utf8.parquet")
        cases.append(([str(root / "not_utf8.parquet")],
                      ("not_utf8.parquet: row group 0 cannot be read (UnicodeDecodeError",)))
        pq.write_table(pa.table({"content": ["x"]}), root / "nocol.parquet")
        cases.append(([str(root / "nocol.parquet"), "--text-field", "text"],
                      ("nocol.parquet has no column 'text' (columns: content)", "--text-field")))
        pq.write_table(pa.table({"words": ["x"]}), root / "unusual.parquet")
        cases.append(([str(root / "unusual.parquet")],
                      ("unusual.parquet has none of the usual text columns (text, content,", "its columns: words",
                       "choose one with --text-field")))
    except ImportError:
        pass
    return cases


def test_bad_input_is_one_line_and_leaves_nothing(tmp_path):
    for i, (args, fragments) in enumerate(bad_inputs(tmp_path / "in")):
        out = tmp_path / f"out{i}"
        one_error(cmd(str(out), *args, "--workers", "2"), *fragments)
        assert not out.exists()
        assert not [p for p in os.listdir(tmp_path) if p.startswith(f"out{i}.")], "a temporary folder was left"


def test_console_script_entry_points_exist():
    import tomllib

    scripts = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]["scripts"]
    import importlib

    for name in ("titanlike-prepare", "titanlike-export", "titanlike-generate", "titanlike-train"):
        module, func = scripts[name].split(":")
        assert callable(getattr(importlib.import_module(module), func))


def test_prepared_data_without_dataset_json_keeps_the_preset_vocab(tmp_path):
    (tmp_path / "a.txt").write_text("hello " * 100)
    prepare(str(tmp_path / "out"), [str(tmp_path / "a.txt")], workers=1, val_fraction=0)
    assert resolve_model_args(load_config(["--data.path", str(tmp_path / "out" / "train"), "--model.flavor", "124m"])
                              ).vocab_size == 320  # the byte tokenizer's 258, rounded up
    os.remove(tmp_path / "out" / "dataset.json")
    assert resolve_model_args(load_config(["--data.path", str(tmp_path / "out" / "train"), "--model.flavor", "124m"])
                              ).vocab_size == 32768


def test_user_error_is_the_base(tmp_path):
    with pytest.raises(UserError):
        prepare(str(tmp_path / "o"), [str(tmp_path / "none")])


# ---- the output folder: nothing of the user's is lost ---------------------------------------------


def test_an_input_inside_the_output_is_refused_and_kept(tmp_path):
    out = tmp_path / "out"
    (out / "raw").mkdir(parents=True)
    (out / "raw" / "a.txt").write_text("my only copy")
    (out / "notes.md").write_text("unrelated")
    one_error(cmd(str(out), str(out / "raw" / "a.txt"), "--overwrite"), "lies inside the output folder")
    assert (out / "raw" / "a.txt").read_text() == "my only copy" and (out / "notes.md").read_text() == "unrelated"


def test_overwrite_replaces_only_what_prepare_wrote(tmp_path):
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "b.txt").write_text("second")
    out = tmp_path / "out"
    not_a_dataset = tmp_path / "photos"
    not_a_dataset.mkdir()
    (not_a_dataset / "cat.jpg").write_bytes(b"\xff\xd8")
    one_error(cmd(str(not_a_dataset), str(tmp_path / "a.txt"), "--overwrite"), "is not a dataset titanlike-prepare")
    assert (not_a_dataset / "cat.jpg").read_bytes() == b"\xff\xd8"
    assert cmd(str(out), str(tmp_path / "a.txt"), "--val-fraction", "0").returncode == 0
    (out / "README.txt").write_text("the user's own note")
    assert cmd(str(out), str(tmp_path / "b.txt"), "--overwrite", "--val-fraction", "0").returncode == 0
    assert documents(shard_tokens(out / "train"), ByteTokenizer()) == ["second"]
    assert (out / "README.txt").read_text() == "the user's own note"
    assert sorted(os.listdir(out)) == ["README.txt", "dataset.json", "tokenizer.json", "train", "val_documents.json"]


def test_overwrite_refuses_files_it_did_not_write_in_train_and_val(tmp_path):
    """A shard copied into train/ would be read as training data, and a user's file there is theirs:
    --overwrite lists what it did not write and removes nothing."""
    for i in range(12):
        (tmp_path / f"doc{i}.txt").write_text(f"document {i}")
    docs = [str(tmp_path / f"doc{i}.txt") for i in range(12)]
    out = tmp_path / "out"
    assert cmd(str(out), *docs, "--val-fraction", "0.25").returncode == 0
    before = {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    (out / "train" / "from-elsewhere.bin").write_bytes((out / "train" / "shard-00000.bin").read_bytes())
    (out / "val" / "notes.txt").write_text("the user's own note")
    line = one_error(cmd(str(out), docs[0], "--overwrite", "--val-fraction", "0"),
                     f"{out}/train/from-elsewhere.bin", f"{out}/val/notes.txt", "did not write")
    assert "and " not in line.split("did not write")[1].split(";")[0]  # two names: both listed, no count
    assert (out / "train" / "from-elsewhere.bin").exists() and (out / "val" / "notes.txt").exists()
    assert {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and p.name not in ("from-elsewhere.bin", "notes.txt")} == before
    assert sorted(os.listdir(tmp_path)) == sorted([*(f"doc{i}.txt" for i in range(12)), "out"])
    # Many foreign files: a few names, then how many more.
    for i in range(6):
        (out / "train" / f"mine-{i}.bin").write_bytes(b"x")
    line = one_error(cmd(str(out), docs[0], "--overwrite"), "and 5 more")
    assert line.count(f"{out}/") == 3, line
    # Once they are moved away, --overwrite replaces the dataset.
    for p in [*out.glob("train/mine-*"), out / "train" / "from-elsewhere.bin", out / "val" / "notes.txt"]:
        p.unlink()
    assert cmd(str(out), docs[0], "--overwrite", "--val-fraction", "0").returncode == 0
    assert documents(shard_tokens(out / "train"), ByteTokenizer()) == ["document 0"]
    assert sorted(os.listdir(out)) == ["dataset.json", "tokenizer.json", "train", "val_documents.json"]


@pytest.mark.parametrize("disk", ["full", "read-only"])
def test_a_full_or_read_only_disk_is_one_line(tmp_path, disk):
    from conftest import fill, small_disk

    (tmp_path / "big.txt").write_text("x" * 300_000)
    with small_disk(tmp_path / "disk", "256k", read_only=disk == "read-only") as mount:
        if disk == "full":
            fill(mount)
        line = one_error(cmd(str(mount / "out"), str(tmp_path / "big.txt")), "cannot write the dataset")
        assert ("no space left" if disk == "full" else "read-only") in line
        assert sorted(os.listdir(mount)) == (["filler"] if disk == "full" else [])


def test_the_summary_reports_text_size_and_empty_documents(tmp_path):
    text = "".join(json.dumps({"text": t}) + "\n" for t in ["a" * 10_000, "", "b" * 10_000, ""] * 50)
    with gzip.open(tmp_path / "docs.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(text)
    proc = cmd(str(tmp_path / "out"), str(tmp_path / "docs.jsonl.gz"))
    assert proc.returncode == 0, proc.stderr
    assert "100 documents (100 empty ones dropped), 1.0 MB of text" in proc.stdout, proc.stdout
    assert json.loads((tmp_path / "out" / "dataset.json").read_text())["empty_documents_dropped"] == 100


def test_workers_beyond_four_per_core_are_refused_before_any_process_starts(tmp_path, monkeypatch, capsys):
    import multiprocessing

    from titanlike.config.schema import MAX_WORKERS_PER_CORE, available_cores
    from titanlike.data.prepare import cli

    def no_processes(*a, **kw):
        raise AssertionError("a process pool was started")

    monkeypatch.setattr(multiprocessing, "get_context", no_processes)
    (tmp_path / "a.txt").write_text("some text")
    most = MAX_WORKERS_PER_CORE * available_cores()
    for n in ("100000", str(most + 1)):
        assert cli.main([str(tmp_path / "out"), str(tmp_path / "a.txt"), "--workers", n]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: --workers {n} is more than {MAX_WORKERS_PER_CORE} per CPU core") and \
            err.count("\n") == 1 and f"use at most {most}" in err, err
    assert not [p for p in os.listdir(tmp_path) if p.startswith("out")]


@pytest.mark.parametrize("sig,workers", [("SIGTERM", 2), ("SIGTERM", 1), ("SIGINT", 2)])
def test_a_stopped_prepare_removes_its_temporary_folder(tmp_path, sig, workers):
    """Stopped while it tokenizes (a reader that never finishes): one line, and no OUT.tmp-<pid> left. Started
    with SIGINT ignored, as a script's background job (or a CI runner) starts it: Ctrl-C stops it all the same."""
    import signal
    import subprocess
    import sys
    import time

    from conftest import _env

    (tmp_path / "a.txt").write_text("some text")
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", HANGING_PREPARE, str(out), str(tmp_path / "a.txt"), "--workers",
                             str(workers)], env=_env(), stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        deadline = time.monotonic() + 60
        while not [p for p in os.listdir(tmp_path) if p.startswith("out.tmp-")]:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.05)
        time.sleep(0.5)  # into the reader
        proc.send_signal(getattr(signal, sig))
        _, err = proc.communicate(timeout=30)
    finally:  # the workers too, should the test fail with them still asleep in the reader
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    assert proc.returncode == 128 + getattr(signal, sig), err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "nothing was written" in lines[0], err
    assert os.listdir(tmp_path) == ["a.txt"]


def _stopped_before_its_setup() -> None:
    """A pool worker's start, with a stop signal arriving before its own handling is set (as the pool's
    SIGTERM does when prepare stops just after starting it); exits 0 only if it outlives it."""
    import signal
    import time

    from titanlike.data.prepare import workers

    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)  # the main process's handler, if the worker had it, has raised by now
    workers._init_worker("byte", "", "")
    time.sleep(5)
    os._exit(0)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks a worker as the pool does on Linux")
def test_a_stop_that_reaches_a_worker_before_its_setup_ends_it():
    """A worker starts with the stop signals held (workers.stop_signals_held) and takes them only once its own
    defaults are set: a SIGTERM that comes first ends it when its setup is done. It never runs the main process's
    handler (cli.py's raises), whose exception multiprocessing's start-up code can log and drop; that left a
    worker alive, and the pool's terminate() waiting on it for ever, once in CI. Unheld, the raising handler
    ran in the worker (exit code 1)."""
    import multiprocessing
    import signal

    from titanlike.data.prepare import workers

    class Raised(Exception):
        pass

    def raising(signum, frame):
        raise Raised(signum)

    previous = signal.signal(signal.SIGTERM, raising)
    try:
        with workers.stop_signals_held():
            worker = multiprocessing.get_context("fork").Process(target=_stopped_before_its_setup)
            worker.start()
        worker.join(60)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert worker.exitcode == -signal.SIGTERM, worker.exitcode


def test_a_stop_while_overwrite_swaps_the_dataset_loses_neither(tmp_path, monkeypatch):
    """Ctrl-C (or SIGTERM) between moving the earlier dataset aside and the new one into place: the swap
    finishes, rather than both being removed with OUT.tmp-<pid>."""
    import signal

    from titanlike.data.prepare import output

    (tmp_path / "a.txt").write_text("the earlier text")
    (tmp_path / "b.txt").write_text("the new text, longer")
    out = tmp_path / "out"
    prepare(str(out), [str(tmp_path / "a.txt")], workers=1, val_fraction=0)
    real, renames = os.rename, []

    def rename(src, dst):
        real(src, dst)
        renames.append(dst)
        if len(renames) == 1:  # the earlier dataset's first entry is aside, the new one not yet in place
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(output.os, "rename", rename)
    prepare(str(out), [str(tmp_path / "b.txt")], workers=1, val_fraction=0, overwrite=True)
    monkeypatch.undo()
    record = json.loads((out / "dataset.json").read_text())
    assert record["splits"]["train"]["tokens"] == len("the new text, longer") + 2
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "b.txt", "out"]


def test_document_tokens_for_the_byte_tokenizer_are_refused_not_ignored(tmp_path):
    """The byte tokenizer's begin and end tokens are fixed: naming others would be silently ignored, and
    the data would not be what the user asked for. Its own names are accepted."""
    from conftest import call
    from titanlike.data.prepare.cli import main

    (tmp_path / "a.txt").write_text("some text")
    rc, err = call(main, str(tmp_path / "out"), str(tmp_path / "a.txt"), "--eos-token", "</s>")
    assert rc == 2 and err.strip().splitlines() == [
        "error: --eos-token '</s>': the byte tokenizer's token there is always '<|end_of_text|>'; --eos-token "
        "chooses among the special tokens of a tokenizer.json (--tokenizer)"], err
    assert not (tmp_path / "out").exists()
    rc, err = call(main, str(tmp_path / "ok"), str(tmp_path / "a.txt"), "--bos-token", "<|begin_of_text|>",
                   "--val-fraction", "0")
    assert rc == 0, err


def test_a_bad_chunk_among_many_stops_every_worker_at_once(tmp_path):
    """Workers at work on other chunks when one chunk fails: one line, exit 2, every time. On
    multiprocessing.Pool the shutdown hung in 3 of 16 such runs (its workers shared a lock to answer, which
    a worker stopped mid-answer kept for ever); each worker now answers through a pipe of its own."""
    good = '{"text": "%s"}\n' % ("word " * 200)
    (tmp_path / "big.jsonl").write_text(good * 6000 + '{"no text": 1}\n' + good * 3000)  # 6 MB, then the bad line
    for i in range(4):
        out = tmp_path / f"out{i}"
        one_error(run_python("-m", "titanlike.data.prepare", str(out), str(tmp_path / "big.jsonl"), "--workers", "2",
                             timeout=120), "big.jsonl:6001 is not a JSON object with a 'text' field")
        assert not out.exists()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks a worker as prepare does on Linux")
def test_a_worker_that_dies_is_one_line():
    """A tokenizing worker killed from outside: the main process says so, rather than waiting for its answer."""
    import multiprocessing
    import signal

    from titanlike.data.prepare import workers

    worker = workers._Worker(multiprocessing.get_context("fork"), "byte", "", "")
    try:
        os.kill(worker.process.pid, signal.SIGKILL)
        with pytest.raises(UserError, match=r"a tokenizing worker ended before it finished \(exit code -9\)"):
            worker.take()
    finally:
        worker.stop()


@pytest.mark.parametrize("line, says", [
    ("[" * 100_000 + "]" * 100_000, "deep.jsonl:2: its JSON nests arrays or objects deeper than the JSON reader goes"),
    ('{"text": "x", "n": ' + "9" * 100_000 + "}", "deep.jsonl:2: a value the JSON reader cannot take (Exceeds the "
                                                   "limit (4300 digits) for integer string conversion"),
], ids=["nested-100000-deep", "integer-of-100000-digits"])
def test_a_json_line_the_json_reader_cannot_take_is_one_line(tmp_path, line, says):
    """Python's JSON reader raises RecursionError on deep nesting and ValueError on a huge integer: both were
    tracebacks. In this process, one worker: what a worker raises is what the main process says."""
    from conftest import call, error_lines
    from titanlike.data.prepare.cli import main

    (tmp_path / "deep.jsonl").write_text('{"text": "fine"}\n' + line + "\n")
    rc, err = call(main, str(tmp_path / "out"), str(tmp_path / "deep.jsonl"), "--workers", "1")
    assert rc == 2 and "Traceback" not in err, err
    (message,) = error_lines(err)
    assert says in message, message
    assert not (tmp_path / "out").exists()


def test_a_dotted_text_field_reaches_into_nested_objects_and_struct_columns(tmp_path):
    """`--text-field request.context` read nothing of a JSON line {"request": {"context": ...}}: a dotted name is a
    path into nested objects (or parquet struct columns), unless a record has it as a key of its own."""
    lines = [{"request": {"context": "first"}}, {"request": {"context": "second", "id": 2}},
             {"request.context": "a key with a dot", "request": {"context": "not this"}}]
    (tmp_path / "nested.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    prepare(str(tmp_path / "out"), [str(tmp_path / "nested.jsonl")], workers=1, val_fraction=0,
            text_field="request.context")
    read = documents(shard_tokens(tmp_path / "out" / "train"), ByteTokenizer())
    assert read == ["first", "second", "a key with a dot"]
    (tmp_path / "broken.jsonl").write_text('{"request": {"context": "ok"}}\n{"request": "flat"}\n')
    with pytest.raises(UserError, match="broken.jsonl:2 is not a JSON object with a 'request.context' field"):
        prepare(str(tmp_path / "out2"), [str(tmp_path / "broken.jsonl")], workers=1, text_field="request.context")
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"request": pa.array([{"context": "from a struct", "id": 1}, {"context": "two", "id": 2}]),
                             "n": [1, 2]}), tmp_path / "nested.parquet")
    prepare(str(tmp_path / "out3"), [str(tmp_path / "nested.parquet")], workers=1, val_fraction=0,
            text_field="request.context")
    assert documents(shard_tokens(tmp_path / "out3" / "train"), ByteTokenizer()) == ["from a struct", "two"]
    with pytest.raises(UserError, match=r"nested.parquet has no column 'request.nope' \(columns: request, n\)"):
        prepare(str(tmp_path / "out4"), [str(tmp_path / "nested.parquet")], workers=1, text_field="request.nope")
