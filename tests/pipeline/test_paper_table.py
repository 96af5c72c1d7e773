"""The paper's tables (arXiv 2510.06214, Tables 1 and 2) filled from an evaluation's rows."""

from __future__ import annotations

import pytest

from pipeline.evaluation.heldout import Row
from pipeline.evaluation.paper_table import (
    GAIA_REFERENCE,
    QA_COLUMNS,
    QA_REFERENCE,
    paper_table,
)


def row(name: str, accuracy: float, questions: int, tools: bool = True) -> Row:
    return Row(name, tools, questions, 1, accuracy, None, 1.0, 10.0, 0.0)


def test_the_seven_benchmarks_in_table_1s_order_with_the_quoted_rows():
    # written out of order, with a no-tools row that must not be read
    rows = [row(s, 0.1 * (i + 1), 10 + i) for i, (s, _) in reversed(list(enumerate(QA_COLUMNS)))]
    rows += [row("nq", 0.9, 10, tools=False), row("all", 0.5, 91)]
    table = paper_table(rows, "/models/Qwen2.5-3B/")
    assert table is not None and table.kind == "qa"
    assert [c.em for c in table.cells] == pytest.approx([10, 20, 30, 40, 50, 60, 70])
    assert [c.n for c in table.cells] == list(range(10, 17))
    assert table.average.em == pytest.approx(40.0)  # the mean of the columns, not of questions
    text = table.markdown()
    assert (
        "| method | NQ | TriviaQA | PopQA | HotpotQA | 2Wiki | MuSiQue | Bamboogle | Avg. |" in text
    )
    assert "| this evaluation (Qwen2.5-3B) | 10.0 (n=10) |" in text
    assert (
        "| Stratified GRPO (paper, Table 1) | 45.9 | 61.4 | 43.0 | 40.8 | 39.9 | 17.7 | 42.7 | 41.6 |"
        in text
    )
    assert table.absent is None
    instruct = paper_table(rows, "Qwen2.5-3B-Instruct")
    assert instruct.references == QA_REFERENCE["qwen2.5-3b-instruct"]


def test_a_benchmark_missing_leaves_its_column_and_the_average_empty():
    table = paper_table([row("nq", 0.5, 4), row("bamboogle", 0.25, 4)], "Qwen2.5-3B")
    assert table.cells[1].em is None and table.average.em is None
    assert "| this evaluation (Qwen2.5-3B) | 50.0 (n=4) | — |" in table.markdown()


def test_a_model_the_paper_did_not_train_has_its_reference_rows_absent_with_a_reason():
    table = paper_table([row("nq", 0.5, 4)], "tiny policy")
    assert table.references == ()
    assert "Paper rows absent: the paper's Table 1 has rows for Qwen2.5-3B" in table.markdown()
    assert "(paper," not in table.markdown()


def test_gaia_by_level_averaged_over_questions_as_table_2():
    rows = [row("level 1", 0.5, 4), row("level 2", 0.25, 8), row("level 3", 0.0, 4)]
    table = paper_table(rows, "/models/Qwen3-8B")
    assert table.kind == "gaia" and table.columns() == ["L1", "L2", "L3", "Avg."]
    assert table.average.em == pytest.approx(100 * 4 / 16) and table.average.n == 16
    assert "| GRPO (paper, Table 2) | 48.7 | 32.7 | 16.7 | 36.9 |" in table.markdown()
    assert table.markdown().startswith("Accuracy (the GAIA scorer) x100 in the layout of arXiv")


def test_other_data_gets_no_paper_table():
    assert paper_table([row("minigaia_l1", 0.5, 4), row("all", 0.5, 4)], "Qwen2.5-3B") is None


def test_the_quoted_averages_are_the_papers_column_means():
    """A typo in a quoted figure shows here: Table 1's Avg. is the mean of its seven columns."""
    for references in QA_REFERENCE.values():
        for _, figures, average in references:
            assert sum(figures) / len(figures) == pytest.approx(average, abs=0.051)
    # Table 2's Avg. is reproduced by weighing the levels 39, 52, 12 (GAIA validation's 103
    # text-only questions): it is an average over questions
    for _, (l1, l2, l3), average in GAIA_REFERENCE["qwen3-8b"]:
        assert (39 * l1 + 52 * l2 + 12 * l3) / 103 == pytest.approx(average, abs=0.051)
