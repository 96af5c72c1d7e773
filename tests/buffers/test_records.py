import contextlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from buffers import native
from buffers.records import (
    TRAJECTORY_SCHEMA,
    Group,
    InvalidTrajectory,
    Trajectory,
    from_arrow,
    to_arrow,
)
from buffers.testing import synthetic_trajectory

TOKEN_FIELDS = ("prompt_token_ids", "token_ids", "loss_mask", "behavior_logprobs", "token_versions")
PLAIN_FIELDS = (
    "prompt_id",
    "sample_index",
    "data_source",
    "question",
    "ground_truth",
    "tool_names",
    "stratum",
    "reward",
    "finish_reason",
    "text",
    "actor_id",
    "created_at",
    "policy_version",
    "num_tool_calls",
)


def assert_same(a, b):
    for name in TOKEN_FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name
    for name in PLAIN_FIELDS:
        assert getattr(a, name) == getattr(b, name), name


def test_arrow_round_trip_is_exact():
    trajectories = [
        synthetic_trajectory(
            "p", 0, tokens=50, version=3, reward=0.25, tool_names=["search", "python"]
        ),
        synthetic_trajectory("p", 1, tokens=1, tool_names=[], reward=-1.5),
        synthetic_trajectory("q", 0, tokens=700, version=11, tool_names=["search"] * 3),
    ]
    batch = to_arrow(trajectories)
    assert batch.schema == TRAJECTORY_SCHEMA
    assert batch.column("token_ids").type == pa.list_(pa.int32())  # list columns, not Python lists
    assert batch.column("policy_version").to_pylist() == [3, 0, 11]
    assert batch.column("num_tool_calls").to_pylist() == [2, 0, 3]
    back = from_arrow(batch)
    for a, b in zip(trajectories, back, strict=True):
        assert_same(a, b)
    # Through a table and Parquet-like chunking too.
    table = pa.Table.from_batches([batch.slice(0, 1), batch.slice(1)])
    for a, b in zip(trajectories, from_arrow(table), strict=True):
        assert_same(a, b)


def test_policy_version_is_the_oldest_generated_token():
    assert synthetic_trajectory("p", 0, tokens=20, version=9).policy_version == 9
    mixed = synthetic_trajectory("p", 0, tokens=20, version=9)
    mixed.token_versions[0] = 4  # weights changed mid-trajectory: first tokens are older
    assert mixed.policy_version == 4


@pytest.mark.parametrize(
    "breakage, message",
    [
        (lambda t: setattr(t, "loss_mask", t.loss_mask[:-1]), "differ in length"),
        (lambda t: setattr(t, "behavior_logprobs", t.behavior_logprobs[1:]), "differ in length"),
        (lambda t: t.token_versions.__setitem__(0, -3), "negative policy version -3"),
        (lambda t: t.token_versions.__setitem__(0, -1), "token_versions must be >= 0"),
        (
            lambda t: t.token_versions.__setitem__(np.flatnonzero(t.loss_mask == 0)[0], 5),
            "-1 on observations",
        ),
        (lambda t: t.loss_mask.__setitem__(0, 2), "other than 0 and 1"),
        (lambda t: t.loss_mask.__setitem__(0, -1), "other than 0 and 1"),
        (lambda t: t.loss_mask.__setitem__(slice(None), 0), "no token was generated"),
        (lambda t: t.behavior_logprobs.__setitem__(0, np.nan), "finite and <= 0"),
        (lambda t: t.behavior_logprobs.__setitem__(0, -np.inf), "finite and <= 0"),
        (lambda t: t.behavior_logprobs.__setitem__(0, 0.5), "finite and <= 0"),
        (lambda t: setattr(t, "reward", float("nan")), "not finite"),
        (lambda t: setattr(t, "prompt_id", ""), "empty prompt_id"),
        (lambda t: setattr(t, "sample_index", -1), "negative sample_index"),
        (lambda t: setattr(t, "stratum", -4), r"stratum -4 outside \[0, 65536\)"),
        (lambda t: setattr(t, "stratum", 1 << 16), "stratum 65536 outside"),
        (lambda t: setattr(t, "prompt_token_ids", t.prompt_token_ids[:0]), "no prompt tokens"),
    ],
)
@pytest.mark.parametrize(
    "path",
    [
        pytest.param(
            "C", marks=pytest.mark.skipif(native.TOKENS.get() is None, reason="no C compiler here")
        ),
        "numpy",
    ],
)
def test_validate_names_the_broken_invariant(breakage, message, path):
    t = synthetic_trajectory("p", 0, tokens=30)
    with native.TOKENS.disabled() if path == "numpy" else contextlib.nullcontext():
        t.validate()
        breakage(t)
        with pytest.raises(InvalidTrajectory, match=message):
            t.validate()


def test_lists_become_typed_arrays():
    t = synthetic_trajectory("p", 0)
    u = Trajectory(
        prompt_id="p",
        sample_index=0,
        prompt_token_ids=[7],
        token_ids=[1, 2],
        loss_mask=[1, 1],
        behavior_logprobs=[-0.5, -0.25],
        token_versions=[0, 0],
        reward=1.0,
    )
    assert u.token_ids.dtype == np.int32 and u.loss_mask.dtype == np.int8
    u.validate()
    assert t.nbytes > t.token_ids.nbytes


def test_group_views_and_lazy_batch():
    members = tuple(synthetic_trajectory("g", i, reward=float(i), version=5 + i) for i in range(3))
    group = Group("g", members)
    assert group.size == 3 and group.policy_version == 5
    assert group.rewards.tolist() == [0.0, 1.0, 2.0]
    assert group.batch.num_rows == 3 and group.batch is group.batch
    for a, b in zip(members, from_arrow(group.batch), strict=True):
        assert_same(a, b)


def test_first_answer_and_latent_reward_round_trip_and_old_files_read_without_them():
    from buffers.records import from_arrow, to_arrow

    t = synthetic_trajectory("p", 0, tokens=20)
    t.first_answer_turn, t.first_answer_token, t.latent_reward = 1, 7, 0.25
    t.validate()
    (back,) = from_arrow(to_arrow([t]))
    assert (back.first_answer_turn, back.first_answer_token, back.latent_reward) == (1, 7, 0.25)
    old = to_arrow([t]).drop_columns(["first_answer_turn", "first_answer_token", "latent_reward"])
    (read,) = from_arrow(old)  # a file written before the columns existed
    assert (read.first_answer_turn, read.first_answer_token, read.latent_reward) == (-1, -1, 0.0)
    t.first_answer_token = -1  # a turn without its token index
    with pytest.raises(InvalidTrajectory, match="first_answer_turn 1 / first_answer_token -1"):
        t.validate()


def test_reward_components_round_trip_through_the_spill_and_old_files_read_without_them(tmp_path):
    """The reward's named parts (a weighted actors.reward, a dict reward) are kept per row; a
    file written before the column existed reads as no components, by both readers."""
    from buffers.reader import read_trajectories
    from buffers.spill import ParquetSpill

    parts = {"judge/correct": 1.0, "judge/tools": 0.25, "format": 0.0}
    t = synthetic_trajectory("p", 0, tokens=20)
    t.reward_components = dict(parts)
    plain = synthetic_trajectory("p", 1, tokens=20)
    t.validate()
    spill = ParquetSpill(tmp_path / "spill")
    spill.append([t, plain], "released")
    spill.close()
    back = from_arrow(pq.read_table(tmp_path / "spill"))
    assert [b.reward_components for b in back] == [parts, {}]
    table, _ = read_trajectories(tmp_path / "spill", ["reward_components"])
    assert [dict(p) for p in table["reward_components"].to_pylist()] == [parts, {}]

    old = tmp_path / "old"
    old.mkdir()
    written = pa.Table.from_batches([to_arrow([t])]).drop_columns(["reward_components"])
    pq.write_table(written, old / "part-000001.parquet")
    assert from_arrow(pq.read_table(old))[0].reward_components == {}
    table, _ = read_trajectories(old, ["reward_components"])
    assert table["reward_components"].to_pylist() == [[]]

    t.reward_components = {"judge": float("nan")}
    with pytest.raises(InvalidTrajectory, match=r"reward_components .* are not all finite"):
        t.validate()


def test_segments_round_trip_and_old_files_read_as_one_segment(tmp_path):
    """An agent that rewrote its history trains its last segment and says how many it had
    (issue 70); a file written before the column existed reads as one segment, by both readers."""
    from buffers.reader import read_trajectories
    from buffers.spill import ParquetSpill

    t = synthetic_trajectory("p", 0, tokens=20)
    t.segments = 3
    t.validate()
    (back,) = from_arrow(to_arrow([t]))
    assert back.segments == 3
    assert synthetic_trajectory("p", 1, tokens=20).segments == 1

    old = tmp_path / "old"
    old.mkdir()
    written = pa.Table.from_batches([to_arrow([t])]).drop_columns(["segments"])
    pq.write_table(written, old / "part-000001.parquet")
    assert from_arrow(pq.read_table(old))[0].segments == 1
    table, _ = read_trajectories(old, ["segments"])
    assert table["segments"].to_pylist() == [1]
    spill = ParquetSpill(tmp_path / "spill")
    spill.append([t], "released")
    spill.close()
    table, _ = read_trajectories(tmp_path / "spill", ["segments"])
    assert table["segments"].to_pylist() == [3]

    t.segments = 0
    with pytest.raises(InvalidTrajectory, match="segments 0 must be >= 1"):
        t.validate()
