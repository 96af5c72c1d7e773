"""docs/results/trap.md's tables from the trap's JSON (pipeline/experiments/trap_tables.py), the
comparisons `python -m pipeline.trap` prints, and the intervals and tests they use
(pipeline/experiments/proportions.py)."""

import json
import math

import pytest

from pipeline.experiments.proportions import clopper_pearson, fisher_p, newcombe, wilson
from pipeline.experiments.trap import main as trap_main
from pipeline.experiments.trap_tables import main


def cell(alpha, m, escaped, seeds=10, estimator="stratified"):
    low, high = wilson(escaped, seeds)
    return {
        "estimator": estimator,
        "alpha": alpha,
        "chain_choices": m,
        "p_guess": 0.3,
        "group_size": 8,
        "seeds": seeds,
        "escape": escaped / seeds,
        "escape_low": low,
        "escape_high": high,
        "final_reward_mean": 0.5,
        "final_reward_std": 0.1,
    }


@pytest.fixture
def small(tmp_path):
    path = tmp_path / "trap.json"
    cells = [cell(0.0, 4, 3), cell(0.8, 4, 10), cell(0.0, 6, 0), cell(0.8, 6, 0)]
    path.write_text(json.dumps({"settings": {}, "cells": cells}))
    return path


def test_the_comparison_table_is_written_from_the_json(small, capsys):
    assert main(["compare", str(small), "--alpha", "0.8"]) == 0
    # 10/10 against 3/10: difference 0.70; Wilson (0.722, 1) and (0.108, 0.603), so Newcombe's
    # low end 0.70 - hypot(1 - 0.722, 0.603 - 0.3) = 0.29; Fisher's p 2 * 286 / 184756 = 0.0031
    assert capsys.readouterr().out == (
        "| M | escape α 0.8 − α 0 | 95% interval (Newcombe) | Fisher exact p |\n"
        "|---|---|---|---|\n"
        "| 4 | +0.70 | [+0.29, +0.89] | 3.1e-03 |\n"
        "| 6 | +0.00 | [-0.28, +0.28] | 1.0e+00 |\n"
    )
    assert main(["map", str(small)]) == 0
    assert capsys.readouterr().out == (
        "| M \\ α | 0 | 0.8 |\n|---|---|---|\n"
        "| 4 | 0.30 [0.11, 0.60] | 1.00 [0.72, 1.00] |\n"
        "| 6 | 0.00 [0.00, 0.28] | 0.00 [0.00, 0.28] |\n"
    )


def test_a_missing_or_foreign_json_is_one_line(tmp_path, capsys):
    assert main(["map", str(tmp_path / "nothing.json")]) == 2
    (tmp_path / "path.json").write_text(json.dumps({"paths": []}))
    assert main(["compare", str(tmp_path / "path.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(e.startswith("strata: error: ") for e in err)


def test_newcombes_interval_is_the_published_one():
    # Newcombe (1998), Table II, method 10: 56/70 against 48/80
    low, high = newcombe(56, 70, 48, 80)
    assert (low, high) == pytest.approx((0.0524, 0.3339), abs=5e-5)
    low, high = newcombe(0, 10, 10, 10)
    assert -1 <= low < high < 0
    with pytest.raises(ValueError, match="at least one trial"):
        newcombe(0, 0, 1, 1)


def test_the_clopper_pearson_interval_is_the_beta_quantiles():
    """[Beta(0.025; x, n - x + 1), Beta(0.975; x + 1, n - x)], ends 0 and 1 at 0 and n."""
    from scipy import stats as sps

    assert clopper_pearson(0, 12) == pytest.approx((0.0, 1 - 0.025 ** (1 / 12)))
    assert clopper_pearson(8, 8) == pytest.approx((0.025 ** (1 / 8), 1.0))
    low, high = clopper_pearson(3, 10)
    assert (low, high) == pytest.approx(
        (sps.beta.ppf(0.025, 3, 8), sps.beta.ppf(0.975, 4, 7)), rel=1e-9
    )


def test_fishers_p_is_the_hypergeometric_tails():
    assert fisher_p(3, 3, 0, 3) == pytest.approx(2 / math.comb(6, 3))
    # 10/10 against 3/10: the tables as or more extreme are 10-3 and 3-10 (13 successes)
    assert fisher_p(10, 10, 3, 10) == pytest.approx(2 * math.comb(10, 3) / math.comb(20, 13))
    assert fisher_p(5, 10, 5, 10) == 1.0


def test_the_trap_prints_every_alpha_against_alpha_0_and_draws_the_exact_plot(tmp_path, capsys):
    args = ["--alphas", "0,0.8", "--chain-choices", "3", "--seeds", "8", "--steps", "3"]
    assert trap_main([*args, "--json", str(tmp_path / "t.json")]) == 0
    out = capsys.readouterr().out
    [line] = [x for x in out.splitlines() if "alpha 0.8 - alpha 0" in x]
    assert "(Newcombe 95%), Fisher exact p" in line
    png = tmp_path / "exact.png"
    exact = ["--exact", "--alphas", "0,1", "--chain-choices", "3", "--group-size", "2"]
    assert trap_main([*exact, "--exact-plot", str(png)]) == 0
    assert png.read_bytes().startswith(b"\x89PNG")
    assert trap_main(["--exact-plot", str(png)]) == 2
    assert "--exact-plot needs --exact" in capsys.readouterr().err
