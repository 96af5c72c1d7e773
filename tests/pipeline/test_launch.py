import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import pipeline.launch
from pipeline.config.loader import load_config
from pipeline.launch import main

ROOT = Path(__file__).resolve().parents[2]
LOCAL = str(ROOT / "configs" / "local.yaml")


def test_dry_run_prints_the_resolved_config_and_writes_nothing(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert (
        main(
            [
                LOCAL,
                "--dry-run",
                "--set",
                "learner.advantage.alpha=0.8",
                "--set",
                "actors.tools=[search]",
            ]
        )
        == 0
    )
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["learner"]["advantage"]["alpha"] == 0.8 and resolved["actors"]["tools"] == [
        "search"
    ]
    assert resolved["learner"]["advantage"]["eps"] == 1e-6  # defaults are spelled out
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def no_training(monkeypatch):
    """These tests are about the CLI and the run directory; training is tested in test_local_run."""
    calls = []
    monkeypatch.setattr(
        pipeline.launch,
        "run",
        lambda config, path, run_dir, resume=False: calls.append(run_dir) or 0,
    )
    return calls


def test_run_writes_the_resolved_config_into_the_run_dir(capsys, tmp_path, no_training):
    run_dir = tmp_path / "run"
    assert main([LOCAL, "--run-dir", str(run_dir), "--set", "buffer.group_size=4"]) == 0
    written = load_config(run_dir / "config.yaml")
    assert written.buffer.group_size == 4
    assert [p.name for p in run_dir.iterdir()] == ["config.yaml"]  # no temporary file left
    assert no_training == [run_dir]


def test_default_run_dirs_are_fresh(tmp_path, capsys, no_training):
    overrides = ["--set", f"runtime.runs_dir={tmp_path}"]
    assert main([LOCAL, *overrides]) == 0
    assert main([LOCAL, *overrides]) == 0
    runs = sorted(p.name for p in tmp_path.iterdir())
    assert len(runs) == 2 and all(name.startswith("local-") for name in runs)


def test_an_existing_run_dir_is_never_overwritten(tmp_path, capsys, no_training):
    (tmp_path / "keep.txt").write_text("earlier run")
    assert main([LOCAL, "--run-dir", str(tmp_path)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_bad_value_is_one_line_and_writes_nothing(tmp_path, capsys, no_training):
    run_dir = tmp_path / "run"
    assert main([LOCAL, "--run-dir", str(run_dir), "--set", "learner.advantage.alpha=2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("strata: error: ")
    assert "learner.advantage.alpha = 2" in err and "less than or equal to 1" in err
    assert not run_dir.exists()


def test_cli_as_a_user_runs_it(tmp_path):
    ok = subprocess.run(
        [sys.executable, "-m", "pipeline.launch", "configs/gaia.yaml", "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    assert yaml.safe_load(ok.stdout)["actors"]["engine"]["type"] == "sglang"
    bad = subprocess.run(
        [sys.executable, "-m", "pipeline.launch", str(tmp_path / "missing.yaml")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2
    assert bad.stderr.strip() == (
        f"strata: error: config file not found: {tmp_path / 'missing.yaml'} "
        "(pass the path of a YAML config, e.g. configs/local.yaml)"
    )
    assert "Traceback" not in bad.stderr


def test_resume_needs_the_run_dir(tmp_path, capsys, no_training):
    assert main([LOCAL, "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--resume needs --run-dir" in err and not no_training


@pytest.mark.parametrize("urls_first", [False, True])
def test_switching_a_backend_by_set_starts_the_section_from_its_defaults(
    capsys, tmp_path, no_training, urls_first
):
    sets = [
        "--set",
        "actors.engine.type=sglang",
        "--set",
        "actors.engine.urls=[http://127.0.0.1:30000]",
    ]
    if urls_first:
        sets = sets[2:] + sets[:2]
    assert main([LOCAL, "--dry-run", *sets]) == 0
    out, err = capsys.readouterr()
    engine = yaml.safe_load(out)["actors"]["engine"]
    assert engine["type"] == "sglang" and engine["urls"] == ["http://127.0.0.1:30000"]
    assert "max_batch_size" not in engine  # the embedded section's key, dropped
    note = "actors.engine starts from the sglang defaults; dropped actors.engine.max_batch_size"
    assert (
        err.count("\n") == 1
        and note in err
        and f"# note: --set actors.engine.type=sglang: {note}" in out
    )

    # a run (nothing answers at that URL, so sglang would be refused: a model switch instead)
    run_dir = tmp_path / "run"
    sets = ["--set", "model.type=hf", "--set", "model.path=/models/x"]
    assert main([LOCAL, "--run-dir", str(run_dir), *sets]) == 0
    written = (run_dir / "config.yaml").read_text()
    assert written.startswith(
        "# note: --set model.type=hf: model starts from the hf defaults; dropped model.layers"
    )
    assert load_config(run_dir / "config.yaml").model.type == "hf"  # reads back


def test_switching_a_backend_keeps_the_keys_both_backends_have(capsys, tmp_path):
    """runtime.runs_dir holds for both runtimes, max_batch_size for embedded and vLLM engines."""
    config = tmp_path / "c.yaml"
    config.write_text(
        "actors: {engine: {type: embedded, max_batch_size: 7}}\nruntime: {type: local, runs_dir: elsewhere}\n"
    )
    assert (
        main(
            [
                str(config),
                "--dry-run",
                "--set",
                "runtime.type=ray",
                "--set",
                "actors.engine.type=vllm",
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()
    resolved = yaml.safe_load(out)
    assert resolved["runtime"]["type"] == "ray" and resolved["runtime"]["runs_dir"] == "elsewhere"
    assert resolved["actors"]["engine"]["max_batch_size"] == 7
    assert err == "" and not out.startswith("# note")


def test_top_p_below_one_is_refused_for_training_in_one_line(capsys, tmp_path, no_training):
    code = main([LOCAL, "--run-dir", str(tmp_path / "run"), "--set", "actors.top_p=0.9"])
    err = capsys.readouterr().err
    assert code == 2 and not no_training and not (tmp_path / "run").exists()
    assert err.count("\n") == 1 and "actors.top_p 0.9 < 1" in err and "actors.top_p=1.0" in err


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="checks the messages shown without a GPU"
)
@pytest.mark.parametrize(
    "sets, expected",
    [
        (["actors.engine.device=cuda"], "actors.engine.device cuda: this machine has no CUDA GPU"),
        (
            ["model.type=hf", "model.path=/models/x", "model.dtype=float16"],
            "model.dtype float16 trains only on CUDA",
        ),
    ],
)
def test_keys_this_machine_cannot_honour_are_refused_in_one_line(
    sets, expected, capsys, tmp_path, no_training
):
    argv = [LOCAL, "--run-dir", str(tmp_path / "run")]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 2 and not no_training and not (tmp_path / "run").exists()
    err = capsys.readouterr().err
    assert expected in err and err.strip().splitlines()[-1].count("error") == 1


def test_progress_lines_come_every_log_every_steps_and_for_the_last():
    import io

    from rich.console import Console

    from pipeline.runtime.run import progress_printer

    config = load_config(LOCAL, ["metrics.log_every=2", "learner.max_steps=5"])
    out = io.StringIO()
    progress = progress_printer(config, Console(file=out, soft_wrap=True, highlight=False))
    for step in range(1, 6):
        progress(
            {
                "step": step,
                "elapsed_s": 1.0,
                "generated_tokens_per_s": 1.0,
                "trajectories_per_s": 1.0,
                "buffer_ready": 0,
                "buffer_open": 0,
            }
        )
    assert [line.split()[1] for line in out.getvalue().splitlines()] == ["2/5", "4/5", "5/5"]


def test_naming_running_servers_drops_the_settings_of_started_ones(capsys):
    """gaia.yaml starts its SGLang servers; `--set actors.engine.urls=[...]` points it at servers
    running elsewhere instead: the started-server keys go, said in one note."""
    assert (
        main(
            [
                "configs/gaia.yaml",
                "--dry-run",
                "--set",
                "actors.engine.urls=[http://10.0.0.2:30000]",
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()
    engine = yaml.safe_load(out)["actors"]["engine"]
    assert engine["urls"] == ["http://10.0.0.2:30000"] and engine["num_servers"] == 1
    assert (
        err.count("\n") == 1
        and "dropped actors.engine.num_servers, actors.engine.tp_size, actors.engine.mem_fraction_static"
        in err
    )
    # a whole section at once
    section = "actors.engine={type: sglang, urls: [http://10.0.0.2:30000, http://10.0.0.3:30000], timeout_s: 60}"
    assert main([LOCAL, "--dry-run", "--set", section]) == 0
    engine = yaml.safe_load(capsys.readouterr().out)["actors"]["engine"]
    assert (
        engine["urls"] == ["http://10.0.0.2:30000", "http://10.0.0.3:30000"]
        and engine["timeout_s"] == 60
    )


def test_servers_that_do_not_answer_are_named_in_one_line(tmp_path):
    from actors.servers import free_port

    silent = f"http://127.0.0.1:{free_port()}"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.launch",
            LOCAL,
            "--run-dir",
            str(tmp_path / "r"),
            "--set",
            f"actors.engine={{type: sglang, urls: [{silent}]}}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert f"no answer from {silent}/health (1 of 1 servers)" in done.stderr


@pytest.mark.parametrize("given", [False, True])
def test_a_launch_that_fails_before_the_run_starts_leaves_no_run_directory(
    given, tmp_path, monkeypatch, capsys
):
    """Assets that cannot be prepared (here: a GAIA file the run cannot use) end the launch
    before it starts: the config.yaml written first goes again, and the directory too unless
    the user made it (an empty --run-dir they gave stays, empty)."""
    run_dir = tmp_path / "run"
    if given:
        run_dir.mkdir()
    monkeypatch.setattr(pipeline.launch, "run", lambda config, path, rd, resume=False: 2)
    assert main([LOCAL, "--run-dir", str(run_dir)]) == 2
    assert run_dir.exists() == given and (not given or list(run_dir.iterdir()) == [])


def test_a_failed_run_that_wrote_more_than_its_config_is_kept(tmp_path, monkeypatch):
    def fails_after_starting(config, path, run_dir, resume=False):
        (run_dir / "logs").mkdir()  # e.g. the log of a server that would not start
        return 2

    monkeypatch.setattr(pipeline.launch, "run", fails_after_starting)
    assert main([LOCAL, "--run-dir", str(tmp_path / "run")]) == 2
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["config.yaml", "logs"]
