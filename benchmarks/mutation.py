"""`make mutation`'s table: mutmut's results per module, from its work directory (mutants/).

mutmut (pinned in the dev extra, configured in pyproject.toml's [tool.mutmut]) keeps each mutated
file's results in mutants/<path>.meta: an exit code per mutant (1 or 3 killed, 0 survived, 36 or
a SIGXCPU code timed out, None not run yet; mutmut.stats.status_by_exit_code). A survivor listed
in the equivalence file (`mutant_name  reason`, one a line, `#` comments) counts as equivalent:
no test can tell it from the original.

    python benchmarks/mutation.py [--equivalent docs/results/mutation-equivalent.txt] [--survivors]

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=ROOT / "mutants")
    parser.add_argument("--equivalent", type=Path)
    parser.add_argument("--survivors", action="store_true", help="list them after the table")
    args = parser.parse_args(argv)
    if not args.work.is_dir():
        print(f"mutation: error: no {args.work}: run make mutation first", file=sys.stderr)
        return 2
    table, survivors = tally(args.work, equivalents(args.equivalent))
    print(markdown(table, cpu_seconds(args.work)), end="")
    if args.survivors:
        print("\n".join(survivors))
    return 0


if __name__ == "__main__":
    sys.exit(main())
