"""The streaming build: shards, a build killed and resumed, workers, a full disk, bad input."""

import dataclasses
import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import faiss
import numpy as np
import pytest
import torch

from retrieval import build as build_module
from retrieval import shards
from retrieval.build import build, encoding_devices, work_dir
from retrieval.build import main as build_main
from retrieval.corpus import Passage, make_contents, read_corpus, write_corpus
from retrieval.encoders import load_encoder
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


def test_a_flat_index_file_is_the_one_faiss_writes(reference):
    """The flat file is written from the shards behind faiss's header: byte for byte what
    faiss.write_index makes of an IndexFlatIP holding the same vectors."""
    source, out = reference
    passages = read_corpus(source)
    flat = faiss.IndexFlatIP(32)
    flat.add(load_encoder(ENCODER).encode_passages([p.contents for p in passages]))
    assert (out / "index.faiss").read_bytes() == faiss.serialize_index(flat).tobytes()


# VmHWM, not ru_maxrss: a forked child's ru_maxrss counts the parent's (pytest's) pages as well.
PEAK = """
import re, sys
from pathlib import Path
from retrieval.build import build
build(sys.argv[1], sys.argv[2], "strata-hash-768", shard_size=int(sys.argv[3]), quiet=True)
print(int(re.search(r"VmHWM:\\s+(\\d+) kB", Path("/proc/self/status").read_text())[1]) * 1024)
"""


def test_a_flat_build_holds_no_second_copy_of_its_index(tmp_path):
    """40,000 768-d vectors in shards of 4,096: an IndexFlat built in memory reallocates its
    vector past 32,768 rows with the old and the new copy both resident (peak ~1.8x its 123 MB).
    The build's peak, less a 100-passage build's (the interpreter and its libraries), stays
    within the index's bytes plus one shard plus 10%."""

    def peak(count: int) -> int:
        source = corpus(tmp_path / f"c{count}.jsonl", count)
        argv = [str(source), str(tmp_path / f"index{count}"), "4096"]
        done = subprocess.run(
            [sys.executable, "-c", PEAK, *argv], cwd=ROOT, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        return int(done.stdout.split()[-1])

    index_bytes, shard_bytes = 40_000 * 768 * 4, 4_096 * 768 * 4
    grown = peak(40_000) - peak(100)
    assert grown <= 1.1 * (index_bytes + shard_bytes), f"{grown / 2**20:.0f} MiB"


def interrupted(source: Path, out: Path, shard_size: int) -> None:
    """A build of `source` stopped after its first shard reached the disk."""

    def stop(*args):
        write(*args)
        raise KeyboardInterrupt

    write = shards.write_shard
    shards.write_shard = stop
    try:
        with pytest.raises(KeyboardInterrupt):
            build(str(source), str(out), ENCODER, shard_size=shard_size, quiet=True)
    finally:
        shards.write_shard = write
    assert [p.name for p in work_dir(out).iterdir()] == ["shard-000000.bin"]


@pytest.mark.parametrize("first, then", [(100, 50), (50, 100)])
def test_resuming_with_another_shard_size_is_refused_before_any_work(
    tmp_path, monkeypatch, capsys, first, then
):
    """Shard 0 starts at row 0 whatever the size: a smaller size took it whole (ntotal above the
    passage count, "indexed" printed, the index refused at load), a larger one indexed rows
    that do not exist (IndexError after the whole faiss build)."""
    source = corpus(tmp_path / "c.jsonl", 250)
    out = tmp_path / "index"
    interrupted(source, out, first)
    loads, load = [], shards.encode_shards.__globals__["load_encoder"]
    monkeypatch.setitem(
        shards.encode_shards.__globals__,
        "load_encoder",
        lambda *args, **kwargs: loads.append(args) or load(*args, **kwargs),
    )
    argv = ["--corpus", str(source), "--out", str(out), "--encoder", ENCODER, "--resume"]
    assert build_main([*argv, "--shard-size", str(then)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"shard-000000.bin was encoded with --shard-size {first}, this build has" in err
    assert f"resume with --shard-size {first}" in err
    assert loads == [] and not out.exists()
    assert [p.name for p in work_dir(out).iterdir()] == ["shard-000000.bin"]
    monkeypatch.undo()
    assert build_main([*argv, "--shard-size", str(first)]) == 0
    assert PassageIndex.load(out).meta.count == 250


def test_a_shard_without_its_size_is_refused_when_its_count_disagrees(tmp_path, capsys):
    """Shards written before the size was kept: a count that does not fit the shard is refused."""
    source = corpus(tmp_path / "c.jsonl", 250)
    out = tmp_path / "index"
    interrupted(source, out, 50)
    path = shard_path(work_dir(out), 0)
    header, offset = read_header(path)
    vectors = np.fromfile(path, np.float32, offset=offset).reshape(50, 32)
    shards.write_shard(path, dataclasses.replace(header, shard_size=None), vectors)
    argv = ["--corpus", str(source), "--out", str(out), "--encoder", ENCODER, "--resume"]
    assert build_main([*argv, "--shard-size", "100"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds 50 passages, this corpus's shard 0" in err
    assert not out.exists()


@pytest.mark.parametrize("change", ["appended", "truncated"])
def test_a_corpus_changed_during_the_build_leaves_no_index(tmp_path, monkeypatch, capsys, change):
    source = corpus(tmp_path / "c.jsonl", 250)
    encode = build_module.encode

    def then_change(*args):
        count = encode(*args)
        lines = source.read_text().splitlines(keepends=True)
        extra = '{"id": "late", "contents": "late"}\n'
        source.write_text("".join([*lines, extra] if change == "appended" else lines[:-1]))
        return count

    monkeypatch.setattr(build_module, "encode", then_change)
    out = tmp_path / "index"
    argv = ["--corpus", str(source), "--out", str(out), "--encoder", ENCODER, "--shard-size", "100"]
    assert build_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "changed during the build" in err
    assert not out.exists()  # and no half directory beside it: the shards only
    assert sorted(p.name for p in tmp_path.iterdir()) == [".index.build", "c.jsonl"]
