"""The house rules of the code base, checked on its source (docs/architecture.md, "House rules"):
no import circles, imports at the top of modules, backends chosen by asking them and never by
testing their type, a `--dry-run` that imports no torch, and an architecture map that names
every module."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("pipeline", "actors", "learner", "buffers", "retrieval")

DEFERRED = {
    "pipeline/launch.py": {"pipeline.runtime.run", "pipeline.runtime", "pipeline.runtime.parts"},
    "pipeline/plugins.py": {"learner.estimators"},
    "pipeline/config/algorithm.py": {"learner", "learner.estimators"},
}
"""Imports of our own modules inside functions, and why: the launcher imports the run (torch)
only once `--dry-run` is past, and the built-in tools' registry (torch) only for
`--list-plugins`; the estimators' registry (torch) is imported when a plug-in estimator is named
or listed, so a config of built-ins loads without torch. Besides these, a backend module of pipeline/backends/ imports its
implementation when called, so the config schema that holds it imports no torch."""


def modules() -> dict[str, Path]:
    found = {}
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


MODULES = modules()


def _own(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(path: Path) -> list[tuple[str, bool]]:
    """(our module imported, whether inside a function) for every import outside TYPE_CHECKING."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(sub) for sub in ast.walk(node)}
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            inside |= {id(sub) for sub in ast.walk(node) if sub is not node}
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        for target in {_own(n) for n in names} - {None}:
            found.append((target, id(node) in inside))
    return found


def test_no_import_circles_counting_imports_inside_functions():
    edges = {name: {t for t, _ in imports(path)} - {name} for name, path in MODULES.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_our_modules_are_imported_at_the_top():
    late = []
    for path in MODULES.values():
        relative = str(path.relative_to(ROOT))
        if relative.startswith("pipeline/backends/"):
            continue  # a backend imports its implementation when chosen
        for target, inside in imports(path):
            if inside and target not in DEFERRED.get(relative, set()):
                late.append(f"{relative} imports {target} inside a function")
    assert not late, "\n".join(late)


def test_no_module_tests_a_backend_by_its_config_class():
    """Behaviour that differs by engine or runtime is asked of the chosen backend
    (pipeline/backends/); an isinstance test on their config classes elsewhere is a dispatch
    the next backend would have to grow."""
    from pipeline.backends import ENGINES, RUNTIMES
    from pipeline.backends.engine import EngineBackend, ServerEngine
    from pipeline.backends.runtime import RuntimeBackend

    classes = {
        c.__name__ for c in (*ENGINES, *RUNTIMES, EngineBackend, ServerEngine, RuntimeBackend)
    }
    found = []
    for path in MODULES.values():
        if "pipeline/backends/" in str(path):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
                named = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                named |= {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
                if named & classes:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"isinstance on a backend's config class: {found}"


def test_a_dry_run_imports_no_torch():
    code = (
        "import contextlib, io, sys\n"
        "from pipeline.launch import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['configs/gaia.yaml', '--dry-run']) == 0\n"
        "print(sorted(m for m in ('torch', 'transformers', 'ray', 'deepspeed') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_the_architecture_map_names_every_module():
    text = (ROOT / "docs" / "architecture.md").read_text()
    missing = [
        str(path.relative_to(ROOT))
        for path in MODULES.values()
        if path.name != "__init__.py" and str(path.relative_to(ROOT)) not in text
    ]
    assert not missing, f"docs/architecture.md does not name: {', '.join(missing)}"


def test_every_runtime_has_a_run_and_every_engine_that_replaces_it_one_of_its_own():
    from pipeline.backends import ENGINES, RUNTIMES
    from pipeline.runtime.run import RUNNERS, WHOLE_RUNS

    assert set(RUNNERS) == {c.model_fields["type"].default for c in RUNTIMES}
    assert set(WHOLE_RUNS) == {c.model_fields["type"].default for c in ENGINES if c.replaces_run}
