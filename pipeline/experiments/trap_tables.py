"""docs/results/trap.md's tables, written from the trap's JSON files (pipeline/experiments/trap.py,
trap_exact.py) as Markdown: no figure there is typed by hand.

    python -m pipeline.experiments.trap_tables map docs/results/trap.json --group-size 8
    python -m pipeline.experiments.trap_tables compare docs/results/trap.json --alpha 0.8
    python -m pipeline.experiments.trap_tables estimators docs/results/trap-grpo.json \\
        docs/results/trap-rloo.json docs/results/trap-dr_grpo.json docs/results/trap.json --alpha 0.8
    python -m pipeline.experiments.trap_tables exact docs/results/trap-exact.json
    python -m pipeline.experiments.trap_tables path docs/results/trap-path.json

Each picks the cells of one `--p-guess`, `--group-size`, `--start-chain` and `--hop-speed` (the
defaults: 0.3, 8, 0.5, 1).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pipeline.experiments.trap import Cell, comparisons


def load_cells(path: str | Path) -> list[Cell]:
    """The cells of a `python -m pipeline.trap --json` file."""
    return [Cell(**c) for c in json.loads(Path(path).read_text())["cells"]]


def _panel(cells: list[Cell], p_guess: float, group_size: int, start: float, speed: float):
    return [
        c
        for c in cells
        if (c.p_guess, c.group_size, c.start_chain, c.hop_speed)
        == (p_guess, group_size, start, speed)
    ]


def _escape(c: Cell) -> str:
    return f"{c.escape:.2f} [{c.escape_low:.2f}, {c.escape_high:.2f}]"


def _rows(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def map_table(
    cells: list[Cell], p_guess: float = 0.3, group_size: int = 8, start=0.5, speed=1.0
) -> str:
    """Escape fraction [Wilson 95%] by trap depth M (rows) and alpha (columns)."""
    mine = _panel(cells, p_guess, group_size, start, speed)
    alphas = sorted({c.alpha for c in mine})
    depths = sorted({c.chain_choices for c in mine})
    at = {(c.chain_choices, c.alpha): c for c in mine}
    return _rows(
        ["M \\ α", *(f"{a:g}" for a in alphas)],
        [[str(m), *(_escape(at[m, a]) for a in alphas)] for m in depths],
    )


def compare_table(
    cells: list[Cell],
    alpha: float,
    against: float = 0.0,
    p_guess: float = 0.3,
    group_size: int = 8,
    start=0.5,
    speed=1.0,
) -> str:
    """Alpha against `against` by M: the difference, its Newcombe 95% interval, Fisher's p."""
    mine = [
        d
        for d in comparisons(_panel(cells, p_guess, group_size, start, speed), against)
        if d["alpha"] == alpha
    ]
    return _rows(
        ["M", f"escape α {alpha:g} − α {against:g}", "95% interval (Newcombe)", "Fisher exact p"],
        [
            [
                str(d["chain_choices"]),
                f"{d['difference']:+.2f}",
                f"[{d['newcombe_low']:+.2f}, {d['newcombe_high']:+.2f}]",
                f"{d['fisher_p']:.1e}",
            ]
            for d in sorted(mine, key=lambda d: d["chain_choices"])
        ],
    )


def estimators_table(
    files: list[list[Cell]],
    alpha: float,
    p_guess: float = 0.3,
    group_size: int = 8,
    start=0.5,
    speed=1.0,
) -> str:
    """One column per file: its estimator's escape fraction by M (a stratified file's cells of
    `alpha`)."""
    columns = []
    for cells in files:
        mine = [
            c
            for c in _panel(cells, p_guess, group_size, start, speed)
            if c.alpha is None or c.alpha == alpha
        ]
        name = mine[0].estimator + (f" α {alpha:g}" if mine[0].alpha is not None else "")
        columns.append((name, {c.chain_choices: c for c in mine}))
    depths = sorted(set.intersection(*(set(by) for _, by in columns)))
    return _rows(
        ["M", *(name for name, _ in columns)],
        [[str(m), *(_escape(by[m]) for _, by in columns)] for m in depths],
    )


def exact_table(rows: list[dict]) -> str:
    """`python -m pipeline.trap --exact --json` rows: each alpha's expected updates at the start
    against the true gradient's."""
    return _rows(
        ["M", "α", "stratum update", "true dJ/dθ_chain", "hop update", "true dJ/dh"],
        [
            [
                str(r["chain_choices"]),
                f"{r['alpha']:g}",
                f"{r['stratum']:+.4f}",
                f"{r['true_stratum']:+.4f}",
                f"{r['hop']:+.4f}",
                f"{r['true_hop']:+.4f}",
            ]
            for r in rows
        ],
    )


def path_table(paths: list[list[dict]], at: tuple[int, ...] = (25, 100, 299)) -> str:
    """`python -m pipeline.trap --path` paths: P(chain) along each alpha's mean-field path, its
    expected reward at the end, the stratum update over the true gradient's and the cosine to
    the true gradient, start and end."""
    names = {0.0: "0 (GRPO)", 1.0: "1 (SAN)"}

    def ratio(r: dict) -> str:
        return "0" if r["stratum_ratio"] == 0 else f"{r['stratum_ratio']:.2f}"

    rows = []
    for path in paths:
        a, first, last = path[0]["alpha"], path[0], path[-1]
        ratios = (
            "0 throughout"
            if all(abs(r["stratum_ratio"]) < 1e-9 for r in path)
            else f"{ratio(first)} → {ratio(last)}"
        )
        rows.append(
            [
                names.get(a, f"{a:g}"),
                " / ".join(f"{path[s]['chain']:.3f}" for s in at),
                f"{path[at[-1]]['expected_reward']:.3f}",
                ratios,
                f"{first['cosine']:.3f} → {last['cosine']:.3f}",
            ]
        )
    return _rows(
        [
            "α",
            "P(chain) at " + " / ".join(map(str, at)),
            f"expected reward at {at[-1]}",
            "stratum update / true, start → end",
            "cosine to ∇J, start → end",
        ],
        rows,
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pipeline.experiments.trap_tables", description=__doc__.split("\n")[0]
    )
    p.add_argument("table", choices=["map", "compare", "estimators", "exact", "path"])
    p.add_argument("files", nargs="+", help="the JSON files (estimators: one column each)")
    p.add_argument("--alpha", type=float, default=0.8, help="compare, estimators: the blend's")
    p.add_argument("--against", type=float, default=0.0, help="compare: the baseline alpha")
    p.add_argument("--p-guess", type=float, default=0.3)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--start-chain", type=float, default=0.5)
    p.add_argument("--hop-speed", type=float, default=1.0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    panel = (args.p_guess, args.group_size, args.start_chain, args.hop_speed)
    try:
        loaded = [json.loads(Path(f).read_text()) for f in args.files]
        if args.table == "exact":
            text = exact_table([r for d in loaded for r in d["rows"]])
        elif args.table == "path":
            text = path_table([p for d in loaded for p in d["paths"]])
        else:
            cells = [[Cell(**c) for c in d["cells"]] for d in loaded]
            if args.table == "map":
                text = map_table(cells[0], *panel)
            elif args.table == "compare":
                text = compare_table(cells[0], args.alpha, args.against, *panel)
            else:
                text = estimators_table(cells, args.alpha, *panel)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as error:
        print(
            f"strata: error: {args.table} table from {', '.join(args.files)}: {error!r} "
            "(give the JSON that python -m pipeline.trap wrote for it)",
            file=sys.stderr,
        )
        return 2
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
