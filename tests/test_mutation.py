"""make mutation's plugin (tests/mutation.py): the per-module test table, the hits a test keeps,
and the order a mutant's tests run in."""

from pathlib import Path

import pytest

from tests.mutation import cheapest_first, module_tests, owned_hits

ROOT = Path(__file__).resolve().parent.parent


def test_every_mutated_module_has_its_own_test_files_and_they_are_in_the_selection():
    tests = module_tests(ROOT / "pyproject.toml")
    assert tests["learner.gae"] == ("tests/learner/test_gae.py",)
    assert "tests/pipeline/test_trap.py" not in tests["learner.advantages"]
    for files in tests.values():
        assert files and all((ROOT / f).is_file() for f in files)


def write(tmp_path: Path, table: str) -> Path:
    path = tmp_path / "pyproject.toml"
    path.write_text(
        "[tool.mutmut]\n"
        'only_mutate = ["learner/gae.py", "learner/critic.py"]\n'
        'pytest_add_cli_args_test_selection = ["tests/learner/test_gae.py"]\n' + table
    )
    return path


def test_a_mutated_module_without_an_entry_or_a_file_outside_the_selection_is_refused(tmp_path):
    with pytest.raises(pytest.UsageError, match=r"no \[tool.strata.mutation.tests\]"):
        module_tests(write(tmp_path, ""))
    table = '[tool.strata.mutation.tests]\n"learner.gae" = ["tests/learner/test_gae.py"]\n'
    with pytest.raises(pytest.UsageError, match=r"has no 'learner\.critic': name the test files"):
        module_tests(write(tmp_path, table))
    table += '"learner.critic" = ["tests/learner/test_critic.py"]\n'
    with pytest.raises(pytest.UsageError, match=r"test_critic\.py, not in .*add it there"):
        module_tests(write(tmp_path, table))


def test_a_test_keeps_the_hits_of_the_modules_it_is_a_unit_test_of():
    tests = {
        "learner.gae": ("tests/learner/test_gae.py",),
        "learner.critic": ("tests/learner/test_critic.py", "tests/learner/test_gae.py"),
    }
    hits = {
        "learner.gae.x_gae",
        "learner.critic.xǁCriticǁvalues",
        "learner.advantages.x_grpo",  # a module the table does not name keeps its hit
    }
    assert owned_hits(hits, "tests/learner/test_gae.py", tests) == hits
    assert owned_hits(hits, "tests/learner/test_critic.py", tests) == {
        "learner.critic.xǁCriticǁvalues",
        "learner.advantages.x_grpo",
    }
    assert owned_hits(hits, "tests/pipeline/test_trap.py", tests) == {"learner.advantages.x_grpo"}


def test_a_mutants_files_run_cheapest_first_and_each_files_tests_cheapest_first():
    nodeids = ["t/slow.py::a", "t/fast.py::b", "t/slow.py::c", "t/fast.py::d", "t/new.py::e"]
    seconds = {"t/slow.py::a": 3.0, "t/slow.py::c": 0.1, "t/fast.py::b": 0.5, "t/fast.py::d": 0.2}
    order = [nodeids[i] for i in cheapest_first(nodeids, seconds)]
    assert order == ["t/new.py::e", "t/fast.py::d", "t/fast.py::b", "t/slow.py::c", "t/slow.py::a"]
    assert cheapest_first(["x::a", "x::b"], {}) == [0, 1]  # unmeasured: as given
