"""Where documents come from: text files, JSON lines (plain, gzip, zstd) and parquet, cut into work
items that any process can read on its own.

`plan()` runs in the main process: it expands folders and globs, checks that each input exists and
has a format we read, and yields `Chunk`s of about CHUNK_BYTES of input each. The cut depends only
on the input files, never on the number of workers, and `read_chunk()` turns a chunk into its
documents in file order, so the documents in chunk order are the same sequence for any N.
Compressed JSON lines cannot be read from the middle: the main process decompresses them and hands
the raw lines over; everything else a worker reads itself. The text of a JSON line or parquet row is
in the field --text-field names (one for every input, or one per input; a dotted name is a path into
nested objects or struct columns), or else in the first of TEXT_FIELDS that the file's first record
(or its columns) has.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from titanlike.errors import UserError

CHUNK_BYTES = 1 << 20  # about 250k tokens: small enough to balance workers, large enough to amortise a hand-off
# Without --text-field, the first of these that a file's records (or columns) have holds the text.
TEXT_FIELDS = ("text", "content", "raw_content", "body", "document", "code")
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")  # one file is one document
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")  # one JSON object per line, the text in --text-field
PARQUET_SUFFIXES = (".parquet",)  # one row per document, the text in column --text-field
ALL_SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES


class InputError(UserError):
    """A bad input file: its message names the file and what is wrong with it."""


def suffix_of(path: str) -> str:
    name = path.lower()
    return next((s for s in sorted(ALL_SUFFIXES, key=len, reverse=True) if name.endswith(s)), "")


@dataclass
class Chunk:
    kind: str  # "text" (whole files), "jsonl" (a byte range of a file), "lines" (raw bytes), "parquet" (a row group)
    paths: list[str]
    start: int = 0  # jsonl: byte offset; lines: line number of the first line; parquet: row group
    end: int = 0  # jsonl: byte offset of the end
    data: bytes = b""  # lines: the decompressed lines
    input_bytes: int = 0  # bytes of input (compressed, for compressed files) this chunk accounts for
    text_field: str = "text"
    source: int = 0  # which INPUT argument the files came from (a chunk never spans two)
    extra: dict = field(default_factory=dict)


def expand(inputs: list[str]) -> list[str]:
    """Files in input order; a folder gives its files of a known format (recursively, sorted), a glob
    its matches (sorted). An input that names nothing, or a folder with nothing we read, is an error."""
    files: list[str] = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(str(p) for p in Path(item).rglob("*") if p.is_file() and suffix_of(str(p)))
            if not found:
                raise InputError(f"{item}: no input files in this folder (accepted: {', '.join(ALL_SUFFIXES)})")
            files += found
        elif os.path.isfile(item):
            if not suffix_of(item):
                raise InputError(f"{item}: unknown input format (accepted: {', '.join(ALL_SUFFIXES)})")
            files.append(item)
        elif glob.has_magic(item):
            found = sorted(p for p in glob.glob(item, recursive=True) if os.path.isfile(p) and suffix_of(p))
            if not found:
                raise InputError(f"{item}: no input files match (accepted: {', '.join(ALL_SUFFIXES)})")
            files += found
        else:
            raise InputError(f"{item}: no such file or folder")
    return files


def _open_compressed(path: str):
    """A binary stream of the decompressed file, and the raw file (whose position tells progress)."""
    raw = open(path, "rb")
    if path.lower().endswith(".gz"):
        return gzip.GzipFile(fileobj=raw), raw
    from titanlike.data.tokenizer import need_extra

    zstd = need_extra("zstandard", f"{path} (.jsonl.zst)")
    return io.BufferedReader(_ZstdFrames(zstd, raw)), raw


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of a file of zstd frames, one after another. zstandard's own stream reader stops
    quietly where a truncated file ends, inside a frame, so a cut file would read as a shorter one; this
    raises EOFError there instead."""

    def __init__(self, zstd, raw) -> None:
        self._zstd, self._raw = zstd, raw
        self._frame = zstd.ZstdDecompressor().decompressobj()
        self._inside = False  # bytes of a frame were given to the decompressor, and its end not seen yet
        self._out, self._at = memoryview(b""), 0  # decompressed and not yet read: _out[_at:]

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while self._at == len(self._out):
            data = self._raw.read(1 << 16)
            if not data:
                if self._inside:
                    raise EOFError("the file ends inside a zstd frame: it was cut short")
                return 0
            parts = []
            while data:  # one frame's end may come with the next frame's start
                self._inside = True
                parts.append(self._frame.decompress(data))
                data = b""
                if self._frame.eof:
                    data, self._inside = self._frame.unused_data, False
                    self._frame = self._zstd.ZstdDecompressor().decompressobj()
            self._out, self._at = memoryview(b"".join(parts)), 0
        n = min(len(buf), len(self._out) - self._at)
        buf[:n] = self._out[self._at:self._at + n]
        self._at += n
        return n


def plan(files: list[str], text_field: str | list[str] = "", sources: list[int] | None = None) -> Iterator[Chunk]:
    """The work, in order. Lazy: compressed files are decompressed as the workers ask for more.

    `text_field`: the JSON field / parquet column of every file, or one per file; "" = the first of
    TEXT_FIELDS the file has. `sources`: each file's INPUT argument (chunks carry it, for counts)."""
    fields = text_field if isinstance(text_field, list) else [text_field] * len(files)
    pending: list[str] = []
    pending_bytes = 0
    pending_source = 0
    for path, name, source in zip(files, fields, sources or [0] * len(files)):
        kind = suffix_of(path)
        try:
            size = os.path.getsize(path)
        except OSError as e:
            raise InputError(f"{path}: cannot read ({e.strerror})") from None
        if pending and (kind not in TEXT_SUFFIXES or source != pending_source):
            yield Chunk("text", pending, input_bytes=pending_bytes, source=pending_source)
            pending, pending_bytes = [], 0
        if kind in TEXT_SUFFIXES:
            pending.append(path)
            pending_bytes += size
            pending_source = source
            if pending_bytes >= CHUNK_BYTES:
                yield Chunk("text", pending, input_bytes=pending_bytes, source=source)
                pending, pending_bytes = [], 0
            continue
        try:
            if kind == ".jsonl":
                chunks = _plan_jsonl(path, size, name)
            elif kind in (".jsonl.gz", ".jsonl.zst"):
                chunks = _plan_compressed(path, name)
            else:
                chunks = _plan_parquet(path, size, name)
            for chunk in chunks:
                chunk.source = source
                yield chunk
        except OSError as e:
            raise InputError(f"{path}: cannot read ({e.strerror or e})") from None
        except EOFError:
            raise InputError(f"{path}: the compressed stream ends early (truncated file?)") from None
    if pending:
        yield Chunk("text", pending, input_bytes=pending_bytes, source=pending_source)


def pick_field(path: str, names: list[str], what: str) -> str:
    """The first of TEXT_FIELDS among a file's field (or column) names; one line if none is there."""
    found = next((f for f in TEXT_FIELDS if f in names), None)
    if found is None:
        raise InputError(f"{path} has none of the usual text {what}s ({', '.join(TEXT_FIELDS)}; its {what}s: "
                         f"{', '.join(names) or 'none'}); choose one with --text-field")
    return found


def _first_record_keys(lines: bytes) -> list[str]:
    """The keys of the first JSON object among `lines` (none if it is no JSON object: the worker says so)."""
    for line in lines.split(b"\n"):
        if line.strip():
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):  # not JSON, too deep, a too long number, not UTF-8
                return ["text"]  # a broken first line: reading it reports it, with its line number
            return list(record) if isinstance(record, dict) else ["text"]
    return ["text"]


def _plan_jsonl(path: str, size: int, text_field: str) -> Iterator[Chunk]:
    with open(path, "rb") as f:
        if not text_field:
            text_field = pick_field(path, _first_record_keys(f.read(CHUNK_BYTES)), "field")
        start = 0
        while start < size:
            f.seek(min(start + CHUNK_BYTES, size))
            f.readline()  # to the end of the line the cut fell in
            end = min(f.tell(), size)
            yield Chunk("jsonl", [path], start, end, input_bytes=end - start, text_field=text_field)
            start = end


def _plan_compressed(path: str, text_field: str) -> Iterator[Chunk]:
    stream, raw = _open_compressed(path)
    with raw, stream:
        line_no, done = 1, 0
        while True:
            try:
                block = stream.read(CHUNK_BYTES) + stream.readline()
            except (OSError, ValueError) as e:  # gzip.BadGzipFile is an OSError
                raise InputError(f"{path}: cannot decompress ({e})") from None
            except Exception as e:
                raise InputError(f"{path}: cannot decompress ({type(e).__name__}: {e})") from None
            if not block:
                break
            if not text_field:
                text_field = pick_field(path, _first_record_keys(block), "field")
            pos = raw.tell()
            yield Chunk("lines", [path], line_no, data=block, input_bytes=pos - done, text_field=text_field)
            done = pos
            line_no += block.count(b"\n")


def _nested_column(schema, name: str) -> bool:
    """Whether a dotted name is a path through struct columns (`request.context`) to a field of the schema."""
    import pyarrow as pa

    fields = schema
    for part in name.split("."):
        if fields is None or fields.get_field_index(part) < 0:
            return False
        kind = fields.field(part).type
        fields = pa.schema(list(kind)) if pa.types.is_struct(kind) else None
    return True


def _plan_parquet(path: str, size: int, text_field: str) -> Iterator[Chunk]:
    from titanlike.data.tokenizer import need_extra

    pq = need_extra("pyarrow", f"{path} (.parquet)")
    import pyarrow.parquet  # noqa: F401  (the submodule is not imported by `import pyarrow`)

    try:
        meta = pq.parquet.ParquetFile(path)
    except Exception as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InputError(f"{path}: not a parquet file ({why})") from None
    names = meta.schema_arrow.names
    text_field = text_field or pick_field(path, names, "column")
    if text_field not in names and not _nested_column(meta.schema_arrow, text_field):
        raise InputError(f"{path} has no column {text_field!r} (columns: {', '.join(names)}); "
                         f"choose one with --text-field")
    groups = meta.num_row_groups
    for g in range(groups):
        yield Chunk("parquet", [path], g, input_bytes=size // groups + (size % groups if g == groups - 1 else 0),
                    text_field=text_field)


# ---- reading a chunk (in a worker) ---------------------------------------------------------------


def _decode(data: bytes, path: str, offset: int) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {offset + e.start})") from None


def _json_lines(text: str, path: str, first_line, text_field: str) -> list[str]:
    """Documents of JSON lines; first_line() is the file's line number of the first one (asked only
    for an error message: counting lines is a read from the start of the file)."""
    docs = []
    for n, line in enumerate(text.split("\n")):
        if not line.strip():
            continue
        try:
            value = field_of(json.loads(line), text_field)
        except RecursionError:  # Python's JSON reader recurses once a level of nesting
            raise InputError(f"{path}:{first_line() + n}: its JSON nests arrays or objects deeper than the JSON "
                             f"reader goes ({sys.getrecursionlimit()} levels is past it)") from None
        except json.JSONDecodeError:
            raise InputError(f"{path}:{first_line() + n} is not a JSON object with a {text_field!r} field") from None
        except ValueError as e:  # valid JSON that Python will not convert: an integer of more than 4300 digits
            raise InputError(f"{path}:{first_line() + n}: a value the JSON reader cannot take "
                             f"({str(e).split(';')[0]})") from None
        except (KeyError, TypeError, IndexError):
            raise InputError(f"{path}:{first_line() + n} is not a JSON object with a {text_field!r} field") from None
        if not isinstance(value, str):
            raise InputError(f"{path}:{first_line() + n}: field {text_field!r} is {type(value).__name__}, not text")
        if "\\u" in line:  # JSON's escapes can spell half of a surrogate pair alone, which is no Unicode text
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise InputError(f"{path}:{first_line() + n}: field {text_field!r} holds a lone surrogate "
                                 f"(\\u{ord(value[e.start]):04x}), which is not Unicode text") from None
        docs.append(value)
    return docs


def field_of(record: object, name: str) -> object:
    """record[name]; a dotted name that the record does not have as a key of its own is a path into nested
    objects (`request.context`: record["request"]["context"]). KeyError or TypeError where there is none."""
    if not isinstance(record, dict):
        raise TypeError(name)
    if name in record or "." not in name:
        return record[name]
    for part in name.split("."):
        if not isinstance(record, dict):
            raise TypeError(name)
        record = record[part]
    return record


def _line_number(path: str, offset: int) -> int:
    with open(path, "rb") as f:
        return 1 + f.read(offset).count(b"\n")


def read_chunk(chunk: Chunk) -> list[str]:
    """The documents of one chunk, in file order, empty ones included (the caller counts and drops them)."""
    if chunk.kind == "text":
        docs = []
        for path in chunk.paths:
            try:
                with open(path, "rb") as f:
                    docs.append(_decode(f.read(), path, 0))
            except OSError as e:
                raise InputError(f"{path}: cannot read ({e.strerror})") from None
        return docs
    path = chunk.paths[0]
    if chunk.kind == "jsonl":
        try:
            with open(path, "rb") as f:
                f.seek(chunk.start)
                data = f.read(chunk.end - chunk.start)
        except OSError as e:
            raise InputError(f"{path}: cannot read ({e.strerror})") from None
        return _json_lines(_decode(data, path, chunk.start), path, lambda: _line_number(path, chunk.start),
                           chunk.text_field)
    if chunk.kind == "lines":
        return _json_lines(_decode(chunk.data, path, 0), path, lambda: chunk.start, chunk.text_field)
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path).read_row_group(chunk.start, columns=[chunk.text_field])
        column = table.column(0)
        if table.column_names[0] != chunk.text_field:  # a path into struct columns: read as its top-level column
            import pyarrow.compute as pc

            for part in chunk.text_field.split(".")[1:]:
                column = pc.struct_field(column, part)
        values = column.to_pylist()
    except Exception as e:  # damaged pages, bad compression, strings that are not UTF-8: pyarrow's own errors
        why = str(e).splitlines()[0] if str(e) else ""
        raise InputError(f"{path}: row group {chunk.start} cannot be read ({type(e).__name__}: {why})") from None
    bad = next((i for i, v in enumerate(values) if v is not None and not isinstance(v, str)), None)
    if bad is not None:
        raise InputError(f"{path}: column {chunk.text_field!r} holds {type(values[bad]).__name__}, not text")
    return [v or "" for v in values]
