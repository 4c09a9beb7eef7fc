"""Tokenizers that travel with the data: titanlike's byte tokenizer or a Hugging Face tokenizer.json.

Both kinds are one `tokenizer.json` on disk: the byte tokenizer is written as a `tokenizers` model
too (a byte-level BPE with no merges, ids = byte values), so an exported folder loads in
`AutoTokenizer` whatever tokenizer the data was made with. The byte tokenizer and its JSON need no
extra package; encoding with a tokenizer.json needs `tokenizers` (the `data` extra), imported only
when used. A tokenizer file is read through titanlike.fs's gate; the run's copy (`record_tokenizer`)
is written without following a link.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from titanlike import fs
from titanlike.config.dataset import BYTE_BOS_ID, BYTE_EOS_ID, DatasetInfo
from titanlike.errors import UserError

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

    kind, bos_id, eos_id, vocab_size = "byte", BYTE_BOS_ID, BYTE_EOS_ID, 258
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
        self.text = fs.read_text(path, "the tokenizer")
        try:
            self.tok = tokenizers.Tokenizer.from_str(self.text)
        except Exception as e:  # tokenizers raises plain Exceptions whose first line says what is wrong
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise TokenizerError(f"{path} is not a tokenizer.json that the tokenizers package reads: {first}") from None
        self.path = path
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.eos_token, self.eos_id = self._special(eos_token, EOS_NAMES, "eos")
        self.bos_token, self.bos_id = self._special(bos_token, BOS_NAMES, "bos")
        if self.eos_id is None:
            raise TokenizerError(f"{path} has none of the end-of-text tokens {', '.join(EOS_NAMES)} "
                                 f"({self._special_tokens()}); name the one that separates documents with --eos-token")
        # encode_batch_fast (tokenizers >= 0.20) skips the character offsets we never use.
        self._encode = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)

    def _special_tokens(self, most: int = 20) -> str:
        """The tokenizer's special tokens in id order, for a message: what --eos-token could name."""
        added: dict = getattr(self.tok, "get_added_tokens_decoder", dict)()
        names = [t.content for _, t in sorted(added.items()) if getattr(t, "special", False)]
        if not names:
            return "it has no special tokens"
        more = f" and {len(names) - most} more" if len(names) > most else ""
        return f"its special tokens: {', '.join(names[:most])}{more}"

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
        # Its document tokens are fixed: a --bos-token / --eos-token for it would be ignored, and the user
        # would believe the data separated documents with another token.
        for option, given, fixed in (("--bos-token", bos_token, BYTE_BOS), ("--eos-token", eos_token, BYTE_EOS)):
            if given and given != fixed:
                raise TokenizerError(f"{option} {given!r}: the byte tokenizer's token there is always {fixed!r}; "
                                     f"{option} chooses among the special tokens of a tokenizer.json (--tokenizer)")
        return ByteTokenizer()
    if os.path.isdir(spec):
        spec = os.path.join(spec, "tokenizer.json")
    if not os.path.isfile(spec):
        what = "no such file" if not os.path.exists(spec) else f"{fs.kind_of(os.stat(spec).st_mode)}, not a file"
        raise TokenizerError(f"tokenizer {spec!r}: {what} (give a tokenizer.json, or 'byte')")
    return HFTokenizer(spec, bos_token, eos_token)


def tokenizer_from_folder(folder: str):
    """The tokenizer recorded in a folder: an export's or a prepared dataset's tokenizer.json.
    A byte tokenizer's JSON is recognised and decoded without the tokenizers package."""
    path = os.path.join(folder, "tokenizer.json")
    data = fs.read_json(path, "the tokenizer")
    if data == json.loads(json.dumps(byte_tokenizer_json(), ensure_ascii=False)):
        return ByteTokenizer()
    info: dict = {}
    for name in ("tokenizer_config.json", "tokenizer_info.json", "dataset.json"):
        if os.path.isfile(os.path.join(folder, name)):
            found = fs.read_json(os.path.join(folder, name), "the tokenizer's record")
            info = found if isinstance(found, dict) else {}
            break
    if not isinstance(info.get("tokenizer", {}), dict):
        info = {k: v for k, v in info.items() if k != "tokenizer"}
    bos = info.get("bos_token") or info.get("tokenizer", {}).get("bos_token") or ""
    eos = info.get("eos_token") or info.get("tokenizer", {}).get("eos_token") or ""
    return HFTokenizer(path, bos if isinstance(bos, str) else "", eos if isinstance(eos, str) else "")


# ---- the run's copy ---------------------------------------------------------------------------


RUN_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_info.json")


def run_tokenizer_files(info: DatasetInfo | None, *, builtin_corpus: bool) -> dict[str, str]:
    """The run's tokenizer as files (name → text: tokenizer.json + tokenizer_info.json), which the run
    leaves in its folder and in every step folder it saves, where titanlike-export and
    titanlike-generate find it: the byte tokenizer for the built-in corpus and byte-tokenized data, the
    dataset's own tokenizer.json for prepared data, none when the data has no dataset.json."""
    record: dict[str, str | None]
    if builtin_corpus or (info is not None and info.tokenizer_kind == "byte"):
        text, record = ByteTokenizer().to_json(), {"kind": "byte", "bos_token": BYTE_BOS, "eos_token": BYTE_EOS}
    elif info is not None and info.tokenizer_file is not None:
        text = fs.read_text(info.tokenizer_file, "the dataset's tokenizer")
        record = {"kind": info.tokenizer_kind, "bos_token": info.bos_token, "eos_token": info.eos_token,
                  "dataset": info.path}
    else:
        return {}
    return {"tokenizer.json": text, "tokenizer_info.json": json.dumps(record, indent=1)}


def record_tokenizer(files: dict[str, str], run_folder: str) -> None:
    """Leave the run's tokenizer files in its folder (any earlier one removed when there are none).
    Written whole, never through a link."""
    for name in RUN_TOKENIZER_FILES:
        target = Path(run_folder) / name
        if name in files:
            fs.write_text(target, files[name])
        else:
            target.unlink(missing_ok=True)
