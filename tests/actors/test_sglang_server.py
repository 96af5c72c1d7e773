"""SGLang servers the launcher starts (`actors.sglang_server`), on CPU: the command line and the
per-server GPU environment it builds, the one-line refusals, and the whole start -> health ->
restart -> stop cycle against a stand-in executable (a `python` that serves the stand-in SGLang
server for `-m sglang.launch_server`, recording its argv and CUDA_VISIBLE_DEVICES)."""

import asyncio
import json
import stat
import sys
import time
from pathlib import Path

import pytest

from actors.engine import SamplingParams
from actors.servers import ServerWatch
from actors.sglang import SGLangEngine
from actors.sglang_server import SGLangServers, gpu_sets, launch_problem, physical_gpus
from pipeline.backends.sglang import SGLangEngine as SGLangConfig
from pipeline.config.loader import load_config
from pipeline.runtime.parts import managed_servers

ROOT = Path(__file__).resolve().parents[2]


def standin_python(directory: Path) -> Path:
    """An executable that stands in for an interpreter with sglang installed."""
    script = directory / "python"
    script.write_text(
        "#!/bin/sh\n"
        "# stands in for `python -m sglang.launch_server ARGS`: the CPU stand-in server\n"
        '[ "$1" = "-m" ] && [ "$2" = "sglang.launch_server" ] || { echo "only -m sglang.launch_server" >&2; exit 2; }\n'
        "shift 2\n"
        f'cd "{ROOT}" && exec "{sys.executable}" -m tests.actors.sglang_standin "$@"\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_the_command_line_and_environment_of_each_server(monkeypatch):
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    servers = SGLangServers(
        "/models/Qwen3-8B",
        count=2,
        gpu_sets=[[2], [3]],
        tp_size=1,
        mem_fraction_static=0.75,
        python="/opt/sgl/bin/python",
        dtype="bfloat16",
        seed=7,
        extra_args=["--context-length", "32768"],
    )
    assert servers.command(30001, 1) == [
        "/opt/sgl/bin/python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/models/Qwen3-8B",
        "--host",
        "127.0.0.1",
        "--port",
        "30001",
        "--tp-size",
        "1",
        "--mem-fraction-static",
        "0.75",
        "--dtype",
        "bfloat16",
        "--random-seed",
        "8",
        "--context-length",
        "32768",
    ]
    env = servers.environment(1)
    assert env["CUDA_VISIBLE_DEVICES"] == "7"  # index 3 of this process's visible GPUs
    assert "SGLANG_RETURN_ORIGINAL_LOGPROB" not in env  # logprobs of the sampling distribution
    assert env["HF_HUB_OFFLINE"] == "1"
    assert physical_gpus([0, 1]) == ["4", "5"]


def test_gpus_default_to_the_machines_last_and_the_config_builds_the_servers(monkeypatch, tmp_path):
    assert gpu_sets(2, 2, [], 8) == [[4, 5], [6, 7]]
    assert gpu_sets(2, 1, [0, 3], 8) == [[0], [3]]
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    config = load_config("configs/gaia.yaml", ["actors.engine.tp_size=2"])
    servers = managed_servers(config, "/models/Qwen3-8B", tmp_path)
    assert isinstance(servers, SGLangServers) and servers.count == 2
    assert servers.gpu_sets == [[4, 5], [6, 7]] and servers.tp_size == 2
    assert servers.mem_fraction_static == 0.8 and servers.dtype == "bfloat16"
    named = load_config("configs/gaia.yaml", ["actors.engine.urls=[http://10.0.0.2:30000]"])
    assert managed_servers(named, "/models/Qwen3-8B", tmp_path) is None  # running elsewhere


@pytest.mark.parametrize(
    ("engine", "gpus", "ray", "expected"),
    [
        ({}, 0, None, "it has none: name running servers with --set actors.engine.urls="),
        ({"num_servers": 4, "tp_size": 2}, 4, "private", "need 8 GPUs, but this machine has 4"),
        ({"gpus": [5]}, 4, None, "need 1 GPUs (gpus [5]), but this machine has 4"),
        ({"num_servers": 2}, 2, None, "would take GPU 0 (all GPUs), which the learner uses"),
        ({"gpus": [0]}, 4, None, "would take GPU 0, which the learner uses"),
        (
            {"gpus": [1]},
            4,
            "private",
            "take the machine's last GPUs ([3]; Ray hands out the first ones)",
        ),
        ({}, 8, "joined", "GPUs the Ray cluster at runtime.address may also hand out"),
        ({"python": "/bin/false"}, 4, None, "starts servers with /bin/false, which has no sglang"),
    ],
)
def test_what_cannot_start_here_is_refused_in_one_line(engine, gpus, ray, expected):
    problem = launch_problem(SGLangConfig(**engine), engine.get("python"), gpus, ray)
    assert problem is not None and expected in problem and "\n" not in problem


@pytest.mark.system
def test_started_servers_are_healthy_restarted_when_killed_and_stopped(tiny_policy_dir, tmp_path):
    """The launcher's cycle on the stand-in: start two (each on its GPU set), the engine
    generates on both; one is SIGKILLed: the watch restarts it on its port and readmits it
    (its new process loads the published checkpoint before it serves); stop ends both."""
    truth = tmp_path / "truth.jsonl"  # both servers' events, each with its pid
    servers = SGLangServers(
        str(tiny_policy_dir),
        count=2,
        gpu_sets=[[2], [3]],
        python=str(standin_python(tmp_path)),
        dtype="float32",
        log_dir=str(tmp_path / "logs"),
        startup_timeout_s=120,
        extra_args=["--standin-truth", str(truth)],
    )

    async def scenario():
        urls = servers.start()
        async with SGLangEngine(urls, timeout_s=60) as engine:
            ids = [5, 6, 7]
            params = SamplingParams(temperature=1.0, max_new_tokens=4)
            await asyncio.gather(*(engine.generate(ids, params) for _ in range(4)))
            await engine.update_weights(1, path=str(tiny_policy_dir))
            watch = ServerWatch(
                servers, lambda url: _async(engine.hold, url), engine.readmit, poll_s=0.1
            )
            watching = asyncio.create_task(watch.run())
            killed = servers.servers[1].process
            killed.kill()
            deadline = time.monotonic() + 120
            while watch.restarts == 0:
                assert time.monotonic() < deadline and not watch.left_out
                await asyncio.sleep(0.2)
            after = await asyncio.gather(*(engine.generate(ids, params) for _ in range(4)))
            watching.cancel()
            await asyncio.gather(watching, return_exceptions=True)
            return urls, killed, engine.stats(), after

    try:
        urls, killed, stats, after = asyncio.run(scenario())
        processes = [s.process for s in servers.servers]
    finally:
        servers.stop()
    assert len(urls) == 2 and all(u.startswith("http://127.0.0.1:") for u in urls)
    assert killed.poll() is not None and processes[1] is not killed  # a new process, same port
    assert stats["version"] == 1 and all(set(g.versions) == {1} for g in after)
    assert all(p.poll() is not None for p in processes)  # stopped
    events = [json.loads(line) for line in truth.read_text().splitlines()]
    starts = [e for e in events if e["event"] == "start"]
    assert sorted(e["cuda_visible_devices"] for e in starts) == ["2", "3", "3"]
    assert all(e["argv"][:2] == ["--model-path", str(tiny_policy_dir)] for e in starts)
    restarted = [
        e["event"] for e in events if e.get("pid") == processes[1].pid and e["event"] != "start"
    ]
    assert restarted and restarted[0] == "update"  # it loaded the published weights first
    assert (tmp_path / "logs" / "sglang-server-1.log").is_file()


async def _async(function, *args):
    return function(*args)
