"""The fused C loops of the advantages (learner/native.py) against their torch path, bit for bit."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from learner import native
from learner.advantages import stratified_advantages, stratified_advantages_with_stats
from learner.estimators import ESTIMATORS, estimate

ROOT = Path(__file__).resolve().parents[2]

needs_library = pytest.mark.skipif(
    native.library() is None, reason="no C compiler here: the torch path is all there is"
)


def batch(n, groups, strata, dtype, seed=0, grouped=False):
    gen = torch.Generator().manual_seed(seed)
    g = torch.randint(0, groups, (n,), generator=gen)
    s = torch.randint(0, strata, (n,), generator=gen)
    if grouped:
        g, _ = torch.sort(g)
    # rewards with ties (all-equal cells) and without
    rewards = torch.where(
        torch.rand(n, generator=gen) < 0.5,
        torch.randint(0, 2, (n,), generator=gen).to(dtype) * 0.1,
        torch.rand(n, generator=gen, dtype=torch.float64).to(dtype),
    )
    return rewards, g, s


@needs_library
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize(
    "n, groups, strata, grouped",
    [
        (0, 1, 1, False),
        (7, 3, 2, False),
        (1000, 100, 5, False),  # one bucket of cells
        (50_000, 6_000, 5, False),  # 30k cells: several buckets of 4096
        (50_000, 6_000, 5, True),  # each group's members side by side, as the learner's batches
    ],
)
@pytest.mark.parametrize("eps", [1e-6, 0.0])
def test_c_loops_give_the_torch_paths_bits(n, groups, strata, grouped, dtype, eps):
    rewards, g, s = batch(n, groups, strata, dtype, grouped=grouped)
    fused = stratified_advantages(rewards, g, s, alpha=0.6, eps=eps)
    with native.torch_only():
        plain = stratified_advantages(rewards, g, s, alpha=0.6, eps=eps)
    assert fused.dtype == plain.dtype == dtype
    assert torch.equal(fused, plain)


@needs_library
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cell_sums_match_bincount(dtype):
    rewards, g, s = batch(40_000, 5_000, 5, dtype, seed=3)
    cells = (s * 5_000 + g).to(torch.int32)
    count, head, tail, squares = native.cell_sums(rewards, cells, 25_000)
    x = rewards.to(torch.float64)
    assert torch.equal(count, torch.bincount(cells, minlength=25_000))
    assert torch.equal(squares, torch.bincount(cells, weights=x * x, minlength=25_000))
    if dtype == torch.float32:
        assert tail is None and torch.equal(
            head, torch.bincount(cells, weights=x, minlength=25_000)
        )
    else:
        first = x.to(torch.float32).to(torch.float64)
        assert torch.equal(head, torch.bincount(cells, weights=first, minlength=25_000))
        assert torch.equal(tail, torch.bincount(cells, weights=x - first, minlength=25_000))


@needs_library
def test_ids_out_of_range_are_refused_not_written():
    rewards = torch.ones(4)
    for bad in ([0, 1, 5, 2], [0, -1, 1, 1]):
        cells = torch.tensor(bad, dtype=torch.int32)
        with pytest.raises(IndexError, match="position 2" if 5 in bad else "position 1"):
            native.cell_sums(rewards, cells, 5)
        with pytest.raises(IndexError, match="out of range"):
            native.affine(rewards, cells, torch.zeros(5, 3))


@needs_library  # without the library every call here is None whatever it is given
def test_what_the_c_loops_do_not_take_goes_to_torch():
    rewards, cells = torch.ones(6), torch.zeros(6, dtype=torch.int32)
    assert native.cell_sums(rewards, cells.long(), 1) is None  # int64 ids
    assert native.cell_sums(rewards.half(), cells, 1) is None
    assert native.cell_sums(torch.ones(12)[::2], cells, 1) is None  # not contiguous
    assert native.affine(rewards, cells, torch.zeros(1, 3, dtype=torch.float64)) is None
    # affine narrows int64 ids itself (the estimators' group ids): the same answer as int32
    table = torch.tensor([[2.0, 1.0, 0.5]])
    assert torch.equal(
        native.affine(rewards, cells.long(), table), native.affine(rewards, cells, table)
    )


def test_every_estimator_is_the_same_either_way():
    rewards, g, s = batch(3_000, 400, 5, torch.float32, seed=5)
    for name in ESTIMATORS:
        fused = estimate(name, rewards, g, s)
        with native.torch_only():
            plain = estimate(name, rewards, g, s)
        assert torch.equal(fused.advantages, plain.advantages), name
        assert torch.equal(fused.keep, plain.keep), name
    fused = stratified_advantages_with_stats(rewards, g, s)
    with native.torch_only():
        plain = stratified_advantages_with_stats(rewards, g, s)
    assert torch.equal(fused.cells.mean, plain.cells.mean)
    assert torch.equal(fused.cells.std, plain.cells.std)


def run_without(env_change: dict) -> subprocess.CompletedProcess:
    code = (
        "import torch; from learner import native; "
        "from learner.advantages import stratified_advantages as f; "
        "a = f(torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 0, 1]), torch.tensor([0, 1, 1, 0])); "
        "print(native.library() is None, a.tolist())"
    )
    env = {**os.environ, **env_change}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def test_without_a_compiler_the_torch_path_runs_and_says_so_once(tmp_path):
    done = run_without({"CC": str(tmp_path / "no-such-cc"), "XDG_CACHE_HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("True ")
    assert done.stderr.count("strata: advantages run in torch") == 1, done.stderr
    assert "no-such-cc" in done.stderr


def test_strata_native_0_is_a_quiet_choice(tmp_path):
    done = run_without({"STRATA_NATIVE": "0", "XDG_CACHE_HOME": str(tmp_path)})
    assert done.returncode == 0 and done.stdout.startswith("True ") and done.stderr == ""
    assert not list(tmp_path.iterdir())  # nothing built


@needs_library
def test_the_library_is_built_once_into_the_cache(tmp_path):
    first = run_without({"XDG_CACHE_HOME": str(tmp_path)})
    second = run_without({"XDG_CACHE_HOME": str(tmp_path)})
    assert first.returncode == second.returncode == 0 and first.stderr == second.stderr == ""
    assert first.stdout.startswith("False ") and first.stdout == second.stdout
    built = list((tmp_path / "strata").iterdir())
    assert len(built) == 1 and built[0].suffix == ".so", built  # no temporaries left behind
