"""The moments a coordinator gives the streams it turns away (agent_calls.Admission): spaced
at the rate streams are being taken, never closer than its floor allows, never too far.
On a clock of the test's own: the spacing is arithmetic, not a race with a loaded machine."""

import itertools

import pytest

from campugrid.coordinator.agent_calls import Admission


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_turned_away_streams_are_spaced_at_the_rate_streams_are_taken():
    clock = Clock()
    admission = Admission(clock)
    for _ in range(800):  # 800 within its window: 400 a second
        admission.taken()
        clock.now += 0.002
    moments = []
    for _ in range(4):  # each refusal 1 ms after the last
        moments.append(clock.now + admission.retry_after())
        clock.now += 0.001
    assert [b - a for a, b in itertools.pairwise(moments)] == pytest.approx([1 / 400] * 3)
    quiet = Admission(clock)  # nothing taken lately: the floor's rate
    first, second = quiet.retry_after(), quiet.retry_after()
    assert second - first == pytest.approx(1 / Admission.FLOOR_PER_S)


def test_a_moment_given_out_is_not_given_again_after_a_pause():
    clock = Clock()
    admission = Admission(clock)
    later = admission.retry_after()
    clock.now += 10 * later  # past that moment: the next is counted from now, not from it
    assert admission.retry_after() == pytest.approx(1 / Admission.FLOOR_PER_S)


def test_no_stream_is_told_to_wait_longer_than_the_most():
    admission = Admission(Clock())
    told = [admission.retry_after() for _ in range(int(Admission.FLOOR_PER_S * Admission.MOST_S) + 50)]
    assert max(told) == pytest.approx(Admission.MOST_S)
