"""Tokenizers that travel with the data: the byte tokenizer or a Hugging Face tokenizer.json, and
the dataset.json record that titanlike-prepare leaves next to the shards.

Both kinds are one `tokenizer.json` on disk: the byte tokenizer is written as a `tokenizers` model
too (a byte-level BPE with no merges, ids = byte values), so an exported folder loads in
`AutoTokenizer` whatever tokenizer the data was made with. Reading and writing dataset.json and the
byte tokenizer's JSON need no extra package; encoding with a tokenizer.json needs `tokenizers`
(the `data` extra), imported only when used.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from titanlike.errors import UserError

DATASET_JSON = "dataset.json"
DATASET_FORMAT = "titanlike-dataset/1"
BYTE_BOS, BYTE_EOS = "<|begin_of_text|>", "<|end_of_text|>"
# Special-token spellings of common tokenizers, in order of preference.
EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eot_id|>", "<|im_end|>")
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")


class TokenizerError(UserError):
    same_on_all_ranks = True


def need_extra(module: str, what: str):
    """Import an optional dependency, or stop with the one line that says how to get it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise TokenizerError(f"{what} needs the {module} package: pip install 'titanlike[data]' "
                             f"(or pip install {module})") from None


# ---- the byte tokenizer as a tokenizer.json -------------------------------------------------


def _byte_chars() -> list[str]:
    """The printable stand-in of each byte used by byte-level BPE (GPT-2's convention): printable
    Latin-1 bytes stand for themselves, the others map to code points from 256 up, in byte order."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1)) | set(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def byte_tokenizer_json() -> dict:
    """titanlike's byte tokenizer (ids 0-255 = UTF-8 bytes, 256 = BOS, 257 = EOS) as tokenizer.json."""
    special = [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                "normalized": False, "special": True} for i, c in ((256, BYTE_BOS), (257, BYTE_EOS))]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": special,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {c: i for i, c in enumerate(_byte_chars())}, "merges": []},
    }


class ByteTokenizer:
    """UTF-8 bytes are tokens 0..255; 256 begins and 257 ends a document. Needs no download."""

    kind, bos_id, eos_id, vocab_size = "byte", 256, 257, 258
    bos_token, eos_token = BYTE_BOS, BYTE_EOS

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.uint32) for t in texts]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def to_json(self) -> str:
        return json.dumps(byte_tokenizer_json(), ensure_ascii=False)


class HFTokenizer:
    """A Hugging Face tokenizer.json, encoded with the `tokenizers` package's batch encoder."""

    kind = "huggingface"

    def __init__(self, path: str, bos_token: str = "", eos_token: str = ""):
        tokenizers = need_extra("tokenizers", "a tokenizer.json")
        try:
            with open(path, encoding="utf-8") as f:
                self.text = f.read()
            self.tok = tokenizers.Tokenizer.from_str(self.text)
        except OSError as e:
            raise TokenizerError(f"{path}: cannot read the tokenizer ({e.strerror})") from None
        except Exception as e:  # tokenizers raises plain Exceptions whose first line says what is wrong
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise TokenizerError(f"{path} is not a tokenizer.json that the tokenizers package reads: {first}") from None
        self.path = path
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.eos_token, self.eos_id = self._special(eos_token, EOS_NAMES, "eos")
        self.bos_token, self.bos_id = self._special(bos_token, BOS_NAMES, "bos")
        if self.eos_id is None:
            raise TokenizerError(f"{path} has none of the end-of-text tokens {', '.join(EOS_NAMES)}: "
                                 f"name the one that separates documents with --eos-token")
        # encode_batch_fast (tokenizers >= 0.20) skips the character offsets we never use.
        self._encode = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)

    def _special(self, name: str, candidates: tuple[str, ...], what: str) -> tuple[str | None, int | None]:
        if name:
            i = self.tok.token_to_id(name)
            if i is None:
                raise TokenizerError(f"{self.path} has no token {name!r} (given as the {what} token)")
            return name, i
        for c in candidates:
            i = self.tok.token_to_id(c)
            if i is not None:
                return c, i
        return None, None

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.uint32) for e in self._encode(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def to_json(self) -> str:
        return self.text


def load_tokenizer(spec: str, bos_token: str = "", eos_token: str = ""):
    """"byte" (or "") for the byte tokenizer, else the path of a tokenizer.json."""
    if spec in ("", "byte"):
        return ByteTokenizer()
    if os.path.isdir(spec):
        spec = os.path.join(spec, "tokenizer.json")
    if not os.path.isfile(spec):
        raise TokenizerError(f"tokenizer {spec!r}: no such file (give a tokenizer.json, or 'byte')")
    return HFTokenizer(spec, bos_token, eos_token)


def tokenizer_from_folder(folder: str):
    """The tokenizer recorded in a folder: an export's or a prepared dataset's tokenizer.json.
    A byte tokenizer's JSON is recognised and decoded without the tokenizers package."""
    path = os.path.join(folder, "tokenizer.json")
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if data == json.loads(json.dumps(byte_tokenizer_json(), ensure_ascii=False)):
        return ByteTokenizer()
    info = {}
    for name in ("tokenizer_config.json", "tokenizer_info.json", DATASET_JSON):
        if os.path.isfile(os.path.join(folder, name)):
            with open(os.path.join(folder, name)) as f:
                info = json.load(f)
            break
    bos = info.get("bos_token") or info.get("tokenizer", {}).get("bos_token") or ""
    eos = info.get("eos_token") or info.get("tokenizer", {}).get("eos_token") or ""
    return HFTokenizer(path, bos if isinstance(bos, str) else "", eos if isinstance(eos, str) else "")


# ---- dataset.json ----------------------------------------------------------------------------


def dataset_info_path(data_path: str) -> Path | None:
    """The dataset.json that describes these shards: in the shard folder or the one above it
    (titanlike-prepare writes OUT/dataset.json with OUT/train/ and OUT/val/)."""
    p = Path(data_path)
    folder = p if p.is_dir() else p.parent
    for candidate in (folder / DATASET_JSON, folder.parent / DATASET_JSON):
        if candidate.is_file():
            return candidate
    return None


def read_dataset_info(data_path: str) -> dict | None:
    """The dataset.json of these shards (with "_path" and "_folder" added), or None if they have none."""
    path = dataset_info_path(data_path)
    if path is None:
        return None
    try:
        with open(path) as f:
            info = json.load(f)
        int(info["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise TokenizerError(f"{path} is not a titanlike dataset.json ({type(e).__name__}: {e}); "
                             f"re-make the data with titanlike-prepare") from None
    info["_path"], info["_folder"] = str(path), str(path.parent)
    return info


def record_tokenizer(data_path: str, run_folder: str) -> None:
    """Leave the run's tokenizer in its folder (tokenizer.json + tokenizer_info.json), where
    titanlike-export and titanlike-generate find it: the byte tokenizer for the built-in corpus, the
    dataset.json's tokenizer for prepared data, none (and any earlier one removed) when unknown."""
    info = read_dataset_info(data_path) if data_path else None
    target = Path(run_folder) / "tokenizer.json"
    meta = Path(run_folder) / "tokenizer_info.json"
    if not data_path:
        text, record = ByteTokenizer().to_json(), {"kind": "byte", "bos_token": BYTE_BOS, "eos_token": BYTE_EOS}
    elif info is not None and (Path(info["_folder"]) / info["tokenizer"]["file"]).is_file():
        text = (Path(info["_folder"]) / info["tokenizer"]["file"]).read_text(encoding="utf-8")
        record = {"kind": info["tokenizer"]["kind"], "bos_token": info["tokenizer"].get("bos_token"),
                  "eos_token": info["tokenizer"].get("eos_token"), "dataset": info["_path"]}
    else:
        for p in (target, meta):
            p.unlink(missing_ok=True)
        return
    target.write_text(text, encoding="utf-8")
    meta.write_text(json.dumps(record, indent=1))
