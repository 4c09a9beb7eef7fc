"""A checkpoint step folder's manifest (every file's size and CRC-32, written last at a save, checked
first at a load) and the trust rule for DCP folders, whose `.metadata` is a Python pickle.

A manifest is signed (HMAC-SHA256) with this user's key, ~/.config/titanlike/checkpoint-signing.key,
over the file list and `.metadata`'s SHA-256: a signed folder is one titanlike wrote on this account,
and its `.metadata` is the one it wrote. check_trusted_dcp is the gate for everything that reads a DCP
folder from a path the user names (checkpoint.initial_load_path, the export).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import zlib

from titanlike.errors import UserError

MANIFEST = "manifest.json"
TRUST_FLAG = "--checkpoint.trust_pickled_dcp"
_OWNER = re.compile(r"^(?:__(\d+)_\d+\.distcp|rng-rank(\d+)\.json)$")  # files a given rank writes
_CHUNK = 16 * 2**20


class UntrustedCheckpoint(UserError):
    same_on_all_ranks = True


def file_crc32(path: str) -> str:
    """CRC-32 of a file, read in chunks: fast (zlib), and catches torn, truncated or zeroed files."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def describe_files(folder: str, names: list[str]) -> dict[str, dict]:
    return {n: {"size": os.path.getsize(os.path.join(folder, n)), "crc32": file_crc32(os.path.join(folder, n))}
            for n in names}


def owner(name: str, world: int) -> int:
    m = _OWNER.match(name)
    owner = int(m.group(1) or m.group(2)) if m else 0
    return owner if owner < world else 0


def signing_key(create: bool) -> bytes | None:
    """This user's key for manifests: a signed manifest says titanlike wrote the folder on this account."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    path = os.path.join(base, "titanlike", "checkpoint-signing.key")
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        if not create:
            return None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
    except FileExistsError:
        pass  # another process made it first
    except OSError:
        return None  # no writable home: manifests go unsigned (own-folder resume does not need it)
    with open(path, "rb") as f:
        return f.read()


def sign(key: bytes, files: dict, metadata_sha256: str) -> str:
    body = json.dumps({"files": files, "metadata_sha256": metadata_sha256}, sort_keys=True).encode()
    return hmac.new(key, body, hashlib.sha256).hexdigest()


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def verify_files(folder: str, names: list[str], manifest: dict) -> str | None:
    """The first file of `names` that differs from the manifest, as 'FILE: what', or None."""
    for name in names:
        want = manifest["files"][name]
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            return f"{path} is missing"
        size = os.path.getsize(path)
        if size != want["size"]:
            return f"{path} has {size} bytes, the manifest says {want['size']}"
        if file_crc32(path) != want["crc32"]:
            return f"{path} does not match its checksum (its bytes changed after the save)"
    return None


def read_manifest(folder: str) -> dict | None:
    """The folder's manifest, or None when it has none (written before titanlike had manifests)."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            manifest = json.load(f)
        assert isinstance(manifest.get("files"), dict)
        return manifest
    except (OSError, ValueError, AssertionError, AttributeError):
        return {"unreadable": True, "files": {}}


def check_trusted_dcp(folder: str, trust_pickled_dcp: bool, flag: str = TRUST_FLAG) -> None:
    """Raise UntrustedCheckpoint unless it is safe to unpickle this DCP folder's `.metadata`.

    Safe: the caller opted in (`flag`), or the folder's manifest is signed with this user's key and
    its `.metadata` has the signed SHA-256 (titanlike wrote it on this account, and it was not
    replaced since). For `--checkpoint.initial_load_path` and the export; a run's own checkpoint
    folder is trusted without this check."""
    if trust_pickled_dcp:
        return
    manifest = read_manifest(folder) or {}
    key = signing_key(create=False)
    meta = os.path.join(folder, ".metadata")
    if key and manifest.get("signature") and os.path.isfile(meta):
        files, sha = manifest.get("files", {}), manifest.get("metadata_sha256", "")
        if hmac.compare_digest(sign(key, files, sha), manifest["signature"]) and sha256(meta) == sha:
            return
    raise UntrustedCheckpoint(
        f"{folder} is a DCP checkpoint that titanlike did not write on this account: its .metadata is a Python "
        f"pickle, and loading one can run any code. Load a safetensors (Hugging Face) folder instead, or pass "
        f"{flag} if you trust whoever wrote it")


def write_manifest(folder: str, step: int, files: dict[str, dict]) -> None:
    """Write `folder`/manifest.json for these file descriptions (describe_files), signed with this
    user's key where there is one, and fsync it: the last file of a save."""
    sha = sha256(os.path.join(folder, ".metadata"))
    manifest: dict = {"step": step, "files": files, "metadata_sha256": sha}
    if key := signing_key(create=True):
        manifest["signature"] = sign(key, files, sha)
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def seal(folder: str, step: int = 0) -> None:
    """A manifest for every file of a DCP folder written in one process (tests, tools): what a
    titanlike save writes, so that the folder counts as written by titanlike on this account."""
    write_manifest(folder, step, describe_files(folder, sorted(n for n in os.listdir(folder) if n != MANIFEST)))
