import asyncio
import json

import pyarrow.parquet as pq
import pytest

from buffers.testing import synthetic_trajectory as traj
from pipeline.config.schema import BufferConfig
from pipeline.runtime.parts import make_buffer


def test_buffer_from_config_spills_into_the_run_dir(tmp_path):
    config = BufferConfig(group_size=2, max_staleness=1, max_groups_in_flight=3, max_resident_mb=2)

    async def scenario():
        buffer = make_buffer(config, tmp_path)
        assert (buffer.group_size, buffer.max_staleness, buffer.max_groups_in_flight) == (2, 1, 3)
        assert buffer.max_resident_bytes == 2 * 1024 * 1024
        await buffer.put(traj("a", 0))
        await buffer.put(traj("a", 1))
        await buffer.next_group(0)
        await buffer.close()

    asyncio.run(scenario())
    assert pq.read_table(tmp_path / "trajectories").num_rows == 2


def test_no_spill_when_disabled(tmp_path):
    buffer = make_buffer(BufferConfig(spill=False), tmp_path)
    assert buffer.spill is None and not (tmp_path / "trajectories").exists()


def test_actor_side_from_config(tmp_path):
    from actors.sglang import SGLangEngine
    from actors.tools import PythonTool, SearchTool
    from pipeline.config.schema import ActorsConfig, RetrievalConfig, StrataConfig
    from pipeline.runtime.parts import agent_settings, make_engine, make_tools

    actors = ActorsConfig(
        engine={"type": "sglang", "urls": ["http://127.0.0.1:30000"]}, tools=["search", "python"]
    )
    assert isinstance(make_engine(StrataConfig(actors=actors), tmp_path), SGLangEngine)
    tools = make_tools(actors, RetrievalConfig(topk=5), "http://127.0.0.1:8000")
    assert isinstance(tools["search"], SearchTool) and tools["search"].topk == 5
    assert (
        isinstance(tools["python"], PythonTool)
        and tools["python"].timeout_s == actors.python_timeout_s
    )
    assert agent_settings(actors).max_turns == actors.max_turns
    assert agent_settings(ActorsConfig(format_weight=0.2)).format_weight == 0.2
    with pytest.raises(ValueError, match="no retrieval server URL"):
        make_tools(actors, RetrievalConfig(), None)


def test_each_world_skew_is_its_own_cached_world(tmp_path):
    from pipeline.assets.cache import prepare_world
    from pipeline.config.schema import StrataConfig

    def world(skew=None):
        data = {"seed": 3} | ({"world_skew": skew} if skew is not None else {})
        config = StrataConfig.model_validate(
            {"data": data, "runtime": {"cache_dir": str(tmp_path)}}
        )
        return prepare_world(config, quiet=True)

    default, steep = world(), world(1.3)
    assert (default.name, steep.name) == ("world-small-seed3", "world-small-seed3-skew1.3")
    assert json.loads((steep / "world.json").read_text())["skew"] == 1.3
    assert world(0.6) == default  # the default, spelled out, is the same world


def test_the_trap_knob_is_its_own_cached_world_and_mini_gaia_only(tmp_path):
    from pipeline.assets.cache import prepare_world
    from pipeline.config.schema import StrataConfig

    data = {"seed": 3, "world_skew": 1.3, "world_chains_astray": 0.9}
    config = StrataConfig.model_validate({"data": data, "runtime": {"cache_dir": str(tmp_path)}})
    target = prepare_world(config, quiet=True)
    assert target.name == "world-small-seed3-skew1.3-astray0.9"
    assert json.loads((target / "world.json").read_text())["chains_astray"] == 0.9
    with pytest.raises(ValueError, match=r"data\.world_chains_astray shapes the mini_gaia world"):
        StrataConfig.model_validate(
            {"data": {"type": "search_r1", "train_files": ["t.parquet"], "world_chains_astray": 1}}
        )


def test_the_start_knobs_are_each_their_own_cached_world_and_mini_gaia_only(tmp_path):
    from pipeline.assets.cache import prepare_world
    from pipeline.config.schema import StrataConfig

    def world(**data):
        config = StrataConfig.model_validate(
            {"data": {"seed": 3, **data}, "runtime": {"cache_dir": str(tmp_path)}}
        )
        return prepare_world(config, quiet=True)

    chains, sharp = world(world_chain_demos=0.5), world(world_guess_sharpness=2.0)
    assert (chains.name, sharp.name) == (
        "world-small-seed3-chains0.5",
        "world-small-seed3-sharp2.0",
    )
    assert json.loads((chains / "world.json").read_text())["chain_demos"] == 0.5
    assert json.loads((sharp / "world.json").read_text())["guess_sharpness"] == 2.0
    both = world(
        world_skew=1.3, world_chains_astray=1.0, world_chain_demos=0.5, world_guess_sharpness=2.0
    )
    assert both.name == "world-small-seed3-skew1.3-astray1.0-chains0.5-sharp2.0"
    for key, value in (("world_chain_demos", 0.5), ("world_guess_sharpness", 2.0)):
        with pytest.raises(ValueError, match=rf"data\.{key} shapes the mini_gaia world"):
            StrataConfig.model_validate(
                {"data": {"type": "search_r1", "train_files": ["t.parquet"], key: value}}
            )
    for key, value in (("world_chain_demos", 1.2), ("world_guess_sharpness", -0.5)):
        with pytest.raises(ValueError, match=key):
            StrataConfig.model_validate({"data": {key: value}})
