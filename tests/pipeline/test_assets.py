"""Runs sharing a cache directory build each asset once (pipeline/assets/cache.py's build locks)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUILD = """
import sys
from pipeline.assets.cache import prepare_world
from pipeline.config.loader import load_config
prepare_world(load_config("configs/local.yaml", [f"runtime.cache_dir={sys.argv[1]}"]))
"""


def test_two_processes_preparing_one_world_build_it_once(tmp_path):
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", BUILD, str(tmp_path)],
            cwd=ROOT,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    said = "".join(out for out, _ in outs)
    assert said.count("building the mini-GAIA world") == 1, said
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == [
        "world-small-seed0"
    ]
