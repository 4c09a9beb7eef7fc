"""A checkpoint step folder's manifest, and the one gate every read of a DCP folder goes through.

The manifest (manifest.json, written last at a save) lists every file with its size and CRC-32, and
the SHA-256 of the small ones (the JSON files and DCP's `.metadata`), and is signed (HMAC-SHA256)
with this user's key, ~/.config/titanlike/checkpoint-signing.key ($XDG_CONFIG_HOME honoured). A
valid signature says titanlike wrote the folder on this account and nothing listed changed since: the
small files (the .metadata pickle, the JSON records) against any edit, the large ones against
accidents, by CRC-32. A cryptographic hash of those costs 7-18 % of a save at the least, against a
bar of 2 % (docs/benchmarks/2026-12-02-checkpoint-hash-cost.md; docs/checkpointing.md says what
that leaves to the folder's permissions).

Why a gate: DCP's `.metadata` is a Python pickle, and unpickling runs code. `inspect` decides from
the manifest and the file bytes alone, before anything is unpickled, whether a folder may be read:

    ok        signed with this user's key, every file as listed
    damaged   no manifest, an unreadable or unsigned one, or a file that differs from it
    forged    a signature that does not verify: edited after the save, or signed with another key

A run's own checkpoints must be `ok` (a damaged step is set aside and the run falls back to an
earlier one; a forged one stops the run). A folder from elsewhere (`checkpoint.initial_load_path`,
titanlike-export, titanlike-generate) must be `ok` too, unless the user passes the trust flag; even
then, a folder with a manifest is checked against it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import zlib
from dataclasses import dataclass

from titanlike import fs
from titanlike.errors import UserError

MANIFEST = "manifest.json"
TRUST_FLAG = "--checkpoint.trust_pickled_dcp"
# The files a resume reads besides the tensors, and those a read of the weights alone does: a manifest
# that leaves one out would let it change unchecked.
FOR_RESUME = (".metadata", "trainer_state.json", "model_args.json")
FOR_WEIGHTS = (".metadata", "model_args.json")
SMALL = 2**20  # files up to this size are hashed with SHA-256 as well as CRC-32 (JSON, .metadata)
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


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def describe_files(folder: str, names: list[str]) -> dict[str, dict]:
    out = {}
    for n in names:
        path = os.path.join(folder, n)
        entry: dict = {"size": os.path.getsize(path), "crc32": file_crc32(path)}
        if entry["size"] <= SMALL:
            entry["sha256"] = sha256(path)
        out[n] = entry
    return out


# ---- the signing key --------------------------------------------------------------------------------


def key_path() -> str:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "titanlike", "checkpoint-signing.key")


def signing_key(create: bool) -> bytes | None:
    """This user's key for manifests (made on first use when `create`); None when there is none."""
    path = key_path()
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        if not create:
            return None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
    except FileExistsError:
        pass  # another process made it first
    with open(path, "rb") as f:
        return f.read()


def ensure_signing_key() -> None:
    """Before a run saves anything: the key exists, or one line says why it cannot."""
    try:
        signing_key(create=True)
    except OSError as e:
        raise UserError(f"checkpoints are signed with this user's key, and it cannot be made: "
                        f"{fs.describe_os_error(e, key_path())}; set XDG_CONFIG_HOME to a writable folder "
                        f"(the same one on every node of a multi-node run)") from None


def sign(key: bytes, files: dict, metadata_sha256: str) -> str:
    body = json.dumps({"files": files, "metadata_sha256": metadata_sha256}, sort_keys=True).encode()
    return hmac.new(key, body, hashlib.sha256).hexdigest()


def write_manifest(folder: str, step: int, files: dict[str, dict]) -> None:
    """Write `folder`/manifest.json for these file descriptions (describe_files), signed with this
    user's key, and fsync it: the last file of a save."""
    meta = sha256(os.path.join(folder, ".metadata"))
    key = signing_key(create=True)
    assert key is not None, "signing_key(create=True) makes one or raises"
    fs.write_json(os.path.join(folder, MANIFEST), {"step": step, "files": files, "metadata_sha256": meta,
                                                   "signature": sign(key, files, meta)}, indent=1, fsync=True)


# ---- the gate ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    kind: str
    """ok, damaged or forged (see the module docstring)."""
    problem: str = ""
    """What is wrong, naming the file, for damaged and forged."""


OK = Finding("ok")


def read_manifest(folder: str) -> dict | None:
    """The folder's manifest, {} when it is unreadable, None when there is none."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.lexists(path):
        return None
    try:
        manifest = fs.read_json(path, "the checkpoint manifest", limit=64 * 2**20)
    except UserError:
        return {}
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return {}
    return manifest


def _check_file(folder: str, name: str, want: object) -> str | None:
    path = os.path.join(folder, name)
    if not isinstance(want, dict):
        return f"{path} has no size and checksum in the manifest"
    if os.path.islink(path):  # a save writes plain files: a link points wherever whoever made it chose
        return f"{path} is a symbolic link, where the save wrote a file"
    if not os.path.lexists(path):
        return f"{path} is missing"
    if not os.path.isfile(path):
        return f"{path} is {fs.kind_of(os.stat(path).st_mode)}, where the save wrote a file"
    size = os.path.getsize(path)
    if size != want.get("size"):
        return f"{path} has {size} bytes, the manifest says {want.get('size')}"
    if file_crc32(path) != want.get("crc32") or ("sha256" in want and sha256(path) != want["sha256"]):
        return f"{path} does not match its checksum (its bytes changed after the save)"
    return None


def inspect(folder: str, files: list[str] | None = None, trust: bool = False,
            check_signature: bool = True, required: tuple[str, ...] = FOR_RESUME, step: int | None = None) -> Finding:
    """Whether the step folder may be read, from its manifest and bytes alone (nothing is unpickled).

    `files`: which listed files to check (a rank checks its share; None: all of them). With `trust`
    (the user vouches for the folder), a missing, unsigned or foreign-signed manifest is no obstacle,
    but a present manifest's checksums still are. `check_signature` false: another process (rank 0)
    verifies the signature and `.metadata`; this one checks its files against the same manifest.
    `required`: the files the manifest must list (what the caller will read). `step`: the step the
    folder's name says it holds (step-N of a run's checkpoint folder), checked with the signature
    against the step its signed trainer_state.json records."""
    manifest = read_manifest(folder)
    if manifest is None:
        if trust:
            return OK
        return Finding("damaged", f"{folder} has no {MANIFEST}: it was never completed by titanlike, or its "
                                  f"manifest was removed")
    if not manifest:
        return Finding("damaged", f"{os.path.join(folder, MANIFEST)} is unreadable")
    listed = manifest["files"]
    missing = [n for n in required if n not in listed]
    if missing and not trust:
        return Finding("damaged", f"{os.path.join(folder, missing[0])} is not in the manifest")
    signature = manifest.get("signature")
    if not trust and check_signature:
        if not isinstance(signature, str):
            return Finding("damaged", f"{os.path.join(folder, MANIFEST)} is not signed")
        key = signing_key(create=False)
        meta_sha = manifest.get("metadata_sha256", "")
        if key is None or not isinstance(meta_sha, str) or not hmac.compare_digest(sign(key, listed, meta_sha),
                                                                                  signature):
            return Finding("forged", f"{os.path.join(folder, MANIFEST)} is not signed with this user's checkpoint "
                                     f"key ({key_path()}): the folder was edited after it was saved, or saved on an "
                                     f"account or machine with another key")
        metadata = os.path.join(folder, ".metadata")
        if not os.path.isfile(metadata) or sha256(metadata) != meta_sha:
            return Finding("damaged", f"{metadata} is not the one its manifest was signed with")
        if step is not None:
            problem = _step_problem(folder, step, listed)
            if problem:
                return Finding("damaged", problem)
    for name in sorted(listed) if files is None else files:
        problem = _check_file(folder, name, listed.get(name))
        if problem:
            return Finding("damaged", problem)
    return OK


def _step_problem(folder: str, step: int, listed: dict) -> str | None:
    """Whether step-N holds step N: a folder copied or renamed under another step's name would make a
    run say it resumed at one step and train on from another (every requeue going back)."""
    name = "trainer_state.json"
    if name not in listed:
        return None
    problem = _check_file(folder, name, listed[name])
    if problem:
        return problem
    try:
        record = fs.read_json(os.path.join(folder, name), "the trainer state")
    except UserError as e:
        return str(e)
    held = record.get("step") if isinstance(record, dict) else None
    if isinstance(held, int) and held != step:
        return (f"{folder} holds step {held} (its signed {name} says so): a step folder copied or renamed under "
                f"another name")
    return None


def check_readable(folder: str, trust: bool, flag: str = TRUST_FLAG) -> None:
    """The gate for a DCP folder a user names (initial weights, export, generate): raise one line
    unless `inspect` finds it ok (every file checked). `flag` is how this command spells the trust
    option, for the message."""
    finding = inspect(folder, None, trust, required=FOR_WEIGHTS)
    if finding.kind == "ok":
        return
    if finding.kind == "damaged" and read_manifest(folder):
        raise UntrustedCheckpoint(f"{finding.problem}; it cannot be loaded")
    raise UntrustedCheckpoint(
        f"{folder} is a DCP checkpoint that titanlike did not write on this account ({finding.problem}): its "
        f".metadata is a Python pickle, and loading one can run any code. Load a safetensors (Hugging Face) "
        f"folder instead, or pass {flag} if you trust whoever wrote it")


def owner(name: str, world: int) -> int:
    """The rank that checksums a file at a save (the one that wrote it, where that is known)."""
    for prefix, suffix in (("__", ".distcp"), ("rng-rank", ".json")):
        if name.startswith(prefix) and name.endswith(suffix):
            digits = name[len(prefix):-len(suffix)].split("_")[0]
            if digits.isdigit() and int(digits) < world:
                return int(digits)
    return 0
