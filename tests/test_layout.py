"""The shape of the package (docs/architecture.md): no import cycle between modules, function-level
imports included; no module over 450 lines; the preflight and the config need no torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "titanlike"
MAX_LINES = 450


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The titanlike modules `path` imports anywhere in its text (top level or inside functions).
    `from pkg import sub` names the module pkg.sub; `from pkg import name` names pkg."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("titanlike"):
            subs = {f"{node.module}.{a.name}" for a in node.names} & known.keys()
            out |= subs
            if len(subs) < len(node.names) and node.module in known:
                out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names} & known.keys()
    return out


def test_no_import_cycle():
    known = modules()
    graph = {name: imports(path, known) - {name} for name, path in known.items()}
    assert graph["titanlike.train"], "the import walk found nothing: the test would pass vacuously"
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [node, nxt])
            elif nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    assert not cycles, f"import cycles: {cycles}"


def test_no_module_over_450_lines():
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_the_preflight_and_the_config_import_no_torch():
    code = ("import sys, titanlike.preflight, titanlike.config; "
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"
