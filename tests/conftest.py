"""Suite-wide settings: nothing downloads, and GPU-only tests skip on machines without CUDA."""

import os

import pytest

from pipeline.runtime.startup import uncollected

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Under pytest-xdist (make test: 2 workers on 2 cores) every worker, and every run it launches,
# computes on one thread: two workers' 2-thread OpenMP pools on 2 cores spin against each other.
# On a clean clone (2026-11-26) this took the suite from 659-704 s of tests and 18-20 CPU-minutes
# to 451 s and 12.
if "PYTEST_XDIST_WORKER" in os.environ:
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(name, "1")


# The longest files first (seconds each took on 2 cores, idle, 2026-11-28, `make test`'s files;
# the vLLM file with .venv-vllm present, 2026-11-27). The workers take files in this order (make
# test passes --no-loadscope-reorder: xdist would otherwise order files by their number of tests),
# each worker its next file when it is nearly done with its last, so the short files fill in at
# the end and the two workers finish together. The first file's run builds the shared run assets
# (world and index in ~15 s, then the warm start: ~75 s on one core); the next three need no warm
# start of the run (test_warm_start reads the world and index only), so the other worker computes
# meanwhile instead of waiting on the assets' lock. The system tier's files (make test-system)
# are ordered the same way: test_ray_run.py builds the assets there. A file missing here only
# runs later; nothing else depends on the list.
LONGEST_FILES = (
    "tests/pipeline/test_local_run.py",  # 167, the assets' build included
    "tests/pipeline/test_ray_run.py",  # system tier: 338, the assets' build included
    "tests/learner/test_ranks.py",  # 67 (all cases, before the tiers: 345)
    "tests/pipeline/test_warm_start.py",  # 38 (a 2-epoch warm start of its own)
    "tests/pipeline/test_trap.py",  # 21
    "tests/examples/test_example_task.py",  # 123 (issue 69's plug-in; the assets exist by then)
    "tests/pipeline/test_agent_run.py",  # 92 (issue 70: builds the chat format's warm start)
    "tests/actors/test_vllm_engine.py",  # 72 where .venv-vllm exists (CI)
    "tests/pipeline/test_experiment.py",  # 47 (its Ray runner: system tier)
    "tests/pipeline/test_gpu_benchmarks.py",  # 55
    "tests/pipeline/test_simulation.py",  # 48
    "tests/pipeline/test_sglang_run.py",  # system tier: 137
    "tests/faults/test_learner_ranks.py",  # system tier: 50
    "tests/learner/test_ray_ranks.py",  # system tier: 39
    "tests/pipeline/test_evaluate.py",  # 37
    "tests/faults/test_disk_full.py",  # system tier: 29
    "tests/faults/test_kill_resume.py",  # system tier: 26
    "tests/pipeline/test_streaming.py",  # 26
    "tests/actors/test_sglang_server.py",  # 22 (its killed server: system tier)
    "tests/faults/test_soak.py",  # 21
    "tests/ops/test_dashboard.py",  # 20
    # then the files of 10-19 s, so that none of them starts last
    "tests/learner/test_ray_sync.py",  # 19
    "tests/learner/test_trainer.py",  # 18
    "tests/actors/test_mcp_tools.py",  # 18
    "tests/pipeline/test_trap_exact.py",  # 18
    "tests/pipeline/test_window.py",  # 16
    "tests/learner/test_native.py",  # 14
    "tests/pipeline/test_assets.py",  # system tier: 14
    "tests/learner/test_packing.py",  # 14
    "tests/pipeline/test_chat_tools_run.py",  # 12 (the agents' warm start, once built)
    "tests/pipeline/test_loggers.py",  # 13
    "tests/pipeline/test_reward_run.py",  # 12
    "tests/actors/test_openai_agent.py",  # 11
)


@pytest.hookimpl(wrapper=True)
def pytest_collection(session):
    """The test modules import torch, transformers and DeepSpeed as a launch does: with the
    garbage collector paused (pipeline/runtime/startup.py), as there."""
    with uncollected():
        return (yield)


def _file_rank(item) -> int:
    path = item.nodeid.split("::", 1)[0]
    return LONGEST_FILES.index(path) if path in LONGEST_FILES else len(LONGEST_FILES)


def pytest_collection_modifyitems(config, items):
    import torch

    items.sort(key=_file_rank)  # stable: each file's tests keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (this machine has none)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def sharded_stages() -> list[int]:
    """The ZeRO stages a learner test holds to stage 0: 1 and 2 everywhere, and 3 where torch sees
    a CUDA GPU (DeepSpeed partitions parameters on GPUs only; the launcher refuses it on CPU)."""
    import torch

    return [1, 2, 3] if torch.cuda.is_available() else [1, 2]


def gpu_per_rank(ranks: int) -> pytest.MarkDecorator:
    """Skips a test of `ranks` learner ranks on a CUDA machine with fewer GPUs than ranks: there
    the ranks train over NCCL, one GPU each, and the launcher refuses fewer GPUs
    (pipeline/backends/local.py). On a machine without CUDA the ranks train over gloo."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return pytest.mark.skipif(
        0 < gpus < ranks,
        reason=f"{ranks} NCCL learner ranks need a GPU each; this machine has {gpus}",
    )


DISTRIBUTED_VARS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "CROSS_RANK",
    "CROSS_SIZE",
)


# A secret-looking variable every launched run carries: `assert_no_secret` checks that none of a
# run's files holds its value (nor does the python tool see it: its environment is a clean one).
SECRET_NAME, SECRET_VALUE = "STRATA_TEST_API_TOKEN", "tok-5f3a9c1e7b2d4e60"


def child_env() -> dict[str, str]:
    """The environment for a `python -m pipeline.launch` child: without the torch.distributed
    variables an in-process learner test left behind (a child would rendezvous on our port),
    with a secret-looking token (see `assert_no_secret`)."""
    env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_VARS}
    env[SECRET_NAME] = SECRET_VALUE
    return env


def assert_no_secret(run_dir) -> None:
    """No file of the run directory holds the secret-looking token its launcher's environment had."""
    from pathlib import Path

    leaked = [
        str(p)
        for p in Path(run_dir).rglob("*")
        if p.is_file() and SECRET_VALUE.encode() in p.read_bytes()
    ]
    assert not leaked, f"{SECRET_NAME}'s value was written to {leaked}"


MARK_NAME = "STRATA_TEST_MARK"


def run_mark() -> dict[str, str]:
    """An environment entry that marks one launched run's processes (its servers and their engine
    cores inherit it): the other pytest worker may run servers of its own from the same cache."""
    import time

    return {MARK_NAME: f"{os.getpid()}-{time.time_ns()}"}


def marked(mark: dict[str, str], command: str = ""):
    """The live processes carrying `mark` whose command line holds `command`."""
    import psutil

    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(MARK_NAME) == mark[MARK_NAME] and command in " ".join(p.cmdline()):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _loopback(ip: str) -> bool:
    import ipaddress

    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1, an IPv6 socket on loopback
    return (mapped or address).is_loopback


def assert_loopback_listeners(pid: int) -> list[tuple[str, int, str]]:
    """Every socket listening in process `pid` and its descendants (the run's metrics endpoint,
    retrieval server, inference servers, Ray's processes) is bound to loopback, read from the
    socket table. Returns the listeners seen."""
    import psutil

    seen = []
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            connections = proc.net_connections(kind="inet")
            name = proc.name()
        except psutil.Error:  # it exited meanwhile
            continue
        seen += [
            (c.laddr.ip, c.laddr.port, name) for c in connections if c.status == psutil.CONN_LISTEN
        ]
    exposed = [entry for entry in seen if not _loopback(entry[0])]
    assert not exposed, f"listening beyond loopback: {exposed}"
    return seen


@pytest.fixture(scope="session")
def run_cache(tmp_path_factory):
    """One `runtime.cache_dir` for every end-to-end run of the session, shared by the xdist
    workers: the world, its index and the warm-started policy are built by the first run that
    needs them (the others wait on the asset's lock, pipeline/assets/cache.py) and reused after."""
    if "PYTEST_XDIST_WORKER" not in os.environ:  # one process
        return tmp_path_factory.mktemp("run-cache")
    shared = tmp_path_factory.getbasetemp().parent / "run-cache"
    shared.mkdir(exist_ok=True)
    return shared


def assert_accounting(run_dir) -> dict:
    """The end of every end-to-end test: the run's books balance and match its spill
    (`pipeline.runtime.accounting.audit`). Returns the books."""
    import json
    from pathlib import Path

    from pipeline.runtime.accounting import audit

    assert not audit(Path(run_dir)), audit(Path(run_dir))
    return json.loads((Path(run_dir) / "accounting.json").read_text())
