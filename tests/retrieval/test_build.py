"""The streaming build: shards, a build killed and resumed, workers, a full disk, bad input."""

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from retrieval import shards
from retrieval.build import build, encoding_devices, work_dir
from retrieval.build import main as build_main
from retrieval.corpus import Passage, make_contents, write_corpus
from retrieval.index import PassageIndex
from retrieval.shards import ShardError, owner, read_header, shard_path

ENCODER = "strata-hash-32"  # deterministic and instant: these tests are about the machinery
ROOT = Path(__file__).resolve().parents[2]


def corpus(path: Path, count: int = 1_150) -> Path:
    write_corpus(
        [Passage(f"p{i}", make_contents(f"T{i}", f"passage number {i}")) for i in range(count)],
        path,
    )
    return path


def files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted build of the corpus, 12 shards of 100."""
    root = tmp_path_factory.mktemp("reference")
    source = corpus(root / "c.jsonl")
    build(str(source), str(root / "index"), ENCODER, shard_size=100, quiet=True)
    return source, root / "index"


def test_an_uninterrupted_build_describes_itself_and_cleans_up(reference):
    _, out = reference
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["count"], meta["dim"], meta["encoder"]) == (1_150, 32, ENCODER)
    assert not work_dir(out).exists()
    index = PassageIndex.load(out)
    vector = np.asarray(index.index.reconstruct(777))[None]
    assert index.search(vector, 1)[0][0][0].id == "p777"  # row i is passage i


def test_a_killed_build_resumes_to_the_same_index(reference, tmp_path):
    source, expected = reference
    out = tmp_path / "index"
    # A real process, killed by SIGKILL right after its fifth shard reached the disk.
    script = (
        "import os, signal, sys\n"
        "from retrieval import shards\n"
        "from retrieval.build import main\n"
        "write, written = shards.write_shard, []\n"
        "def dying(*args):\n"
        "    write(*args)\n"
        "    written.append(1)\n"
        "    if len(written) == 5:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "shards.write_shard = dying\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    argv = ["--corpus", str(source), "--out", str(out), "--encoder", ENCODER, "--shard-size", "100"]
    killed = subprocess.run([sys.executable, "-c", script, *argv], cwd=ROOT, capture_output=True)
    assert killed.returncode == -signal.SIGKILL
    work = work_dir(out)
    assert sorted(p.name for p in work.iterdir()) == [f"shard-{k:06d}.bin" for k in range(5)]
    assert not out.exists()

    assert build_main(argv) == 2  # an unfinished build is neither resumed nor lost silently
    encoded = []
    original = shards.encode_shards.__globals__["load_encoder"]

    def counting(*args, **kwargs):
        encoder = original(*args, **kwargs)
        passages = encoder.encode_passages
        encoder.encode_passages = lambda texts: encoded.append(len(texts)) or passages(texts)
        return encoder

    shards.encode_shards.__globals__["load_encoder"] = counting
    try:
        assert build_main([*argv, "--resume"]) == 0
    finally:
        shards.encode_shards.__globals__["load_encoder"] = original
    assert sum(encoded) == 1_150 - 500  # only the shards the killed build had not written
    assert files(out) == files(expected)
    assert not work.exists()


def test_shards_of_another_corpus_or_encoder_are_refused(tmp_path, capsys):
    source = corpus(tmp_path / "c.jsonl", 250)
    out = tmp_path / "index"
    argv = ["--corpus", str(source), "--out", str(out), "--shard-size", "100"]
    # Leave one shard of a 64-d encoder, then resume with the 32-d one.
    job = shards.ShardJob(
        str(source), "0" * 64, str(work_dir(out)), "strata-hash-64", "auto", 64, 100
    )
    work_dir(out).mkdir()
    shards.write_shard(
        shard_path(job.work, 0),
        shards.ShardHeader("0" * 64, "strata-hash-64", "auto", 64, 0, 0, ["p0"]),
        np.zeros((1, 64), np.float32),
    )
    assert build_main([*argv, "--encoder", ENCODER, "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert (
        "shard-000000.bin was encoded by strata-hash-64 (auto, 64-d) from corpus sha256 000000000000"
        in err
    )
    assert not out.exists()
    shard_path(job.work, 0).write_bytes(b"STRATA-SHARD\x01\n" + b"\x05" + b"\0" * 7 + b"{oops")
    assert build_main([*argv, "--encoder", ENCODER, "--resume"]) == 2
    assert "is not a Strata shard: delete it and rerun with --resume" in capsys.readouterr().err


def test_two_worker_processes_split_the_shards_and_agree(reference, tmp_path):
    source, expected = reference
    assert [owner(k, 2) for k in range(5)] == [0, 1, 0, 1, 0]
    out = tmp_path / "index"
    build(str(source), str(out), ENCODER, shard_size=100, quiet=True, devices=["cpu", "cpu"])
    assert files(out) == files(expected)


def test_a_full_disk_mid_build_is_one_line_and_resumes_once_space_is_freed(
    reference, tmp_path, monkeypatch, capsys
):
    source, expected = reference
    out = tmp_path / "index"
    argv = ["--corpus", str(source), "--out", str(out), "--encoder", ENCODER, "--shard-size", "100"]
    calls = []
    real_fsync = os.fsync

    def full(fd):
        calls.append(fd)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full)
    assert build_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "disk full writing" in err and "rerun with --resume" in err
    work = work_dir(out)
    assert sorted(p.name for p in work.iterdir()) == ["shard-000000.bin", "shard-000001.bin"]
    monkeypatch.setattr(os, "fsync", real_fsync)  # space freed
    assert build_main([*argv, "--resume"]) == 0
    assert files(out) == files(expected)


def test_a_corpus_line_without_contents_is_one_line_and_leaves_no_index(tmp_path, capsys):
    source = corpus(tmp_path / "c.jsonl", 150)
    with source.open("a") as fh:
        fh.write('{"id": "x", "text": "no contents"}\n')
    out = tmp_path / "index"
    argv = ["--corpus", str(source), "--out", str(out), "--encoder", ENCODER, "--shard-size", "100"]
    assert build_main(argv) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and 'c.jsonl:151: expected an object with a string "contents"' in err
    )
    assert not out.exists()
    assert read_header(shard_path(work_dir(out), 0))[0].count == 100  # kept for a fixed corpus
    assert build_main([*argv[:1], str(tmp_path / "none.jsonl"), *argv[2:], "--force"]) == 2
    assert "cannot open corpus" in capsys.readouterr().err


def test_a_truncated_shard_is_named(tmp_path):
    path = tmp_path / "shard-000000.bin"
    shards.write_shard(
        path, shards.ShardHeader("a", "e", "auto", 4, 0, 0, ["p0", "p1"]), np.ones((2, 4))
    )
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(ShardError, match="its header describes"):
        read_header(path)


def test_one_encoding_worker_per_gpu_when_the_corpus_has_shards_for_them(tmp_path, monkeypatch):
    small = corpus(tmp_path / "small.jsonl", 300)  # 17 kB: "35 passages" at 500 bytes each
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert encoding_devices(str(small), shard_size=100) == [None]  # one shard: no point in four
    assert encoding_devices(str(small), shard_size=10) == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert encoding_devices(str(small), shard_size=10) == [None]
