"""An evaluation's accuracy laid out as the paper's tables, beside the paper's own rows.

Factual QA (arXiv 2510.06214, Table 1): exact match (x100) on NQ, TriviaQA, PopQA, HotpotQA, 2Wiki,
MuSiQue, Bamboogle and their average (the mean of the seven columns, as the paper's Avg. is),
with the number of questions of each. Deep research (Table 2): GAIA by level, L1, L2, L3, and the
average over every question (the paper's Avg. is that: 49.5 for Stratified GRPO is no column
mean). The paper's rows for the evaluated model are quoted as printed; a model the paper did not
train gets its reference rows marked absent with the reason, never figures of another model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePath

QA_COLUMNS: tuple[tuple[str, str], ...] = (
    ("nq", "NQ"),
    ("triviaqa", "TriviaQA"),
    ("popqa", "PopQA"),
    ("hotpotqa", "HotpotQA"),
    ("2wikimultihopqa", "2Wiki"),
    ("musique", "MuSiQue"),
    ("bamboogle", "Bamboogle"),
)
"""(data_source, column) in Table 1's order."""
GAIA_COLUMNS: tuple[tuple[str, str], ...] = (
    ("level 1", "L1"),
    ("level 2", "L2"),
    ("level 3", "L3"),
)

# Quoted from arXiv 2510.06214: (method, the columns in order, Avg.). Table 1 (seven QA benchmarks,
# also Table 3's GRPO and Stratified GRPO rows) and Table 2 (GAIA, "Tool Integrated Reasoning
# (Qwen3-8B)" / "RL-based Method").
QA_REFERENCE: dict[str, tuple[tuple[str, tuple[float, ...], float], ...]] = {
    "qwen2.5-3b": (
        ("GRPO", (45.2, 61.2, 43.8, 32.6, 29.7, 7.8, 12.9), 33.3),
        ("Stratified GRPO", (45.9, 61.4, 43.0, 40.8, 39.9, 17.7, 42.7), 41.6),
    ),
    "qwen2.5-3b-instruct": (
        ("GRPO", (33.4, 52.9, 36.7, 26.5, 27.4, 6.4, 21.0), 29.2),
        ("Stratified GRPO", (44.5, 60.9, 44.3, 41.0, 37.3, 16.9, 38.7), 40.5),
    ),
}
GAIA_REFERENCE: dict[str, tuple[tuple[str, tuple[float, ...], float], ...]] = {
    "qwen3-8b": (
        ("Qwen3-8B (no RL)", (28.1, 15.4, 16.7), 20.4),
        ("GRPO", (48.7, 32.7, 16.7), 36.9),
        ("Stratified GRPO", (61.5, 44.2, 33.3), 49.5),
    ),
}
ALIASES = {"qwen2.5-3b-base": "qwen2.5-3b"}
PAPER_MODELS = {"qa": "Qwen2.5-3B (Base) and Qwen2.5-3B-Instruct", "gaia": "Qwen3-8B"}


@dataclass(frozen=True)
class Cell:
    em: float | None  # x100; None: no question of this column was evaluated
    n: int


@dataclass(frozen=True)
class PaperTable:
    kind: str  # "qa" (Table 1) or "gaia" (Table 2)
    source: str  # which table of the paper the layout and the references are
    model: str
    cells: tuple[Cell, ...]
    average: Cell
    references: tuple[tuple[str, tuple[float, ...], float], ...]
    absent: str | None  # why there are no reference rows

    def columns(self) -> list[str]:
        return [c for _, c in (QA_COLUMNS if self.kind == "qa" else GAIA_COLUMNS)] + ["Avg."]

    def markdown(self) -> str:
        head = ["method", *self.columns()]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        ours = [_cell(c) for c in (*self.cells, self.average)]
        lines.append("| " + " | ".join([f"this evaluation ({self.model})", *ours]) + " |")
        for method, figures, avg in self.references:
            cells = [f"{v:.1f}" for v in (*figures, avg)]
            lines.append(f"| {method} (paper, {self.source}) | " + " | ".join(cells) + " |")
        measure = "Exact match" if self.kind == "qa" else "Accuracy (the GAIA scorer)"
        text = f"{measure} x100 in the layout of arXiv 2510.06214, {self.source}.\n\n"
        text += "\n".join(lines) + "\n"
        if self.absent:
            text += f"\nPaper rows absent: {self.absent}\n"
        return text

    def record(self) -> dict:
        return {
            "layout": f"arXiv 2510.06214, {self.source}",
            "model": self.model,
            "columns": self.columns(),
            "this_evaluation": [{"em": c.em, "n": c.n} for c in (*self.cells, self.average)],
            "paper_rows": [{"method": m, "figures": [*f, a]} for m, f, a in self.references],
            "paper_rows_absent": self.absent,
        }


def _cell(c: Cell) -> str:
    return "—" if c.em is None else f"{c.em:.1f} (n={c.n})"


def _model_key(model_path: str) -> str:
    name = PurePath(model_path.rstrip("/")).name.lower()
    return ALIASES.get(name, name)


def paper_table(rows: Sequence, model_path: str) -> PaperTable | None:
    """The paper's table for an evaluation's `rows` (`heldout.Row`: name, tools, questions,
    accuracy), from its with-tools rows: Table 1's when any of the seven benchmarks was
    evaluated, Table 2's when any GAIA level was; None when neither."""
    ours = {r.name: r for r in rows if r.tools}
    model = PurePath(model_path.rstrip("/")).name
    key = _model_key(model_path)
    for kind, columns, references, source in (
        ("qa", QA_COLUMNS, QA_REFERENCE, "Table 1"),
        ("gaia", GAIA_COLUMNS, GAIA_REFERENCE, "Table 2"),
    ):
        if not any(name in ours for name, _ in columns):
            continue
        cells = tuple(
            Cell(100 * ours[name].accuracy, ours[name].questions) if name in ours else Cell(None, 0)
            for name, _ in columns
        )
        found = [c for c in cells if c.em is not None]
        if kind == "qa":  # the paper's Avg.: the mean of its seven columns
            complete = len(found) == len(cells)
            average = Cell(
                sum(c.em for c in found) / len(found) if complete else None,
                sum(c.n for c in found),
            )
        else:  # Table 2's Avg.: over every question of the three levels
            n = sum(c.n for c in found)
            average = Cell(sum(c.em * c.n for c in found) / n if n else None, n)
        quoted = references.get(key, ())
        absent = None
        if not quoted:
            absent = f"the paper's {source} has rows for {PAPER_MODELS[kind]} only, not {model}"
        return PaperTable(kind, source, model, cells, average, quoted, absent)
    return None
