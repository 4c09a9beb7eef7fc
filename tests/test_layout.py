"""The shape of the package (docs/architecture.md): no import cycle between modules, function-level
imports included; no two packages that import each other; the arrows docs/architecture.md forbids never drawn;
no module over 450 lines; the preflight and the config need no torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import deque
from collections.abc import Callable
from pathlib import Path

import pytest

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


# ---- between packages -------------------------------------------------------------------------------
# A node is a subpackage (titanlike/data/) or a top-level module (titanlike/train.py), as docs/architecture.md
# names them.

SHARED = ("titanlike.errors", "titanlike.fs", "titanlike.cache")
"""The top-level modules every part may use: each imports nothing of titanlike but another of them."""

# (the modules that must not reach, the modules they must not reach, why). Reaching counts imports at any
# depth, through any module: a package that imports B through C still depends on B.
NEVER = [
    ("titanlike.data", "titanlike.checkpoint", "data/ never imports checkpoint/"),
    ("titanlike.data", "titanlike.hf", "data/ never imports hf/"),
    ("titanlike.data", "titanlike.float8", "data/ never imports float8/"),
    ("titanlike.data", "titanlike.records.metrics", "data and metrics know nothing of each other"),
    ("titanlike.checkpoint", "titanlike.hf", "checkpoint/ never imports hf/ (hf/ may read step folders)"),
    ("titanlike.checkpoint", "titanlike.data", "checkpoint and data know nothing of each other"),
    ("titanlike.checkpoint", "titanlike.records.metrics", "checkpoint and metrics know nothing of each other"),
    ("titanlike.records.metrics", "titanlike.checkpoint", "checkpoint and metrics know nothing of each other"),
    ("titanlike.records.metrics", "titanlike.data", "data and metrics know nothing of each other"),
    ("titanlike.run", "titanlike.records", "the loop's parts know nothing of what records them"),
    ("titanlike.records", "titanlike.run", "the records know nothing of the loop's parts: they get values"),
    ("titanlike.plan", "titanlike.parallel", "plan/ is plain Python (the preflight runs it): never parallel/"),
    ("titanlike.plan", "titanlike.float8", "plan/ is plain Python (the preflight runs it): never float8/"),
    ("titanlike.plan", "titanlike.train", "plan/ is plain Python (the preflight runs it): never the trainer"),
]
CONFIG_MAY_REACH = ("titanlike.config", "titanlike.model", *SHARED)
"""config/ is the root of the flow: it imports nothing of titanlike but model/'s plain shapes (and the
shared modules); test_the_preflight_and_the_config_import_no_torch keeps what it imports of model/ plain."""


def within(module: str, group: str) -> bool:
    return module == group or module.startswith(group + ".")


def node(module: str) -> str:
    """titanlike.data.build -> data; titanlike.train -> train."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def module_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, known) - {name} for name, path in known.items()}


def first_path(graph: dict[str, set[str]], start: str, goal: Callable[[str], bool]) -> list[str] | None:
    """The shortest import chain from `start` to a node `goal` accepts (start itself excluded), or None."""
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        here = queue.popleft()
        for nxt in sorted(graph.get(here, ())):
            if nxt in parent or nxt == start:
                continue
            parent[nxt] = here
            if goal(nxt):
                chain = [nxt]
                while chain[-1] != start:
                    chain.append(parent[chain[-1]])
                return chain[::-1]
            queue.append(nxt)
    return None


def package_cycles(graph: dict[str, set[str]]) -> list[str]:
    """Each pair of packages (or top-level modules) that reach each other, as the chain that closes it."""
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        packages.setdefault(node(module), set()).update(node(t) for t in targets if node(t) != node(module))
    found = []
    for a in sorted(packages):
        for b in sorted(packages[a]):
            back = first_path(packages, b, lambda n, a=a: n == a)
            if back is not None and a == min(back):  # each cycle once, from its smallest package
                found.append(" -> ".join([a, *back]))
    return found


def forbidden_arrows(graph: dict[str, set[str]]) -> list[str]:
    """Each module that reaches what docs/architecture.md says its package never imports, with the chain and the
    rule."""
    rules: list[tuple[str, Callable[[str], bool], str]] = [
        (source, lambda m, target=target: within(m, target), why) for source, target, why in NEVER]
    rules.append(("titanlike.config", lambda m: not any(within(m, g) for g in CONFIG_MAY_REACH),
                  "config/ imports nothing of titanlike but model/ (and errors, fs, cache)"))
    rules += [(shared, lambda m: m not in SHARED, "errors, fs and cache import nothing of titanlike but each other")
              for shared in SHARED]
    found = []
    for source, goal, why in rules:
        for module in sorted(m for m in graph if within(m, source)):
            chain = first_path(graph, module, goal)
            if chain is not None:
                found.append(f"{' -> '.join(chain)}: {why}")
    return found


def test_no_two_packages_import_each_other():
    graph = module_graph()
    cycles = package_cycles(graph)
    assert not cycles, "packages that import each other (function-level imports included):\n" + "\n".join(cycles)


def test_no_forbidden_arrow_between_packages():
    arrows = forbidden_arrows(module_graph())
    assert not arrows, "imports docs/architecture.md's shape of the code forbids:\n" + "\n".join(arrows)


def test_the_package_checks_catch_what_they_guard():
    """Planted into the real graph, a cycle and each kind of forbidden arrow are reported: the two tests
    above do not pass merely because the walk missed the imports they guard."""
    graph = module_graph()
    assert graph["titanlike.train"] and graph["titanlike.config.run"], "the import walk found nothing"
    assert {node(m) for m in graph} >= {"config", "model", "data", "parallel", "float8", "checkpoint", "hf", "run",
                                        "records", "process", "train", "trainer", "preflight", "optim"}

    def planted(source: str, target: str) -> dict[str, set[str]]:
        return {**graph, source: graph[source] | {target}}

    # The planted arrow closes a cycle (reported once, from its smallest package): it is named in it.
    assert any("model -> train" in c for c in package_cycles(planted("titanlike.model.shape", "titanlike.train")))
    for source, target, _ in NEVER:
        src = next(m for m in sorted(graph) if within(m, source))
        dst = next(m for m in sorted(graph) if within(m, target))
        assert any(a.startswith(f"{src} -> ") for a in forbidden_arrows(planted(src, dst))), (source, target)
    assert any(a.startswith("titanlike.config.sources -> titanlike.data.loader")
               for a in forbidden_arrows(planted("titanlike.config.sources", "titanlike.data.loader")))
    assert any(a.startswith("titanlike.fs -> titanlike.config")
               for a in forbidden_arrows(planted("titanlike.fs", "titanlike.config")))
    # Through a middleman: model/ importing optim would make config/ reach it.
    assert any(a.startswith("titanlike.config.") and "titanlike.model.shape -> titanlike.optim" in a
               for a in forbidden_arrows(planted("titanlike.model.shape", "titanlike.optim")))


def test_no_module_over_450_lines():
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_the_preflight_and_the_config_import_no_torch():
    code = ("import sys, titanlike.preflight, titanlike.config; "
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


def test_the_trainer_the_checkpoint_and_the_plan_name_no_optimizer():
    """Optimizers come in through one registry (optim/__init__.py) and one table of facts
    (config/optimizer.py): the trainer, the checkpoint and the memory plan name none of them, so that a new
    optimizer is one module and two entries, not edits across the run (docs/architecture.md)."""
    import re

    from titanlike.config.optimizer import OPTIMIZERS

    names = re.compile("|".join(OPTIMIZERS), re.IGNORECASE)
    assert names.search("Muon's momentum, AdamW's moments")  # the pattern finds what it guards
    files = [PACKAGE / "trainer.py", *sorted((PACKAGE / "checkpoint").glob("*.py")),
             *sorted((PACKAGE / "plan").glob("*.py"))]
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for path in files
             for n, line in enumerate(path.read_text().splitlines(), 1) if names.search(line)]
    assert not found, "optimizers named outside optim/ and config/optimizer.py:\n" + "\n".join(found)


PROBES_AND_TOOLS = sorted((ROOT / "tests" / "probes").glob("*.py")) + sorted((ROOT / "scripts").glob("*.py"))


@pytest.mark.parametrize("path", PROBES_AND_TOOLS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_probe_and_tool_imports(path: Path, monkeypatch):
    """The GPU tier's probes and the developer tools run where no CPU test runs them: each at least imports
    (a probe once imported a helper that had moved, and failed only on two GPUs)."""
    import importlib.util

    name = f"_imported_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)


def test_the_trainer_the_checkpoint_and_the_metrics_name_no_converter():
    """Model converters come in through one protocol (model/converter.py) and one registry (titanlike/converters.py):
    the trainer, the checkpoint manager and the metrics logger name none of them (float8 is one), so that a new
    converter is one module and its entries, not edits across the run (docs/architecture.md)."""
    import re

    names = re.compile(r"float8|fp8", re.IGNORECASE)
    assert names.search("self.float8.attach(...)")  # the pattern finds what it guards
    files = [PACKAGE / "trainer.py", PACKAGE / "checkpoint" / "manager.py", PACKAGE / "records" / "metrics.py"]
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for path in files
             for n, line in enumerate(path.read_text().splitlines(), 1) if names.search(line)]
    assert not found, "converters named outside their registry:\n" + "\n".join(found)


def test_config_reaches_components_typed():
    """A component takes its typed section (or the whole typed config, or the resolved run): no parameter that
    holds a config (`cfg`, `*_cfg`, `section`) is left untyped or `Any`, and no code asks a typed section with
    getattr or hasattr whether it has a field (overrides/ aside: torchao's configs are its own)."""
    import re

    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "overrides" in path.parts:
            continue
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for arg in (*node.args.args, *node.args.kwonlyargs):
                    holds_config = arg.arg in ("cfg", "section") or arg.arg.endswith("_cfg")
                    if holds_config and (arg.annotation is None or ast.unparse(arg.annotation) == "Any"):
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.name}({arg.arg})")
        for n, line in enumerate(text.splitlines(), 1):
            if re.search(r"\b(getattr|hasattr)\((self\.)?cfg\.", line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "config handed over untyped, or its fields asked for by name:\n" + "\n".join(found)
