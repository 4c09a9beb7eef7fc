"""The code structure of a titanlike checkout, as one Markdown table (to compare two commits).

    python3 scripts/structure_report.py [REPO_ROOT]     # default: the checkout holding this script

Rows:
  1. Names the trainer uses per package: the distinct titanlike names titanlike/train.py and
     titanlike/trainer.py (where it exists) take, grouped by the first component after `titanlike.` (a
     from-import of a function or class counts as one name; a module imported as such counts each
     `module.attr` it uses); and their lines that use a name from what surrounds the steps (run/, and
     records/ and process/ where run/ was split).
  2. Widest functions: the five functions or methods of titanlike/ with the most parameters (self/cls not
     counted; keyword-only, *args and **kwargs counted).
  3. Mix strings parsed per process: how often the body that parses a data.mix string runs in one process
     of `titanlike.train.main` (1 step on CPU, a two-source data.mix), and of `titanlike.preflight.main`
     (`parse_mix`, or `_parse_mix_text` where parse_mix hands a parsed text back from a cache).
  4. Largest modules: the three modules of titanlike/ with the most lines.
  5. Size: lines and modules (.py files, __init__ included) of titanlike/; for run/ (and records/ and
     process/ where they exist), modules and the import arrows among them (distinct importer -> imported
     pairs, lazy imports included).

Rows 1, 2, 4, 5 read the source with `ast` only. Row 3 runs the checkout's own code in a subprocess with
PYTHONPATH=REPO_ROOT (not the installed titanlike); it prepares two tiny sources and trains the debug
model for one step: about 15 s on 2 cores.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

# Row 3's probe, run by `python -c PROBE ROOT MODE TMP`. MODE prepare writes two sources into TMP (as
# tests/test_data_mixture.py does); train / preflight run titanlike.MODE.main and print how many frames
# ran parse_mix's code object. Counting frames by code object, not by
# patching the function, also catches callers that bound the name with `from ... import parse_mix`.
PROBE = r"""
import importlib, sys, threading
from pathlib import Path
root, mode, tmp = sys.argv[1:4]
import titanlike
assert Path(titanlike.__file__).resolve().is_relative_to(Path(root).resolve()), titanlike.__file__
if mode == "prepare":
    from titanlike.data.prepare.driver import prepare
    for name, docs, word in (("web", 60, "web page"), ("code", 15, "def f(): return")):
        (text := Path(tmp, name + "-text")).mkdir()
        for i in range(docs):
            (text / f"{i:03d}.txt").write_text(f"{word} {i} " * (20 + i % 7))
        prepare(str(Path(tmp, name)), [str(text)], workers=1, val_fraction=0.2)
    sys.exit(0)
import titanlike.config.sources as sources
parser = getattr(sources, "_parse_mix_text", sources.parse_mix).__code__
calls = 0
def count(frame, event, arg):
    global calls
    if event == "call" and frame.f_code is parser:
        calls += 1
mix = f"web={tmp}/web:0.7,code={tmp}/code:0.3"
argv = ["--job.config_file", f"{root}/train_configs/debug_model.toml", "--job.dump_folder", f"{tmp}/run-{mode}",
        "--training.device", "cpu", "--training.steps", "1", "--data.seq_len", "16", "--data.mix", mix,
        "--training.local_batch_size", "2", "--training.global_batch_size", "2", "--validation.steps", "1",
        "--checkpoint.enable", "false", "--metrics.enable_tensorboard", "false"]
sys.setprofile(count)  # before the entry's import: a call at import time counts too
threading.setprofile(count)
rc = importlib.import_module(f"titanlike.{mode}").main(argv)
sys.setprofile(None)
print(f"\nPARSE_MIX_CALLS {calls} rc={rc}")
"""


def probe(root: Path, mode: str, tmp: str) -> str:
    """Run PROBE in MODE; its count, or why there is none."""
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1", TITANLIKE_CACHE=f"{tmp}/cache",
               XDG_CONFIG_HOME=f"{tmp}/config")  # no user cache or checkpoint key touched
    # cwd=tmp: `python -c` puts the working directory first on sys.path, ahead of PYTHONPATH.
    proc = subprocess.run([sys.executable, "-c", PROBE, str(root), mode, tmp], env=env, cwd=tmp,
                          capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PARSE_MIX_CALLS ")]
    if proc.returncode == 0 and mode == "prepare":
        return "prepared"
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return f"failed (exit {proc.returncode}: {tail[:120]})"
    count, rc = lines[-1].split()[1:]
    return count if rc == "rc=0" else f"{count} ({rc})"


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every titanlike/**/*.py."""
    out = {}
    for path in sorted((root / "titanlike").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def is_module(root: Path, dotted: list[str]) -> bool:
    base = root.joinpath("titanlike", *dotted)
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


SURROUNDS = ("run", "records", "process")
"""The packages of what surrounds the steps (run/ alone before it was split)."""


def trainer_names(root: Path) -> tuple[dict[str, set[str]], int]:
    """Row 1: {group: names under titanlike (dotted)}, and the count of lines using SURROUNDS, over
    train.py and trainer.py."""
    names: dict[str, set[str]] = defaultdict(set)
    lines = 0
    for file in ("train.py", "trainer.py"):
        if (root / "titanlike" / file).is_file():
            lines += _file_names(root, ast.parse((root / "titanlike" / file).read_text()), names)
    return names, lines


def _file_names(root: Path, tree: ast.Module, names: dict[str, set[str]]) -> int:
    """Adds one file's names to `names`; returns its lines using SURROUNDS names."""
    bound: dict[str, list[str]] = {}  # a local name -> its dotted path under titanlike
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "titanlike":
            for alias in node.names:
                path = [*(node.module or "").split(".")[1:], alias.name]
                bound[alias.asname or alias.name] = path
                if not is_module(root, path):  # a function, class or constant: one name
                    names[path[0]].add(".".join(path))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("titanlike.") and alias.asname:
                    bound[alias.asname] = alias.name.split(".")[1:]
    # A module binding's names: each attribute chain off it, followed while it names a submodule.
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or id(node) in inner:
            continue
        chain: list[str] = []
        head: ast.expr = node
        while isinstance(head, ast.Attribute):
            chain.insert(0, head.attr)
            head = head.value
        if isinstance(head, ast.Name) and head.id in bound and is_module(root, bound[head.id]):
            path = list(bound[head.id])
            for attr in chain:
                path.append(attr)
                if not is_module(root, path):
                    break
            names[path[0]].add(".".join(path))
    run_names = {local for local, path in bound.items() if path[0] in SURROUNDS}
    run_lines = {n.lineno for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id in run_names}
    return len(run_lines)


def widest(mods: dict[str, Path], top: int = 5) -> list[tuple[int, str]]:
    """Row 2: (parameter count, module:qualname), widest first."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST, module: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, module, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = child.args
                params = [p.arg for p in (*a.posonlyargs, *a.args)]
                n = len(params) - (params[:1] in (["self"], ["cls"])) + len(a.kwonlyargs)
                n += (a.vararg is not None) + (a.kwarg is not None)
                found.append((n, f"{module}:{prefix}{child.name}"))
                visit(child, module, f"{prefix}{child.name}.<locals>.")
            else:
                visit(child, module, prefix)

    for module, path in mods.items():
        visit(ast.parse(path.read_text()), module, "")
    return sorted(found, key=lambda t: (-t[0], t[1]))[:top]


def run_arrows(root: Path, package: str = "run") -> tuple[int, int]:
    """Row 5: modules of titanlike/PACKAGE/ and distinct (importer, imported) pairs among them."""
    run = root / "titanlike" / package
    files = sorted(run.rglob("*.py"))
    edges = set()
    for path in files:
        src = path.relative_to(run).parts[0].removesuffix(".py")
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[list[str]] = []  # each import's dotted path, relative to titanlike.run
            if isinstance(node, ast.Import):
                targets = [a.name.split(".")[2:] for a in node.names
                           if a.name == f"titanlike.{package}" or a.name.startswith(f"titanlike.{package}.")]
            elif isinstance(node, ast.ImportFrom):
                module = node.module.split(".") if node.module else []
                if node.level == 1:  # relative to titanlike.run (modules and __init__ alike)
                    base = module
                elif node.level == 0 and module[:2] == ["titanlike", package]:
                    base = module[2:]
                else:
                    continue
                # `from titanlike.run import faults` imports the module faults; `from .x import f` imports x.
                targets = [base or [a.name] for a in node.names]
            for target in targets:
                dst = target[0] if target and is_module(root, [package, target[0]]) else "__init__"
                if dst != src:
                    edges.add((src, dst))
    return len(files), len(edges)


def describe(root: Path) -> str:
    """The checkout's commit, and whether titanlike/ differs from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True).stdout.strip()
    dirty = " + uncommitted changes in titanlike/" if git("status", "--porcelain", "--", "titanlike") else ""
    return f"`{root}` at {git('rev-parse', '--short', 'HEAD') or 'no git commit'}{dirty}"


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent).resolve()
    mods = modules(root)
    lines = {m: len(p.read_text().splitlines()) for m, p in mods.items()}
    groups, run_lines = trainer_names(root)
    per_group = ", ".join(f"{g} {len(n)}" for g, n in sorted(groups.items(), key=lambda t: (-len(t[1]), t[0])))
    total_names = sum(len(n) for n in groups.values())
    with tempfile.TemporaryDirectory(prefix="structure-report-") as tmp:
        prepared = probe(root, "prepare", tmp)  # both entry points read these two sources
        ok = prepared == "prepared"
        train = probe(root, "train", tmp) if ok else prepared
        preflight = ((probe(root, "preflight", tmp) if ok else prepared)
                     if (root / "titanlike" / "preflight.py").is_file() else "no titanlike/preflight.py")
    rows = [
        ("1. Names train.py and trainer.py take per package", f"{total_names}: {per_group}"),
        ("1. Their lines using a name of run/ (records/, process/)", str(run_lines)),
        ("2. Five widest functions", "<br>".join(f"{name} ({n})" for n, name in widest(mods))),
        ("3. Mix strings parsed per process: train main (1 step, 2-source mix)", train),
        ("3. Mix strings parsed per process: preflight main", preflight),
        ("4. Largest modules", ", ".join(f"{m} ({lines[m]})" for m in sorted(lines, key=lambda m: -lines[m])[:3])),
        ("5. titanlike/: lines, modules", f"{sum(lines.values())} lines, {len(mods)} modules"),
    ]
    for package in SURROUNDS:
        if (root / "titanlike" / package).is_dir():
            n, arrows = run_arrows(root, package)
            rows.append((f"5. titanlike/{package}/: modules, import arrows among them",
                         f"{n} modules, {arrows} arrows"))
    print(f"Structure of {describe(root)}\n\n| Measure | Value |\n|---|---|")
    for measure, value in rows:
        print(f"| {measure} | {value} |")


if __name__ == "__main__":
    main()
