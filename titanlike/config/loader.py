"""Reading a tree of option dataclasses from a TOML file and `--section.key value` overrides.

This module knows how options are spelled, coerced and printed, not which options exist: the schema
(schema.py) hands it the root dataclass (one field per `[section]`, each a dataclass of
typed fields with a docstring under each) and its validation. Precedence is dataclass default <
TOML file < command line. Every mistake is one `ConfigError` line that names the key, the value and
what would be valid. A section may accept another TOML spelling of a field (its `toml_forms`: field
name -> a function from that TOML value to the field's value, raising ValueError), such as
`[[data.mix]]` tables for the mix string.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import math
import os
import sys
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, TypeVar

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from titanlike.errors import UserError

Root = TypeVar("Root")


class ConfigError(UserError):
    """A mistake in the job configuration; its message is one line meant for the user."""

    same_on_all_ranks = True


def need(ok: bool, msg: str) -> None:
    """A validation rule of the schema: raise `msg` as a ConfigError unless `ok`. tests/test_config.py
    finds every call in the schema's modules and checks that some invalid config trips it."""
    if not ok:
        raise ConfigError(msg)


# ---------------------------------------------------------------------------------------------
# Introspection: sections, fields, their types and docstrings.


def sections_of(root_cls: type) -> dict[str, type]:
    """Each `[section]` of a root dataclass and the dataclass that holds its fields."""
    return {f.name: f.default_factory for f in dataclasses.fields(root_cls)}  # type: ignore[misc]


def field_docs(section_cls: type) -> dict[str, str]:
    """The docstring under each field of a section dataclass, read from its source."""
    tree = ast.parse(inspect.getsource(section_cls))
    cls_node = tree.body[0]
    assert isinstance(cls_node, ast.ClassDef)
    body = cls_node.body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def field_types(section_cls: type) -> dict[str, Any]:
    return typing.get_type_hints(section_cls)


def _is_union(tp: object) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def describe_type(tp: object) -> str:
    """A field's type in words, for --help, error lines and docs/configuration.md."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(str(a) for a in typing.get_args(tp))
    if _is_union(tp):
        return " or ".join(describe_type(a) for a in typing.get_args(tp) if a is not type(None))
    if origin is list:
        return f"a comma-separated list of {describe_type(typing.get_args(tp)[0])}"
    names: dict[object, str] = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return names.get(tp, str(tp))


# ---------------------------------------------------------------------------------------------
# Coercion: a TOML value or a command-line string into a field's type.


class _BareFlag(str):
    """A command-line option given without a value: true for booleans, a mistake otherwise."""


BARE_FLAG = _BareFlag("true")


def coerce(key: str, raw: object, tp: Any, typed: bool = False) -> object:
    """Turn a TOML value or a command-line string into the field's type, or raise ConfigError. `typed`: the value
    is TOML's, which has numbers, booleans and arrays of its own: a string in their place is refused, as the
    command line refuses a word where a number goes (`seq_len = "128"` as `--training.steps ten`)."""
    if isinstance(raw, _BareFlag) and bool not in (tp, *typing.get_args(tp)) and "true" not in typing.get_args(tp):
        raise ConfigError(f"--{key} needs a value: {describe_type(tp)}")
    origin = typing.get_origin(tp)
    bad = ConfigError(f"{key} = {raw!r} is not valid: expected {describe_type(tp)}")
    if typed and isinstance(raw, str) and (tp in (int, float, bool) or origin is list and typing.get_args(tp)[0] in
                                           (int, float, bool)):
        what = "an array, [a, b]" if origin is list else "the value without quotes"
        raise ConfigError(f"{key} = {raw!r} is not valid: expected {describe_type(tp)} (a TOML string in quotes is "
                          f"text: write {what})")
    if _is_union(tp):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional = len(args) < len(typing.get_args(tp))  # X | None: None is "decide for me"
        if optional and (raw is None or (isinstance(raw, str) and raw.lower() in ("", "none", "auto"))):
            return None
        for alternative in args[:-1]:  # float | Literal["auto"]: the first that takes the value
            try:
                return coerce(key, raw, alternative, typed)
            except ConfigError:
                continue
        try:
            return coerce(key, raw, args[-1], typed)
        except ConfigError:
            if len(args) == 1:
                raise
            raise bad from None
    if origin is Literal:
        choices = typing.get_args(tp)
        value = str(raw).lower() if isinstance(raw, bool) else str(raw)  # TOML true → "true"
        if value not in choices:
            close = difflib.get_close_matches(value, [str(c) for c in choices], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{key} = {raw!r} is not one of {', '.join(map(str, choices))}{hint}")
        return value
    if origin is list:
        (elem,) = typing.get_args(tp)
        if isinstance(raw, str):
            items: list[object] = [s.strip() for s in raw.split(",") if s.strip()]
        elif isinstance(raw, (list, tuple)):
            items = list(raw)
        else:
            raise bad
        return [coerce(key, item, elem, typed) for item in items]
    if tp is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(raw, str) and raw.lower() in ("false", "0", "no", "off"):
            return False
        raise bad
    if tp is int:
        if isinstance(raw, bool):
            raise bad
        try:
            whole = raw if isinstance(raw, int) else int(str(raw).replace("_", ""))
        except ValueError:
            raise bad from None
        # No setting means a number past 64 bits; such a value would wrap or exhaust memory further on.
        if abs(whole) >= 2**64:
            raise ConfigError(f"{key} = {raw} is out of range: no setting takes a number of 2^64 or more")
        return whole
    if tp is float:
        if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
            raise bad
        try:
            number = float(raw)
        except ValueError:
            raise bad from None
        if not math.isfinite(number):  # inf or nan: no option means either
            raise ConfigError(f"{key} = {raw!r} is not valid: expected a finite number")
        return number
    if tp is str:
        if isinstance(raw, (dict, list)):
            raise bad
        return str(raw)
    raise bad


COMMAND_LINE = "the command line"  # where an override came from, as error lines say it


def _closest(name: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.5)
    return f"; did you mean {close[0]}?" if close else f"; valid: {', '.join(candidates)}"


def _set(cfg: object, section: str, key: str, raw: object, source: str) -> None:
    secs = sections_of(type(cfg))
    if section not in secs:
        raise ConfigError(f"unknown config section [{section}] in {source}{_closest(section, list(secs))}")
    types_ = field_types(secs[section])
    if key not in types_:
        full = [f"{section}.{k}" for k in types_]
        everything = [f"{s}.{k}" for s, c in secs.items() for k in field_types(c)]
        # The same key in another section (--training.lr → optimizer.lr) beats a look-alike spelling.
        same_key = [f"{s}.{key}" for s, c in secs.items() if key in field_types(c)]
        near = same_key or difflib.get_close_matches(f"{section}.{key}", everything, n=1, cutoff=0.6)
        hint = f"; did you mean {near[0]}?" if near else f"; valid: {', '.join(full)}"
        raise ConfigError(f"unknown config key {section}.{key} in {source}{hint}")
    form = getattr(secs[section], "toml_forms", {}).get(key)
    if form is not None and not isinstance(raw, str):  # a section's other TOML spelling of this field
        try:
            raw = form(raw)
        except ValueError as e:
            raise ConfigError(f"{section}.{key} in {source}: {e}") from None
    typed = source != COMMAND_LINE  # a TOML file's value: numbers and booleans come typed, not in quotes
    setattr(getattr(cfg, section), key, coerce(f"{section}.{key}", raw, types_[key], typed))


# ---------------------------------------------------------------------------------------------
# Loading.


def parse_cli(argv: list[str]) -> list[tuple[str, str, object]]:
    """`--section.key value`, `--section.key=value`, or a bare `--section.key` for booleans."""
    out: list[tuple[str, str, object]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: options look like --section.key value")
        name, eq, value = arg[2:].partition("=")
        if "." not in name:
            raise ConfigError(f"option --{name} needs a section, like --training.steps 100")
        section, _, key = name.partition(".")
        if not eq:
            # A value follows unless the next token is another option (a bare boolean flag).
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value = argv[i + 1]
                i += 1
            else:
                value = BARE_FLAG
        out.append((section.replace("-", "_"), key.replace("-", "_"), value))
        i += 1
    return out


MAX_CONFIG_BYTES = 16 * 2**20  # a config of every option is a few KB: a larger file is not one


def read_toml(path: str) -> dict[str, Any]:
    """The TOML file that `--job.config_file` names, or one ConfigError line saying why not. Read through the
    file gate (titanlike/fs.py: a regular file, not a FIFO or a device, of a config's size)."""
    from titanlike import fs

    if not os.path.exists(path):
        raise ConfigError(f"job.config_file = {path!r}: no such file{_config_file_hint(path)}")
    if os.path.isdir(path):
        raise ConfigError(f"job.config_file = {path!r} is a folder; name the TOML file in it")
    try:
        data = fs.read_bytes(path, "job.config_file", limit=MAX_CONFIG_BYTES)
    except UserError as e:
        raise ConfigError(str(e)) from None
    try:
        text = data.decode("utf-8").removeprefix("\ufeff")  # a byte-order mark, as some editors write
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"job.config_file = {path!r} is not UTF-8 text (byte {e.start}): TOML files are UTF-8") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"job.config_file = {path!r} is not valid TOML: {e}") from None
    except RecursionError:  # arrays or tables nested thousands deep: tomllib recurses once a level
        raise ConfigError(f"job.config_file = {path!r} nests arrays or inline tables deeper than the TOML reader "
                          f"goes: no option takes such a value") from None


# The TOML files shipped beside the package (a source checkout, an editable install), a mistyped name's last resort.
SHIPPED_CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                               "train_configs")


def _config_file_hint(path: str) -> str:
    """`; did you mean <file>?` for a config file that is not there: the closest .toml name in its folder or in
    the shipped train_configs/ (a folder mistyped too), the folder's own first on a tie; "" when none is close."""
    folder, name = os.path.split(path)
    shipped = os.path.relpath(SHIPPED_CONFIGS)  # said from here when it is below here
    best, best_score = "", 0.6  # difflib's ratio; below it, no hint
    for where, shown in ((folder or ".", folder), (SHIPPED_CONFIGS, SHIPPED_CONFIGS if ".." in shipped else shipped)):
        try:
            names = sorted(n for n in os.listdir(where) if n.endswith(".toml"))
        except OSError:  # no such folder, or not one we may read
            continue
        for candidate in names:
            score = difflib.SequenceMatcher(None, name, candidate).ratio()
            if score > best_score:
                best, best_score = os.path.join(shown, candidate), score
    return f"; did you mean {best}?" if best else ""


def load(root_cls: type[Root], argv: list[str] | None, validate: Callable[[Root], None],
         usage: str = "") -> Root:
    """Defaults, then the TOML file (job.config_file, from the CLI), then the CLI overrides; validated.

    `--help` anywhere prints the usage line and every option, and exits 0."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(help_text(root_cls, usage, argv))
        raise SystemExit(0)
    cfg = _read(root_cls, argv)
    validate(cfg)
    return cfg


def _read(root_cls: type[Root], argv: list[str]) -> Root:
    """Defaults, then the TOML file, then the command line; not validated."""
    overrides = parse_cli(argv)
    cfg = root_cls()
    config_file = [v for s, k, v in overrides if (s, k) == ("job", "config_file")]
    if config_file and isinstance(config_file[-1], _BareFlag):
        raise ConfigError("--job.config_file needs a value: the path of a TOML file")
    if config_file and config_file[-1]:
        path = str(config_file[-1])
        for section, table in read_toml(path).items():
            if not isinstance(table, dict):
                raise ConfigError(f"{path}: top-level key {section!r} must be a [section] table")
            for key, value in table.items():
                _set(cfg, section, key, value, path)
    for section, key, value in overrides:
        _set(cfg, section, key, value, COMMAND_LINE)
    return cfg


# ---------------------------------------------------------------------------------------------
# Output.


def toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    # A TOML basic string: backslash, quote and every control character escaped (a path may hold them).
    out = []
    for ch in str(v):
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def to_toml(cfg: object) -> str:
    """The resolved config as TOML (unset optional fields are omitted: they mean 'decide for me')."""
    lines = []
    for name in sections_of(type(cfg)):
        lines.append(f"[{name}]")
        for key, value in dataclasses.asdict(getattr(cfg, name)).items():
            if value is not None:
                lines.append(f"{key} = {toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def help_text(root_cls: type, usage: str = "", argv: list[str] | None = None) -> str:
    """The usage line, then every option with the value a run with `argv` (the command line, --help left
    out; run_train.sh passes its config file) would use, in TOML, its type, default and docstring,
    section by section. Not validated: --help shows what was asked for even where a rule would refuse it."""
    out = [usage, ""] if usage else []
    args = [a for a in argv or [] if a not in ("-h", "--help")]
    run: Any = root_cls()
    try:
        run = _read(root_cls, args)
        out += ["Each option: the value a run with these arguments uses (default < the TOML file that",
                "--job.config_file names < the command line), then its type and the default.", ""]
    except ConfigError as e:
        out += [f"These arguments do not load ({e}): each option shows its default.", ""]
    for name, cls in sections_of(root_cls).items():
        out.append(f"[{name}]")
        docs = field_docs(cls)
        defaults, values = cls(), getattr(run, name)
        for key, tp in field_types(cls).items():
            value, default = (_help_value(getattr(x, key)) for x in (values, defaults))
            out.append(f"  --{name}.{key} = {value}  ({describe_type(tp)}; default {default})")
            out.append(f"      {docs.get(key, '')}")
        out.append("")
    return "\n".join(out)


def _help_value(v: object) -> str:
    return "unset" if v is None else toml_value(v)
