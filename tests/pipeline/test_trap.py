"""`python -m pipeline.trap` against an independent implementation of the same model: plain
Python, one seed, one group and one trajectory at a time, its own Algorithm 1 (population std,
eps added to the std, a stratum of one member gets no SAN signal). The escape fractions must
agree within sampling noise, cell by cell."""

import json
import math
import random
from dataclasses import asdict

import numpy as np
import pytest
import torch

from learner.estimators import ESTIMATORS, estimate
from pipeline.experiments.trap import (
    Trap,
    _parser,
    cell,
    comparisons,
    main,
    run,
    softmax,
    wilson,
)
from pipeline.experiments.trap_exact import expected_path


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def pstd(xs: list[float]) -> float:
    """The population std in floats (statistics.pstdev computes it exactly: 60 seeds took 21 s
    with it, 4 s without)."""
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def blend(rewards: list[float], strata: list[int], alpha: float, eps: float = 1e-6) -> list[float]:
    average, std = mean(rewards), pstd(rewards)
    out = []
    for r, s in zip(rewards, strata, strict=True):
        mine = [x for x, t in zip(rewards, strata, strict=True) if t == s]
        gn = (r - average) / (std + eps) if len(rewards) > 1 else 0.0
        san = (r - mean(mine)) / (pstd(mine) + eps) if len(mine) > 1 else 0.0
        out.append(alpha * san + (1 - alpha) * gn)
    return out


def soft(logits: list[float]) -> list[float]:
    top = max(logits)
    z = [math.exp(x - top) for x in logits]
    return [x / sum(z) for x in z]


def draw(rng: random.Random, p: list[float]) -> int:
    u, total = rng.random(), 0.0
    for i, q in enumerate(p):
        total += q
        if u < total:
            return i
    return len(p) - 1


def one_seed(rng: random.Random, m: int, alpha: float, p_guess=0.3, size=8, groups=4, steps=300):
    theta, hops = [0.0, 0.0], [[0.0] * m, [0.0] * m]
    k = size * groups
    for _ in range(steps):
        p_s, p_h = soft(theta), [soft(h) for h in hops]
        d_theta, d_hops = [0.0, 0.0], [[0.0] * m, [0.0] * m]
        for _ in range(groups):
            made = []
            for _ in range(size):
                s = draw(rng, p_s)
                a = [draw(rng, p_h[0]), draw(rng, p_h[1])]
                r = float(a == [0, 0]) if s == 1 else float(rng.random() < p_guess)
                made.append((s, a, r))
            advantages = blend([r for _, _, r in made], [s for s, _, _ in made], alpha)
            for (s, a, _), adv in zip(made, advantages, strict=True):
                for j in range(2):
                    d_theta[j] += adv * ((j == s) - p_s[j])
                if s == 1:
                    for hop in range(2):
                        for j in range(m):
                            d_hops[hop][j] += adv * ((j == a[hop]) - p_h[hop][j])
        theta = [t + d / k for t, d in zip(theta, d_theta, strict=True)]
        hops = [
            [x + d / k for x, d in zip(h, dh, strict=True)]
            for h, dh in zip(hops, d_hops, strict=True)
        ]
    return soft(theta)[1] > 0.9


@pytest.mark.parametrize(("m", "alpha"), [(4, 0.0), (6, 0.8)])
def test_escape_agrees_with_an_independent_implementation(m, alpha):
    seeds = 60
    rng = random.Random(1234)
    theirs = sum(one_seed(rng, m, alpha) for _ in range(seeds)) / seeds
    ours = cell(Trap(chain_choices=m, alpha=alpha), seeds=200, seed=7)
    # two independent proportions: their difference within 3.5 standard errors
    pooled = (theirs * seeds + ours.escape * 200) / (seeds + 200)
    se = math.sqrt(max(pooled * (1 - pooled), 1e-9) * (1 / seeds + 1 / 200))
    assert abs(theirs - ours.escape) <= 3.5 * se + 1e-9, (theirs, ours.escape)


def test_sans_alone_never_moves_the_stratum_choice():
    """Theorem 3: with alpha = 1 every (group, stratum) cell is centred on its own mean, so the
    stratum logits get no gradient: P(chain) stays 0.5 and nobody escapes."""
    found = cell(Trap(chain_choices=3, alpha=1.0, steps=100), seeds=20)
    assert found.escape == 0.0
    assert found.final_reward_mean == pytest.approx(0.5 * 0.3 + 0.5 * 1.0, abs=0.02)


def test_the_command_writes_its_cells_and_refuses_bad_flags(tmp_path, capsys):
    out = tmp_path / "trap.json"
    argv = ["--alphas", "0,1", "--chain-choices", "3", "--steps", "50", "--seeds", "10"]
    assert main([*argv, "--json", str(out)]) == 0
    cells = json.loads(out.read_text())["cells"]
    assert [(c["alpha"], c["chain_choices"]) for c in cells] == [(0.0, 3), (1.0, 3)]
    assert all(c["escape_low"] <= c["escape"] <= c["escape_high"] for c in cells)
    assert (
        main(["--estimator", "grpo", "--chain-choices", "3", "--steps", "20", "--seeds", "5"]) == 0
    )
    assert "grpo" in capsys.readouterr().out
    assert main(["--p-guess", "1.5"]) == 2
    assert capsys.readouterr().err.strip() == "strata: error: --p-guess must be in [0, 1] each"


def test_the_start_share_and_the_hop_speed_act_and_travel_in_the_cells(tmp_path, capsys):
    still = run(Trap(chain_choices=5, start_chain=0.1, steps=0), seeds=4)[0]
    assert still == pytest.approx([0.1] * 4)  # P(chain) starts at p0
    # alpha 1 never moves P(chain) (Theorem 3): only the hops learn, faster at hop speed 4
    slow = cell(Trap(chain_choices=3, alpha=1.0, steps=40, start_chain=0.3), seeds=40)
    fast = cell(Trap(chain_choices=3, alpha=1.0, steps=40, start_chain=0.3, hop_speed=4), seeds=40)
    assert fast.final_reward_mean > slow.final_reward_mean + 0.05
    out = tmp_path / "trap.json"
    argv = ["--alphas", "0", "--chain-choices", "3", "--steps", "5", "--seeds", "4"]
    assert main([*argv, "--start-chain", "0.1,0.5", "--hop-speed", "2", "--json", str(out)]) == 0
    cells = json.loads(out.read_text())["cells"]
    assert [(c["start_chain"], c["hop_speed"]) for c in cells] == [(0.1, 2.0), (0.5, 2.0)]
    assert "p0 0.1  hops x2" in capsys.readouterr().out
    for flag, value in (("--start-chain", "1"), ("--hop-speed", "0")):
        assert main([*argv, flag, value]) == 2
        assert capsys.readouterr().err.strip().startswith(f"strata: error: {flag} must be")


def test_the_exact_start_prints_each_alpha_against_grpo(tmp_path, capsys):
    argv = ["--exact", "--start-chain", "0.1", "--alphas", "0,0.8", "--chain-choices", "5"]
    assert main([*argv, "--json", str(tmp_path / "x.json")]) == 0
    printed = capsys.readouterr().out
    assert "p0 0.1  M 5  alpha 0.8" in printed and "x0.44 GRPO's" in printed
    rows = json.loads((tmp_path / "x.json").read_text())["rows"]
    assert [r["alpha"] for r in rows] == [0.0, 0.8]
    assert main([*argv, "--estimator", "grpo"]) == 2
    capsys.readouterr()
    # every --p-guess's rows, each naming its p_guess
    assert main([*argv, "--p-guess", "0.2,0.3", "--json", str(tmp_path / "y.json")]) == 0
    rows = json.loads((tmp_path / "y.json").read_text())["rows"]
    assert [(r["p_guess"], r["alpha"]) for r in rows] == [
        (0.2, 0),
        (0.2, 0.8),
        (0.3, 0),
        (0.3, 0.8),
    ]


def test_the_softmax_holds_logits_far_from_zero():
    found = softmax(np.array([[1000.0, 0.0], [-1000.0, -1000.0 + math.log(3)]]))
    np.testing.assert_allclose(found, [[1.0, 0.0], [0.25, 0.75]], atol=1e-12)


def test_wilson_interval():
    low, high = wilson(0, 60)
    assert low == 0.0 and 0.05 < high < 0.07
    assert wilson(10, 10)[1] == 1.0
    low, high = wilson(30, 60)
    assert low == pytest.approx(0.3773, abs=1e-3) and high == pytest.approx(0.6227, abs=1e-3)


def test_the_path_is_written_by_the_trap_command(tmp_path, capsys):
    out = tmp_path / "path.json"
    argv = ["--path", str(out), "--alphas", "0,1", "--chain-choices", "5", "--group-size", "4"]
    assert main([*argv, "--steps", "3", "--path-plot", str(tmp_path / "p.png")]) == 0
    found = json.loads(out.read_text())
    assert [len(p) for p in found["paths"]] == [3, 3] and found["settings"]["chain_choices"] == 5
    assert found["paths"][1][-1]["chain"] == pytest.approx(0.5)  # alpha 1: Theorem 3
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    assert "alpha 1  M 5" in capsys.readouterr().out
    assert main(["--path-plot", str(tmp_path / "q.png")]) == 2
    assert main(["--path", str(out), "--estimator", "grpo"]) == 2
    assert "leave --estimator out" in capsys.readouterr().err


REFUSED = [
    (["--p-guess", "-0.1"], "--p-guess must be in [0, 1] each"),
    (["--p-guess", "0.5,1.01"], "--p-guess must be in [0, 1] each"),
    (["--group-size", "8,0"], "--group-size must be >= 1 each"),
    (["--groups", "0"], "--groups must be >= 1"),
    (["--steps", "-1"], "--steps must be >= 0"),
    (["--seeds", "0"], "--seeds must be >= 1"),
    (["--chain-choices", "0"], "--chain-choices must be >= 1 each"),
    (["--alphas", "0,1.01"], "--alphas must be in [0, 1] each"),
    (["--alphas", "-0.5"], "--alphas must be in [0, 1] each"),
    (["--start-chain", "0"], "--start-chain must be in (0, 1) each"),
    (["--hop-speed", "0"], "--hop-speed must be > 0 each"),
    (["--exact-plot", "x.png"], "--exact-plot needs --exact (the expected updates it plots)"),
    (["--path-plot", "x.png"], "--path-plot needs --path (the JSON the paths are written to)"),
    (
        ["--path", "x.json", "--steps", "0"],
        "--path needs --steps >= 1 (a path of no step has no end to report)",
    ),
    (
        ["--path", "x.json", "--estimator", "grpo"],
        "--path follows the stratified blend's alphas: leave --estimator out",
    ),
    (
        ["--exact", "--estimator", "grpo"],
        "--exact compares the stratified blend's alphas: leave --estimator out",
    ),
]


@pytest.mark.parametrize(("argv", "message"), REFUSED)
def test_each_bad_setting_is_refused_in_one_line_naming_it(argv, message, capsys):
    assert main(argv) == 2
    assert capsys.readouterr().err == f"strata: error: {message}\n"


def test_the_settings_at_their_bounds_are_accepted(capsys):
    argv = ["--steps", "0", "--seeds", "1", "--chain-choices", "1", "--group-size", "1"]
    argv += ["--groups", "1", "--p-guess", "0,1", "--alphas", "0,1", "--start-chain", "0.01"]
    assert main([*argv, "--hop-speed", "0.01"]) == 0
    assert capsys.readouterr().out.count("escape") == 4 + 2  # four cells, two comparisons


def test_the_defaults_are_the_settings_the_documents_tables_used():
    """docs/results/trap.md's cells run `python -m pipeline.trap` with these unless a flag says
    otherwise; a changed default changes what its commands print."""
    args = vars(_parser().parse_args([]))
    assert args == {
        "estimator": "stratified",
        "alphas": [0.0, 0.8, 1.0],
        "chain_choices": [4, 6],
        "p_guess": [0.3],
        "group_size": [8],
        "start_chain": [0.5],
        "hop_speed": [1.0],
        "groups": 4,
        "steps": 300,
        "lr": 1.0,
        "seeds": 60,
        "seed": 0,
        "json": None,
        "plot": None,
        "path": None,
        "path_plot": None,
        "exact_plot": None,
        "exact": False,
    }
    parsed = _parser().parse_args(["--groups", "3", "--lr", "0.5", "--chain-choices", "4,6,8"])
    assert (parsed.groups, parsed.lr, parsed.chain_choices) == (3, 0.5, [4, 6, 8])
    with pytest.raises(SystemExit):  # argparse refuses an estimator it does not know
        _parser().parse_args(["--estimator", "nonsense"])


def test_the_command_records_its_settings_and_seeds_its_cells(tmp_path, capsys):
    out, png = tmp_path / "trap.json", tmp_path / "trap.png"
    argv = ["--alphas", "0,1", "--chain-choices", "3", "--steps", "20", "--seeds", "6"]
    argv += ["--seed", "5", "--groups", "2", "--json", str(out), "--plot", str(png)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    found = json.loads(out.read_text())
    settings = found["settings"]
    assert set(settings) == set(vars(_parser().parse_args([]))) - {"json"}
    assert (settings["seed"], settings["groups"], settings["plot"]) == (5, 2, str(png))
    expected = cell(Trap(chain_choices=3, groups=2, steps=20, alpha=1.0), seeds=6, seed=5)
    assert found["cells"][1] == json.loads(json.dumps(asdict(expected)))
    assert "M 3       alpha 0  escape" in printed and "alpha 1 - alpha 0: escape" in printed
    assert png.read_bytes()[:4] == b"\x89PNG"
    # an estimator without alpha: one cell a setting, named by the estimator
    assert (
        main(["--estimator", "grpo", "--chain-choices", "3", "--steps", "5", "--seeds", "2"]) == 0
    )
    lines = [x for x in capsys.readouterr().out.splitlines() if "escape" in x]
    assert len(lines) == 1 and "M 3          grpo  escape" in lines[0]


def test_comparisons_skip_the_baseline_itself_and_cells_without_one():
    cells = [cell(Trap(chain_choices=3, steps=5, alpha=a), seeds=2) for a in (0.0, 0.5, 1.0)]
    assert [d["alpha"] for d in comparisons(cells)] == [0.5, 1.0]
    assert comparisons(cells[1:]) == []  # no alpha-0 cell to compare against


def test_run_and_cell_seed_their_stream_with_0_unless_told():
    """The command's --seed defaults to 0: a run or cell called without a seed is that run."""
    trap = Trap(chain_choices=3, steps=10)
    unseeded, at_0, at_1 = run(trap, 4), run(trap, 4, seed=0), run(trap, 4, seed=1)
    np.testing.assert_array_equal(unseeded[1], at_0[1])
    assert not np.array_equal(unseeded[1], at_1[1])
    assert cell(trap, 4) == cell(trap, 4, seed=0) != cell(trap, 4, seed=1)


def test_a_cell_summarises_the_run_at_its_seed_and_names_its_settings():
    trap = Trap(chain_choices=3, p_guess=0.2, group_size=4, steps=30, estimator="grpo")
    p_chain, reward = run(trap, 8, seed=3)
    found = cell(trap, 8, seed=3)
    assert found.escape == (p_chain > 0.9).mean()
    assert (found.final_reward_mean, found.final_reward_std) == (reward.mean(), reward.std())
    assert found.final_reward_mean != cell(trap, 8, seed=0).final_reward_mean
    settings = (found.estimator, found.alpha, found.chain_choices, found.p_guess)
    assert (*settings, found.group_size, found.seeds) == ("grpo", None, 3, 0.2, 4, 8)


def test_a_trap_one_choice_deep_is_no_trap_every_seed_escapes():
    """M 1: each hop has one choice, so a chain always pays 1, more than a guess's 0.3."""
    found = cell(Trap(chain_choices=1, alpha=0.0, steps=60), seeds=10)
    assert found.escape == 1.0
    assert found.final_reward_mean > 0.9


def replica(trap: Trap, seed: int) -> tuple[float, float]:
    """One seed of `run` written out trajectory by trajectory, drawing the same numbers from the
    same stream (the strata, then the first hops, the second hops, the guesses): the module
    doc's REINFORCE step on theta and on both hops' logits, hops at `hop_speed` times lr."""
    rng = np.random.default_rng(seed)
    m, k = trap.chain_choices, trap.groups * trap.group_size
    theta = [0.0, math.log(trap.start_chain / (1 - trap.start_chain))]
    hops = [[0.0] * m, [0.0] * m]
    params = {p: getattr(trap, p) for p in ESTIMATORS[trap.estimator].params}

    def pick(u: float, p: list[float]) -> int:
        total = 0.0
        for i, q in enumerate(p):
            total += q
            if u <= total:
                return i
        return len(p) - 1

    for _ in range(trap.steps):
        p_s, p_h = soft(theta), [soft(h) for h in hops]
        strata = [int(u < p_s[1]) for u in rng.random(k)]
        firsts = [pick(u, p_h[0]) for u in rng.random(k)]
        seconds = [pick(u, p_h[1]) for u in rng.random(k)]
        guessed = [u < trap.p_guess for u in rng.random(k)]
        rewards = [
            float(a == b == 0) if s == 1 else float(g)
            for s, a, b, g in zip(strata, firsts, seconds, guessed, strict=True)
        ]
        advantages = estimate(
            trap.estimator,
            torch.tensor(rewards, dtype=torch.float64),
            torch.tensor([i // trap.group_size for i in range(k)]),
            torch.tensor(strata),
            **params,
        ).advantages.tolist()
        d_theta, d_hops = [0.0, 0.0], [[0.0] * m, [0.0] * m]
        for s, a, b, adv in zip(strata, firsts, seconds, advantages, strict=True):
            for j in range(2):
                d_theta[j] += adv * ((j == s) - p_s[j])
            if s == 1:
                for hop, chosen in enumerate((a, b)):
                    for j in range(m):
                        d_hops[hop][j] += adv * ((j == chosen) - p_h[hop][j])
        theta = [t + trap.lr * d / k for t, d in zip(theta, d_theta, strict=True)]
        step = trap.lr * trap.hop_speed / k
        hops = [
            [x + step * d for x, d in zip(h, dh, strict=True)]
            for h, dh in zip(hops, d_hops, strict=True)
        ]
    strata, first, second = soft(theta), soft(hops[0]), soft(hops[1])
    return strata[1], strata[0] * trap.p_guess + strata[1] * first[0] * second[0]


@pytest.mark.parametrize(
    "trap",
    [
        Trap(chain_choices=3, group_size=4, groups=2, steps=6, lr=2.0, start_chain=0.3),
        Trap(chain_choices=4, groups=2, steps=6, lr=2.0, alpha=0.0, hop_speed=3.0),
        # the median centres mc_grpo's advantages: a seed's need not sum to 0
        Trap(chain_choices=3, group_size=5, groups=2, steps=6, lr=2.0, estimator="mc_grpo"),
    ],
)
def test_run_is_the_reinforce_step_written_out_draw_for_draw(trap):
    p_chain, reward = run(trap, seeds=1, seed=11)
    theirs = replica(trap, seed=11)
    assert (p_chain[0], reward[0]) == (pytest.approx(theirs[0]), pytest.approx(theirs[1]))
    assert theirs[0] != pytest.approx(trap.start_chain)  # the stratum logits moved


def test_the_softmax_takes_the_last_axis_of_a_vector_too():
    found = softmax(np.array([0.0, math.log(3)]))
    np.testing.assert_allclose(found, [0.25, 0.75], atol=1e-12)


def test_the_path_prints_each_alpha_after_its_last_step_and_records_its_settings(tmp_path, capsys):
    out = tmp_path / "path.json"
    argv = ["--path", str(out), "--alphas", "0,0.5", "--chain-choices", "4", "--p-guess", "0.2"]
    argv += ["--group-size", "4", "--start-chain", "0.3", "--hop-speed", "3", "--lr", "2"]
    assert main([*argv, "--steps", "4"]) == 0
    found = json.loads(out.read_text())
    assert found["settings"] == {
        "chain_choices": 4,
        "p_guess": 0.2,
        "group_size": 4,
        "start_chain": 0.3,
        "hop_speed": 3.0,
        "steps": 4,
        "lr": 2.0,
    }
    paths = [
        expected_path(a, 4, 0.2, 4, 4, lr=2.0, start_chain=0.3, hop_speed=3.0) for a in (0, 0.5)
    ]
    assert found["paths"] == paths
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    for line, alpha, rows in zip(lines, ("0", "0.5"), paths, strict=True):
        end = rows[-1]
        assert line == (
            f"alpha {alpha}  M 4  p_guess 0.2  group 4: after 4 steps P(chain) {end['chain']:.3f}, "
            f"E[reward] {end['expected_reward']:.3f}, cosine to the true gradient "
            f"{end['cosine']:.3f}"
        )
    assert main([*argv, "--steps", "1"]) == 0  # a path of one row: its first is its last
    assert len(json.loads(out.read_text())["paths"][1]) == 1
