"""The soak's judgement on made-up series, and a short soak end to end (`make soak` runs 30 minutes)."""

import json
import subprocess
import sys

import pytest

from tests.conftest import child_env
from tests.pipeline.test_local_run import ROOT, SHORT

sys.path.insert(0, str(ROOT / "benchmarks"))
from soak import Sample, verdict


def series(rss, fds=40, processes=3, n=30):
    """n samples, 10 s apart; each figure a constant or a function of the sample's index."""
    at = lambda value, i: value(i) if callable(value) else value  # noqa: E731
    return [
        Sample(10.0 * i, at(rss, i), at(rss, i) * 2, at(fds, i), 20, at(processes, i))
        for i in range(n)
    ]


def test_flat_series_pass_even_with_a_warm_up_climb_and_noise():
    noisy = lambda i: 300 + (i < 5) * 200 * i / 5 + (i % 3) * 10  # noqa: E731  # climbs, then wobbles
    result = verdict(series(noisy, fds=lambda i: 40 + i % 5, processes=lambda i: 3 + i % 7))
    assert result["pass"], result
    assert result["samples_after_warmup"] == 24


@pytest.mark.parametrize(
    "leak, problem",
    [
        ({"rss": lambda i: 500 * (1 + 0.01 * i)}, "resident memory grew"),  # +1% a sample
        ({"rss": 500, "fds": lambda i: 40 + i}, "fds grew"),  # a descriptor a sample
        ({"rss": 500, "processes": lambda i: 3 + i // 2}, "processes grew"),
    ],
)
def test_growth_after_warm_up_fails(leak, problem):
    result = verdict(series(**leak))
    assert not result["pass"] and any(problem in p for p in result["problems"]), result


def test_too_short_a_soak_says_so():
    assert "soak longer" in verdict(series(500, n=3))["problems"][0]


@pytest.mark.system
def test_a_short_soak_samples_stops_cleanly_and_audits_the_books(tmp_path, run_cache):
    out = tmp_path / "soak"
    sets = [item for item in SHORT if item != "--set"] + [f"runtime.cache_dir={run_cache}"]
    argv = [
        sys.executable,
        "benchmarks/soak.py",
        "--minutes",
        "0.1",
        "--interval",
        "0.5",
        "--out",
        str(out),
    ]
    done = subprocess.run(
        [*argv, *(x for item in sets for x in ("--set", item))],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=child_env(),
    )
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("soak: ") and ("PASS" in last or "FAIL" in last), (
        done.stdout + done.stderr
    )
    result = json.loads((out / "soak.json").read_text())
    assert len(result["samples"]) >= 10 and (out / "soak.png").stat().st_size > 10_000
    # 6 s is too short to judge growth; everything else must hold: a clean stop, nothing left
    # running, books that balance against the spill.
    others = [p for p in result["problems"] if " grew " not in p]
    assert not others, others
