import asyncio
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from buffers.group_buffer import GroupBuffer
from buffers.records import to_arrow
from buffers.spill import ParquetSpill
from buffers.testing import synthetic_trajectory as traj
from learner.advantages import stratified_advantages
from pipeline.evaluation.replay import main


def write_run(run_dir, groups=12, group_size=4, incomplete=2, seed=0):
    """A run directory as the buffer leaves it: released groups plus a few never completed."""

    async def fill():
        spill = ParquetSpill(run_dir / "trajectories", rows_per_file=10)
        buffer = GroupBuffer(group_size, max_staleness=5, spill=spill)
        rng = random.Random(seed)
        arrivals = [(p, i) for p in range(groups) for i in range(group_size)]
        arrivals += [(groups + p, 0) for p in range(incomplete)]
        rng.shuffle(arrivals)
        for p, i in arrivals:
            calls = rng.randint(0, 3)
            reward = float(rng.random() < 0.2 + 0.2 * calls)
            await buffer.put(
                traj(
                    f"q{p}", i, version=p // 3, reward=reward, tool_names=["search"] * calls, seed=p
                )
            )
        for _ in range(groups):
            await buffer.next_group(current_version=groups // 3)
        await buffer.close()

    asyncio.run(fill())
    (run_dir / "config.yaml").write_text(
        f"buffer:\n  group_size: {group_size}\nlearner:\n  alpha: 0.6\n"
    )


def test_replay_equals_advantages_computed_directly(tmp_path, capsys):
    write_run(tmp_path)
    out = tmp_path / "adv.parquet"
    assert main([str(tmp_path), "--alpha", "0.7", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "12 complete groups of 4, 2 incomplete groups skipped" in printed
    replayed = pq.read_table(out)
    assert {"prompt_id", "sample_index", "stratum", "reward", "advantage"} <= set(
        replayed.column_names
    )
    assert replayed.num_rows == 48

    spilled = pq.read_table(tmp_path / "trajectories").filter(
        pa.compute.field("status") == "released"
    )
    prompts = spilled["prompt_id"].to_pylist()
    ids = {p: i for i, p in enumerate(sorted(set(prompts)))}
    direct = stratified_advantages(
        torch.tensor(spilled["reward"].to_numpy(), dtype=torch.float64),
        torch.tensor([ids[p] for p in prompts]),
        torch.tensor(spilled["stratum"].to_numpy(), dtype=torch.int64),
        alpha=0.7,
    )
    expected = {
        (p, s): a
        for p, s, a in zip(
            prompts, spilled["sample_index"].to_pylist(), direct.tolist(), strict=True
        )
    }
    got = {
        (p, s): a
        for p, s, a in zip(
            replayed["prompt_id"].to_pylist(),
            replayed["sample_index"].to_pylist(),
            replayed["advantage"].to_pylist(),
            strict=True,
        )
    }
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=1e-6)


def test_per_stratum_table_and_plot(tmp_path, capsys):
    write_run(tmp_path)
    plot = tmp_path / "plot.png"
    assert main([str(tmp_path), "--alpha", "1", "--plot", str(plot)]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["stratum", "count"])
    rows = [
        line.split() for line in lines[header + 1 :] if line.split() and line.split()[0].isdigit()
    ]
    assert sum(int(r[1]) for r in rows) == 48
    for r in rows:  # pure SAN: unit variance in every cell whose rewards vary
        assert r[3] in ("1.0000", "nan")
        assert float(r[5]) == float(r[0])  # recorded stratum = tool calls
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_recomputed_strata(tmp_path, capsys):
    write_run(tmp_path)
    assert (
        main(
            [
                str(tmp_path),
                "--stratifier",
                "random",
                "--k",
                "3",
                "--out",
                str(tmp_path / "r.parquet"),
            ]
        )
        == 0
    )
    assert set(pq.read_table(tmp_path / "r.parquet")["stratum"].to_pylist()) <= {0, 1, 2}
    assert main([str(tmp_path), "--stratifier", "tool_signature"]) == 0


def test_files_from_another_writer(tmp_path, capsys):
    # Someone else's file: int64 columns, no status / consumed_version / tool_names.
    table = pa.Table.from_batches([to_arrow([traj("x", i, reward=float(i)) for i in range(3)])])
    table = table.drop_columns(["tool_names"])
    table = table.set_column(
        table.schema.get_field_index("sample_index"),
        "sample_index",
        table["sample_index"].cast(pa.int64()),
    )
    (tmp_path / "trajectories").mkdir()
    pq.write_table(table, tmp_path / "trajectories" / "theirs.parquet")
    out = tmp_path / "o.parquet"
    assert main([str(tmp_path), "--out", str(out)]) == 0
    assert pq.read_table(out)["advantage"].to_pylist() == pytest.approx(
        stratified_advantages(
            torch.tensor([0.0, 1.0, 2.0]),
            torch.zeros(3, dtype=torch.int64),
            torch.ones(3, dtype=torch.int64),
        ).tolist(),
        abs=1e-6,
    )
    assert main([str(tmp_path), "--stratifier", "tool_signature"]) == 2
    assert "needs the tool_names column" in capsys.readouterr().err


def test_bad_files_stop_with_one_line_unless_skipped(tmp_path, capsys):
    write_run(tmp_path)
    corrupt = tmp_path / "trajectories" / "zz-corrupt.parquet"
    corrupt.write_bytes(b"PAR1 this is not parquet")
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "zz-corrupt.parquet: not a readable Parquet file" in err
    out = tmp_path / "adv.parquet"
    assert main([str(tmp_path), "--skip-bad", "--out", str(out)]) == 0
    assert "skipped" in capsys.readouterr().err and pq.read_table(out).num_rows == 48
    corrupt.unlink()

    foreign = tmp_path / "trajectories" / "zz-foreign.parquet"
    pq.write_table(pa.table({"prompt_id": ["a"], "reward": [1.0]}), foreign)
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "zz-foreign.parquet: missing column 'sample_index'" in err
    foreign.unlink()

    wrong = tmp_path / "trajectories" / "zz-wrong.parquet"
    table = pa.Table.from_batches([to_arrow([traj("w", 0)])])
    table = table.set_column(table.schema.get_field_index("reward"), "reward", pa.array(["high"]))
    pq.write_table(table, wrong)
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "zz-wrong.parquet: column 'reward'" in err


def test_a_run_spilled_before_the_latent_reward_columns_replays(tmp_path, capsys):
    """Every file rewritten to the earlier schema (no first_answer_turn, first_answer_token,
    latent_reward): it replays as the run did, and a corrupt file beside it is the one named."""
    from buffers.reader import read_trajectories
    from buffers.records import ADDED_LATER, from_arrow

    write_run(tmp_path)
    out = tmp_path / "now.parquet"
    assert main([str(tmp_path), "--alpha", "0.6", "--out", str(out)]) == 0
    for path in sorted((tmp_path / "trajectories").glob("*.parquet")):
        pq.write_table(pq.read_table(path).drop_columns(list(ADDED_LATER)), path)
    corrupt = tmp_path / "trajectories" / "zz-corrupt.parquet"
    corrupt.write_bytes(b"PAR1 this is not parquet")
    old = tmp_path / "old.parquet"
    capsys.readouterr()
    assert main([str(tmp_path), "--alpha", "0.6", "--out", str(old)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "zz-corrupt.parquet: not a readable Parquet file" in err
    assert not old.exists()
    corrupt.unlink()
    assert main([str(tmp_path), "--alpha", "0.6", "--out", str(old)]) == 0
    assert pq.read_table(old).equals(pq.read_table(out))
    table, _ = read_trajectories(tmp_path / "trajectories", list(ADDED_LATER))
    assert table.num_rows == 50 and table.to_pydict() == {
        k: [v] * 50 for k, v in ADDED_LATER.items()
    }
    earlier = pq.read_table(tmp_path / "trajectories")
    assert [t.latent_reward for t in from_arrow(earlier)] == [0.0] * 50


def test_no_partial_output_on_failure(tmp_path, capsys):
    assert main([str(tmp_path / "absent")]) == 2
    assert "run directory not found" in capsys.readouterr().err
    (tmp_path / "trajectories").mkdir()
    out = tmp_path / "adv.parquet"
    assert main([str(tmp_path), "--out", str(out)]) == 2
    assert "no trajectories" in capsys.readouterr().err
    assert not out.exists()


def test_group_size_is_inferred_without_a_config(tmp_path, capsys):
    write_run(tmp_path, group_size=3)
    (tmp_path / "config.yaml").unlink()
    assert main([str(tmp_path)]) == 0
    assert "12 complete groups of 3, 2 incomplete groups skipped" in capsys.readouterr().out


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "mc_grpo"])
def test_replay_recomputes_any_estimator(tmp_path, capsys, estimator):
    from learner.estimators import estimate

    write_run(tmp_path, group_size=5)  # odd: mc_grpo leaves each group's pivot out of the loss
    out = tmp_path / "adv.parquet"
    assert main([str(tmp_path), "--estimator", estimator, "--out", str(out)]) == 0
    assert f"estimator {estimator}," in capsys.readouterr().out
    replayed = pq.read_table(out)
    prompts = replayed["prompt_id"].to_pylist()
    ids = {p: i for i, p in enumerate(sorted(set(prompts)))}
    direct = estimate(
        estimator,
        torch.tensor(replayed["reward"].to_numpy(), dtype=torch.float64),
        torch.tensor([ids[p] for p in prompts]),
        torch.tensor(replayed["stratum"].to_numpy(), dtype=torch.int64),
    )
    assert replayed["advantage"].to_pylist() == pytest.approx(direct.advantages.tolist(), abs=1e-6)
    assert replayed["in_loss"].to_pylist() == direct.keep.tolist()
    if estimator == "mc_grpo":
        assert replayed["in_loss"].to_pylist().count(False) == 12  # one pivot per group
