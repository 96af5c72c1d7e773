import math

import pytest

from learner.schedule import decay, step_schedule, warmup
from learner.sft import Training, learning_rate


def test_rl_schedule_warms_up_then_decays_over_the_remaining_steps():
    cosine = step_schedule(warmup_steps=2, max_steps=12, kind="cosine")
    assert [cosine(0), cosine(1)] == [0.5, 1.0]  # warm-up
    assert cosine(2) == 1.0 and cosine(7) == pytest.approx(0.5) and cosine(12) == pytest.approx(0.0)
    linear = step_schedule(warmup_steps=0, max_steps=10, kind="linear")
    assert [linear(0), linear(5), linear(10), linear(20)] == [1.0, 0.5, 0.0, 0.0]
    assert step_schedule(3, 10, "constant")(9) == 1.0


def test_the_warm_start_uses_the_same_curve_with_a_floor():
    t = Training(lr=2.0, warmup_steps=4, final_lr=0.1)
    for step, progress in [(0, 0.0), (3, 0.3), (50, 0.7), (90, 1.5)]:
        expected = (
            2.0 * warmup(step, 4) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))
        )
        assert learning_rate(t, step, progress) == pytest.approx(expected)
    assert decay("cosine", 1.0, floor=0.1) == pytest.approx(0.1)
