"""The `strata` console script (pyproject's [project.scripts], pipeline/cli.py): each command is
its `python -m pipeline.*` module's main with the remaining arguments, run through the installed
script as a user would."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.cli import COMMANDS, main

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(sys.executable).parent / "strata"


@pytest.mark.skipif(not SCRIPT.exists(), reason="strata is not installed: pip install -e .")
def test_the_installed_script_runs_a_command_with_its_arguments():
    done = subprocess.run(
        [str(SCRIPT), "launch", "configs/local.yaml", "--dry-run", "--set", "buffer.group_size=3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "group_size: 3" in done.stdout
    wrong = subprocess.run([str(SCRIPT), "train"], capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 2 and wrong.stderr == (
        f"strata: error: unknown command 'train'; the commands are {', '.join(COMMANDS)} "
        "(strata --help)\n"
    )
    assert shutil.which("strata", path=str(SCRIPT.parent)) == str(SCRIPT)


def test_every_command_is_a_modules_main(capsys):
    import importlib

    for module, _ in COMMANDS.values():
        assert callable(importlib.import_module(module).main), module
    assert main(["--help"]) == 0 and "  experiment-report  " in capsys.readouterr().out
    assert main([]) == 2
    assert main(["config-doc", "x"]) == 2
    assert "takes no arguments" in capsys.readouterr().err


def test_a_command_gets_the_remaining_arguments_and_its_status(monkeypatch):
    import pipeline.replay as replay

    seen = []
    monkeypatch.setattr(replay, "main", lambda argv: seen.append(argv) or 3)
    assert main(["replay", "runs/x", "--alpha", "0.5"]) == 3
    assert seen == [["runs/x", "--alpha", "0.5"]]
