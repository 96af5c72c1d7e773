"""buffers/tokens.c, the C check of a trajectory's token arrays, against its numpy twin."""

import contextlib
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from buffers import native
from buffers.records import InvalidTrajectory, Trajectory
from buffers.testing import synthetic_trajectory

ROOT = Path(__file__).resolve().parents[2]
needs_library = pytest.mark.skipif(
    native.TOKENS.get() is None, reason="no C compiler here: the numpy path is all there is"
)


def verdicts(t: Trajectory) -> tuple[int, int]:
    """(C verdict, numpy verdict) on the same arrays."""
    c = native.check_tokens(t.loss_mask, t.token_versions, t.behavior_logprobs)
    return c, t._check_tokens_numpy()


# Arrays near every invariant's edge: masks with stray values, versions around -1, log-probs
# around 0 and 1e-4 with NaN and infinities.
masks = st.sampled_from([0, 1, 1, 1, 2, -1])
versions = st.sampled_from([-2, -1, -1, 0, 3, 7, 2**31 - 1])
logprobs = st.sampled_from([-0.5, 0.0, -0.0, 1e-4, 2e-4, -np.inf, np.inf, np.nan, -3e38])


@needs_library
@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(masks, versions, logprobs), min_size=1, max_size=70), st.booleans())
def test_c_and_numpy_agree_on_every_array(rows, consistent):
    mask = np.array([r[0] for r in rows], np.int8)
    version = np.array([r[1] for r in rows], np.int32)
    if consistent:  # most real records: versions follow the mask
        version = np.where(mask == 1, np.abs(version) % 9, -1).astype(np.int32)
    t = Trajectory(
        "p",
        0,
        np.zeros(len(rows), np.int32),
        mask,
        np.array([r[2] for r in rows], np.float32),
        version,
        reward=0.0,
    )
    c, numpy = verdicts(t)
    assert c == numpy
    if c >= 0:  # and the version is what the lazy property finds on its own
        assert c == t.policy_version


@needs_library
def test_a_valid_record_gets_its_version_from_the_check():
    t = synthetic_trajectory("p", 0, tokens=1000, version=5)
    t.token_versions[np.flatnonzero(t.loss_mask)[:3]] = 2  # weights changed mid-trajectory
    assert verdicts(t) == (2, 2)
    t.validate()
    assert t._policy_version == 2  # found by the check, not by another pass


def test_arrays_the_c_path_cannot_take_go_to_numpy():
    t = synthetic_trajectory("p", 0, tokens=40)
    read_only = t.token_versions.copy()
    read_only.flags.writeable = False
    strided = np.repeat(t.behavior_logprobs, 2)[::2]
    assert native.check_tokens(t.loss_mask, read_only, t.behavior_logprobs) is None
    assert native.check_tokens(t.loss_mask, t.token_versions, strided) is None
    assert (
        native.check_tokens(t.loss_mask, t.token_versions.astype(np.int64), t.behavior_logprobs)
        is None
    )
    assert (
        native.check_tokens(
            t.loss_mask, t.token_versions.byteswap().view(">i4"), t.behavior_logprobs
        )
        is None
    )
    t.token_versions, t.behavior_logprobs = read_only, strided
    t.validate()  # by numpy, with the same answer
    assert t.policy_version == synthetic_trajectory("p", 0, tokens=40).policy_version


def test_disabled_means_numpy():
    t = synthetic_trajectory("p", 0, tokens=40)
    before = native.TOKENS.get()
    with native.TOKENS.disabled():
        assert native.check_tokens(t.loss_mask, t.token_versions, t.behavior_logprobs) is None
        t.validate()
    assert native.TOKENS.get() is before  # back as it was


@needs_library
def test_arrays_that_crossed_a_process_take_the_c_path():
    """Unpickled arrays (a Ray worker's trajectories) have dtype objects of their own."""
    t = pickle.loads(pickle.dumps(synthetic_trajectory("p", 0, tokens=40, version=3)))
    assert native.check_tokens(t.loss_mask, t.token_versions, t.behavior_logprobs) == 3


def test_token_arrays_must_be_1_d_on_either_path():
    t = synthetic_trajectory("p", 0, tokens=40)
    t.loss_mask = np.ones((40, 2), np.int8)
    assert native.check_tokens(t.loss_mask, t.token_versions, t.behavior_logprobs) is None
    for path in (contextlib.nullcontext(), native.TOKENS.disabled()):
        with path, pytest.raises(InvalidTrajectory, match=r"must be 1-D.*'loss_mask': \(40, 2\)"):
            t.validate()


def test_the_cached_version_is_that_of_the_arrays_last_checked():
    for path in (contextlib.nullcontext(), native.TOKENS.disabled()):
        t = synthetic_trajectory("p", 0, tokens=40, version=5)
        with path:
            t.validate()
            assert t.policy_version == 5
            t.token_versions[np.flatnonzero(t.loss_mask)[0]] = 3
            t.validate()
            assert t.policy_version == 3


def test_without_a_compiler_numpy_validates_and_says_so_once(tmp_path):
    code = (
        "from buffers import native; from buffers.testing import synthetic_trajectory as t; "
        "[t('p', i).validate() for i in range(3)]; print(native.TOKENS.get() is None)"
    )
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"), "XDG_CACHE_HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout == "True\n", done.stderr
    assert done.stderr.count("strata: trajectories are validated in numpy") == 1, done.stderr
    assert "no-such-cc" in done.stderr
