"""The queue of streams waiting to join, and the moments a coordinator gives the streams it
turns away (agent_calls.Admission): spaced at the rate streams are being taken, after those
waiting, never closer than its floor allows, never too far.
On a clock of the test's own: the spacing is arithmetic, not a race with a loaded machine."""

import asyncio
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


def test_streams_wait_first_come_first_served_while_the_queue_can_be_taken_soon():
    async def scenario() -> None:
        clock = Clock()
        admission = Admission(clock)  # nothing taken lately: the floor's rate
        most = int(Admission.FLOOR_PER_S * Admission.QUEUE_S)
        places = []
        while admission.may_wait():
            places.append(admission.turn())
        assert len(places) == most  # QUEUE_S of them at the rate
        # One more is turned away, told to come back once those waiting have been taken.
        assert admission.retry_after() == pytest.approx((most + 1) / Admission.FLOOR_PER_S)
        places[0].cancel()  # its agent gave up: the next is let in instead
        assert admission.wake() and places[1].done() and not places[2].done()
        assert admission.waiting == most - 2
        while admission.wake():
            pass
        assert all(p.done() for p in places) and admission.waiting == 0
        assert not admission.wake()

    asyncio.run(scenario())
