"""Runs sharing a cache directory build each asset once (pipeline/assets/cache.py's build locks)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.assets.cache import prepare_index
from pipeline.config.loader import load_config
from retrieval.corpus import Passage, write_corpus
from retrieval.index import FORMAT_VERSION

ROOT = Path(__file__).resolve().parents[2]
BUILD = """
import sys
from pipeline.assets.cache import prepare_world
from pipeline.config.loader import load_config
prepare_world(load_config("configs/local.yaml", [f"runtime.cache_dir={sys.argv[1]}"]))
"""


@pytest.mark.system
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


def test_a_cached_index_of_an_older_format_or_other_settings_is_built_anew(tmp_path):
    corpus = tmp_path / "c.jsonl"
    write_corpus([Passage(str(i), f'"T"\nx{i}') for i in range(500)], corpus)
    settings = [f"runtime.cache_dir={tmp_path}", "retrieval.encoder=strata-hash-16"]
    config = load_config("configs/local.yaml", settings)
    index = prepare_index(config, corpus, quiet=True)
    meta = json.loads((index / "meta.json").read_text())
    assert meta["format"] == FORMAT_VERSION
    (index / "meta.json").write_text(json.dumps({**meta, "format": 1}))  # a cache of old Strata
    assert prepare_index(config, corpus, quiet=True) == index
    assert json.loads((index / "meta.json").read_text())["format"] == FORMAT_VERSION
    ivf = load_config("configs/local.yaml", [*settings, "retrieval.index=ivf", "retrieval.nlist=4"])
    other = prepare_index(ivf, corpus, quiet=True)
    assert other.name.endswith("-ivf-nlist4") and json.loads((other / "meta.json").read_text())[
        "settings"
    ] == {"nlist": 4}
