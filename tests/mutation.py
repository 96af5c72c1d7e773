"""`make mutation`'s pytest plugin (`-p tests.mutation` in pyproject.toml's [tool.mutmut]):
where a mutant's seconds go, and how they are kept few.

mutmut runs every selected test once under its trampolines (the stats run: MUTANT_UNDER_TEST is
"stats") and maps each mutated function to the tests that reached it; each mutant then runs those
tests in a child forked from a server that collected the test files. Three things made that slow,
and this plugin removes each:

- A function is reached by far more than its own unit tests: `learner/advantages.py` by the trap
  and full learner-step tests too (21 s of tests a mutant). In the stats run this plugin forgets
  a hit when the test's file is not one that [tool.strata.mutation.tests] names for the
  function's module, so a mutant runs only its module's fast unit tests (a module none of whose
  tests reaches a function gets mutmut's "no tests", not a slow test of another module).
- Tests import transformers, DeepSpeed and the model code inside fixtures and functions, and a
  forked child does not keep what it imported: each mutant paid the imports again (~1 s of a
  critic mutant's 1.6 s). The stats run writes the modules it ended with to `IMPORTED`, and the
  fork server imports them after collecting, so its children inherit them.
- tests/conftest.py orders the suite's files longest first (to balance xdist's workers), and a
  file's slowest test often comes first (test_trap.py's 3.2 s reference before its 0.07 s
  checks); with pytest's -x a killed mutant should meet its fastest tests first, so under a mutant
  the files, and each file's tests, run cheapest first by their seconds in mutmut-stats.json.

It also writes each mutant's CPU seconds to `CPU`, which benchmarks/mutation.py sums per module.
Nothing here acts outside mutmut (no MUTANT_UNDER_TEST in the environment).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import resource
import sys
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

IMPORTED = Path("mutmut-imported.txt")
"""In mutmut's work directory (its cwd while tests run): the modules the stats run had imported."""

CPU = Path("mutmut-cpu.tsv")
"""In mutmut's work directory: `mutant name<TAB>CPU seconds` of each mutant's child (a child
killed at its time limit writes none)."""

_PHASES = {"stats", "fail", "list_all_tests", "mutant_generation", ""}
"""MUTANT_UNDER_TEST's values that are mutmut's own phases rather than a mutant's name."""


def module_tests(pyproject: Path) -> dict[str, tuple[str, ...]]:
    """[tool.strata.mutation.tests]: mutated module -> the test files its mutants run. Every file
    [tool.mutmut] mutates must have an entry, and every file named must be in mutmut's selection."""
    data = tomllib.loads(pyproject.read_text())
    mutmut = data.get("tool", {}).get("mutmut", {})
    table = data.get("tool", {}).get("strata", {}).get("mutation", {}).get("tests")
    if table is None:
        raise pytest.UsageError(
            f"{pyproject}: no [tool.strata.mutation.tests]: name each mutated module's test files"
        )
    selection = set(mutmut.get("pytest_add_cli_args_test_selection", []))
    for path in mutmut.get("only_mutate", []):
        module = path.removesuffix(".py").replace("/", ".")
        if module not in table:
            raise pytest.UsageError(
                f"{pyproject}: [tool.strata.mutation.tests] has no {module!r}: "
                f"name the test files {path}'s mutants run"
            )
    for module, files in table.items():
        outside = sorted(set(files) - selection)
        if outside:
            raise pytest.UsageError(
                f"{pyproject}: [tool.strata.mutation.tests] {module!r} names {', '.join(outside)}, "
                "not in [tool.mutmut] pytest_add_cli_args_test_selection: add it there"
            )
    return {module: tuple(files) for module, files in table.items()}


def owned_hits(
    hits: Iterable[str], test_file: str, tests: Mapping[str, tuple[str, ...]]
) -> set[str]:
    """The functions mutmut saw a test reach (`module.function` names, a method's class joined to
    it with ǁ, never a dot) that the test counts for: those of modules whose test files include
    the test's. A module the table does not name keeps every hit."""
    kept = set()
    for name in hits:
        module = name.rpartition(".")[0]
        if module not in tests or test_file in tests[module]:
            kept.add(name)
    return kept


def cheapest_first(nodeids: list[str], seconds: Mapping[str, float]) -> list[int]:
    """The order to run `nodeids` in: files by their tests' total measured seconds, cheapest
    first, and within a file its tests cheapest first (a file stays together, so its
    module-scoped fixtures are built once); unmeasured tests count 0, ties keep the given order.
    Returns indices into `nodeids`."""
    files = [nodeid.split("::", 1)[0] for nodeid in nodeids]
    cost: dict[str, float] = {}
    for path, nodeid in zip(files, nodeids, strict=True):
        cost[path] = cost.get(path, 0.0) + seconds.get(nodeid, 0.0)
    first = {path: files.index(path) for path in cost}
    return sorted(
        range(len(nodeids)),
        key=lambda i: (cost[files[i]], first[files[i]], seconds.get(nodeids[i], 0.0), i),
    )


def _phase() -> str | None:
    return os.environ.get("MUTANT_UNDER_TEST")


def pytest_configure(config: pytest.Config) -> None:
    if _phase() is not None:
        config.stash[_TESTS] = module_tests(Path(config.rootpath) / "pyproject.toml")


_TESTS = pytest.StashKey[dict[str, tuple[str, ...]]]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    """Before mutmut's stats collector reads the hits of this test (tryfirst), drop those of
    modules this test's file is not a unit test of."""
    if _phase() != "stats":
        return
    from mutmut.state import state  # only under mutmut, which is in the dev extra

    hits = state()._stats  # mutmut 3.8.1 (pinned): the functions reached since the last test
    keep = owned_hits(hits, item.nodeid.split("::", 1)[0], item.config.stash[_TESTS])
    hits.intersection_update(keep)


def pytest_sessionfinish(session: pytest.Session) -> None:
    phase = _phase()
    if phase not in _PHASES and phase is not None:
        # A forked child's CPU counters start at 0 (fork(2)), so RUSAGE_SELF is this mutant's
        # cost; mutmut's fork server records no duration. One short O_APPEND write a line: the
        # two children's lines do not interleave.
        used = resource.getrusage(resource.RUSAGE_SELF)
        with CPU.open("a") as out:
            out.write(f"{phase}\t{used.ru_utime + used.ru_stime:.3f}\n")
    if phase == "stats":  # added to: a later stats run of new tests only sees their imports
        names = {n for n in sys.modules if not n.startswith(("tests.", "__main__"))}
        if IMPORTED.is_file():
            names |= set(IMPORTED.read_text().split())
        IMPORTED.write_text("\n".join(sorted(names)) + "\n")


def pytest_collection_finish(session: pytest.Session) -> None:
    """In mutmut's fork server (a collect-only session while no mutant is set), import what the
    stats run imported, so that no mutant's child imports it again. Best effort: a module that
    will not import alone is left to the test that imports it."""
    if _phase() != "" or not session.config.option.collectonly or not IMPORTED.is_file():
        return
    for name in IMPORTED.read_text().split():
        if name not in sys.modules:
            with contextlib.suppress(Exception):  # a warm-up only: the test imports it itself
                importlib.import_module(name)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if _phase() in _PHASES or _phase() is None:
        return
    path = Path("mutmut-stats.json")
    seconds = json.loads(path.read_text())["duration_by_test"] if path.is_file() else {}
    order = cheapest_first([item.nodeid for item in items], seconds)
    items[:] = [items[i] for i in order]
