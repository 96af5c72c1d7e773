"""Where an index searches: the fit of fp16 / sharded placements, and the one-line refusal."""

import pytest

from retrieval.gpu import GIB, GpuOptions, GpuPlan, index_gpu_bytes, plan_gpus

WIKI18 = 21_015_324  # passages of wiki-18.jsonl


def test_wiki18_flat_fits_eight_80gb_cards_sharded_in_fp16():
    assert index_gpu_bytes("flat", WIKI18, 768, 0, fp16=True) == WIKI18 * 768 * 2
    plan = plan_gpus("flat", WIKI18, 768, 0, [79 * GIB] * 8, GpuOptions())
    assert isinstance(plan, GpuPlan) and plan.gpus == 8
    assert plan.bytes_per_gpu == -(-WIKI18 * 768 * 2 // 8) + 2 * GIB  # 3.8 GiB of vectors each
    assert plan.note == "shard, fp16, 8 GPUs"


def test_what_does_not_fit_is_refused_in_one_line():
    replicated = plan_gpus(
        "flat", WIKI18, 768, 0, [79 * GIB, 40 * GIB], GpuOptions(mode="replicate", fp16=False)
    )
    assert replicated == (
        "the flat index of 21015324 x 768 needs 62.1 GiB per GPU (replicate, fp32, 2 GPUs, "
        "2.0 GiB of it faiss's scratch) but GPU 1 has 40.0 GiB free: use more GPUs "
        "(retrieval.gpu: shard), fp16 (retrieval.gpu_fp16: true), index ivf_pq, or "
        "retrieval.gpu: off to search on the CPU"
    )
    # One 40 GB card holds it in fp16 (30 GiB) but not in fp32 (60 GiB).
    assert isinstance(plan_gpus("flat", WIKI18, 768, 0, [39 * GIB], GpuOptions()), GpuPlan)
    assert isinstance(plan_gpus("flat", WIKI18, 768, 0, [39 * GIB], GpuOptions(fp16=False)), str)


@pytest.mark.parametrize(
    "kind, free, options, gpus",
    [
        ("hnsw", [79 * GIB], GpuOptions(), 0),  # no faiss-gpu HNSW
        ("flat", [79 * GIB], GpuOptions(mode="off"), 0),
        ("flat", [], GpuOptions(), 0),  # no GPU (this machine)
        ("ivf_pq", [8 * GIB], GpuOptions(), 1),  # the compressed kind: the file's bytes
    ],
)
def test_the_cpu_is_chosen_where_gpus_cannot_or_should_not_search(kind, free, options, gpus):
    plan = plan_gpus(kind, WIKI18, 768, WIKI18 * 64, free, options)
    assert isinstance(plan, GpuPlan) and plan.gpus == gpus
