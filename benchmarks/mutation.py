"""`make mutation`'s table: mutmut's results per module, from its work directory (mutants/).

mutmut (pinned in the dev extra, configured in pyproject.toml's [tool.mutmut]) keeps each mutated
file's results in mutants/<path>.meta: an exit code per mutant (1 or 3 killed, 0 survived, 36 or
a SIGXCPU code timed out, None not run yet; mutmut.stats.status_by_exit_code). A survivor listed
in the equivalence file (`mutant_name  reason`, one a line, `#` comments) counts as equivalent:
no test can tell it from the original.

    python benchmarks/mutation.py [--equivalent docs/results/mutation-equivalent.txt] [--survivors]

Prints a Markdown table: module, mutants, killed, survived, equivalent, timeout, no test reached,
not run, and the killed share of the non-equivalent mutants that ran.
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


def markdown(table: dict[str, Counter]) -> str:
    # "no tests": no test of the module's own files ([tool.strata.mutation.tests]) reached the
    # mutated function, so no test ran; "not checked": the run stopped before the mutant.
    columns = ("killed", "survived", "equivalent", "timeout", "no tests", "not checked")
    lines = [
        "| module | mutants | killed | survived | equivalent | timeout | no test reached | not run | killed / non-equivalent run |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    total: Counter = Counter()
    for module, counts in [*sorted(table.items()), ("all", None)]:
        counts = total if counts is None else counts
        if module != "all":
            total.update(counts)
        n = sum(counts.values())
        ran = counts["killed"] + counts["survived"] + counts["timeout"]
        score = f"{counts['killed'] / ran:.1%}" if ran else "-"
        other = n - sum(counts[c] for c in columns)
        cells = [str(counts[c]) for c in columns]
        lines.append(f"| {module} | {n} | " + " | ".join(cells) + f" | {score} |")
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
    print(markdown(table), end="")
    if args.survivors:
        print("\n".join(survivors))
    return 0


if __name__ == "__main__":
    sys.exit(main())
