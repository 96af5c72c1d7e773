"""`make mutation`'s table: mutmut's results per module, from its work directory (mutants/).

mutmut (pinned in the dev extra, configured in pyproject.toml's [tool.mutmut]) keeps each mutated
file's results in mutants/<path>.meta: an exit code per mutant (1 or 3 killed, 0 survived, 36 or
a SIGXCPU code timed out, None not run yet; mutmut.stats.status_by_exit_code). A survivor listed
in the equivalence file (`mutant_name  reason`, one a line, `#` comments) counts as equivalent:
no test can tell it from the original.

    python benchmarks/mutation.py [--equivalent docs/results/mutation-equivalent.txt] [--survivors]
    python benchmarks/mutation.py --worst-case [--own-tests]

Prints a Markdown table: module, mutants, killed, survived, equivalent, timeout, no test reached,
not run, the killed share of the non-equivalent mutants checked, and the CPU seconds the mutants'
children took (tests/mutation.py records them in mutants/mutmut-cpu.tsv), in all and a mutant.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from mutmut.stats import status_by_exit_code

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.mutation import module_tests  # after the repository root is on the path

ROOT = Path(__file__).resolve().parents[1]


def equivalents(path: Path | None) -> dict[str, str]:
    """mutant name -> why it is equivalent."""
    if path is None or not path.is_file():
        return {}
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, reason = line.partition(" ")
            found[name] = reason.strip()
    return found


def tally(work: Path, equivalent: dict[str, str]) -> tuple[dict[str, Counter], list[str]]:
    """Per module, the count of each outcome; and the survivors not listed as equivalent."""
    table: dict[str, Counter] = {}
    survivors = []
    for meta in sorted(work.rglob("*.py.meta")):
        module = ".".join(meta.relative_to(work).with_suffix("").with_suffix("").parts)
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        counts = table.setdefault(module, Counter())
        for name, code in sorted(codes.items()):
            status = status_by_exit_code[code]
            if status == "survived" and name in equivalent:
                status = "equivalent"
            elif status == "survived":
                survivors.append(name)
            counts[status] += 1
    return table, survivors


def cpu_seconds(work: Path) -> dict[str, float]:
    """mutant name -> CPU seconds of its child, from tests/mutation.py's `mutmut-cpu.tsv` (the
    last line of a mutant that ran more than once)."""
    path = work / "mutmut-cpu.tsv"
    if not path.is_file():
        return {}
    found = {}
    for line in path.read_text().splitlines():
        name, _, seconds = line.partition("\t")
        found[name] = float(seconds)
    return found


def markdown(table: dict[str, Counter], cpu: dict[str, float] | None = None) -> str:
    """The per-module table. The score is killed over every mutant that is not equivalent and
    was checked: a survivor, a timeout and a mutant no test of its module reached all count
    against it. CPU: the children's seconds as tests/mutation.py recorded them (mutmut's own
    generation, stats and fork-server start not included), and their mean a recorded mutant."""
    # "no tests": no test of the module's own files ([tool.strata.mutation.tests]) reached the
    # mutated function, so no test ran; "not checked": the run stopped before the mutant.
    columns = ("killed", "survived", "equivalent", "timeout", "no tests", "not checked")
    lines = [
        "| module | mutants | killed | survived | equivalent | timeout | no test reached | not run "
        "| killed / non-equivalent | CPU s | CPU s / mutant |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_module: dict[str, list[float]] = {}
    for name, seconds in (cpu or {}).items():
        by_module.setdefault(name.rpartition(".")[0], []).append(seconds)
    total: Counter = Counter()
    for module, counts in [*sorted(table.items()), ("all", None)]:
        counts = total if counts is None else counts
        if module != "all":
            total.update(counts)
        n = sum(counts.values())
        judged = sum(counts[c] for c in ("killed", "survived", "timeout", "no tests"))
        score = f"{counts['killed'] / judged:.1%}" if judged else "-"
        spent = (
            [s for m, v in by_module.items() if m in table for s in v]
            if module == "all"
            else by_module.get(module, [])
        )
        seconds = f"{sum(spent):.0f} | {sum(spent) / len(spent):.2f}" if spent else "- | -"
        other = n - sum(counts[c] for c in columns)
        cells = [str(counts[c]) for c in columns]
        lines.append(f"| {module} | {n} | " + " | ".join(cells) + f" | {score} | {seconds} |")
        if other:
            lines[-1] += f" ({other} other)"
    return "\n".join(lines) + "\n"


def worst_case(work: Path, own: dict[str, tuple[str, ...]] | None = None) -> dict[str, tuple]:
    """Per module: (mutants, the seconds of the tests mapped to their functions summed over the
    mutants): a run's cost if every mutant survived (a killed one stops at its first failing
    test), from mutmut-stats.json's map and call durations. `own`: count only each module's own
    test files ([tool.strata.mutation.tests]), for stats collected before tests/mutation.py."""
    stats = json.loads((work / "mutmut-stats.json").read_text())
    seconds, reached = stats["duration_by_test"], stats["tests_by_mangled_function_name"]
    found = {}
    for meta in sorted(work.rglob("*.py.meta")):
        module = ".".join(meta.relative_to(work).with_suffix("").with_suffix("").parts)
        names = json.loads(meta.read_text())["exit_code_by_key"]
        total = 0.0
        for name in names:
            tests = reached.get(name.rpartition("__mutmut_")[0], [])
            if own is not None:
                tests = [t for t in tests if t.split("::", 1)[0] in own[module]]
            total += sum(seconds.get(t, 0.0) for t in tests)
        found[module] = (len(names), total)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=ROOT / "mutants")
    parser.add_argument("--equivalent", type=Path)
    parser.add_argument("--survivors", action="store_true", help="list them after the table")
    parser.add_argument(
        "--worst-case",
        action="store_true",
        help="instead: each module's test seconds if no mutant died",
    )
    parser.add_argument(
        "--own-tests",
        action="store_true",
        help="with --worst-case: only the module's own test files",
    )
    args = parser.parse_args(argv)
    if not args.work.is_dir():
        print(f"mutation: error: no {args.work}: run make mutation first", file=sys.stderr)
        return 2
    if args.worst_case:
        own = module_tests(ROOT / "pyproject.toml") if args.own_tests else None
        rows = worst_case(args.work, own)
        print("| module | mutants | worst-case test s |\n|---|---|---|")
        for module, (n, seconds) in [
            *rows.items(),
            ("all", tuple(map(sum, zip(*rows.values(), strict=True)))),
        ]:
            print(f"| {module} | {n} | {seconds:.0f} |")
        return 0
    table, survivors = tally(args.work, equivalents(args.equivalent))
    print(markdown(table, cpu_seconds(args.work)), end="")
    if args.survivors:
        print("\n".join(survivors))
    return 0


if __name__ == "__main__":
    sys.exit(main())
