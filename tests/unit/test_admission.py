"""The moments a coordinator gives the streams it turns away (agent_calls.Admission): spaced
at AHEAD times the rate the process can take streams (what one core takes at what a stream
has cost it lately, at least the rate streams are being taken), never closer than its floor
allows, never too far; and how many may wait in line meanwhile. On clocks of the test's own (time, and the process's CPU time): the spacing
is arithmetic, not a race with a loaded machine."""

import itertools

import pytest

from campugrid.coordinator.agent_calls import Admission


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_turned_away_streams_are_spaced_at_the_rate_streams_are_taken():
    clock, cpu = Clock(), Clock()
    admission = Admission(clock, cpu)
    for _ in range(800):  # 800 within its window: 400 a second, each costing 5 ms of CPU
        admission.taken()
        clock.now += 0.002
        cpu.now += 0.005  # (one core would take 200 a second: more are being taken)
    moments = []
    for _ in range(4):  # each refusal 1 ms after the last
        moments.append(clock.now + admission.retry_after())
        clock.now += 0.001
    assert [b - a for a, b in itertools.pairwise(moments)] == pytest.approx([1 / (Admission.AHEAD * 400)] * 3)
    quiet = Admission(clock, cpu)  # nothing taken lately: the floor's rate
    first, second = quiet.retry_after(), quiet.retry_after()
    assert second - first == pytest.approx(1 / (Admission.AHEAD * Admission.FLOOR_PER_S))


def test_a_moment_given_out_is_not_given_again_after_a_pause():
    clock = Clock()
    admission = Admission(clock)
    later = admission.retry_after()
    clock.now += 10 * later  # past that moment: the next is counted from now, not from it
    assert admission.retry_after() == pytest.approx(1 / (Admission.AHEAD * Admission.FLOOR_PER_S))


def test_no_stream_is_told_to_wait_longer_than_the_most():
    admission = Admission(Clock())
    told = [admission.retry_after() for _ in range(int(Admission.AHEAD * Admission.FLOOR_PER_S * Admission.MOST_S) + 50)]
    assert max(told) == pytest.approx(Admission.MOST_S)


@pytest.mark.parametrize(("taken_per_s", "cpu_ms", "spaced_per_s"), [
    (150, 1.0, 1000),  # 150 taken a second, each 1 ms of CPU: one core takes 1,000
    (250, 10.0, 250),  # 10 ms each: one core takes 100, fewer than are being taken
    (50, 20.0, Admission.FLOOR_PER_S),  # neither reaches the floor
])
def test_turned_away_streams_are_spaced_at_what_one_core_takes_at_their_cost(
        taken_per_s, cpu_ms, spaced_per_s):
    clock, cpu = Clock(), Clock()
    admission = Admission(clock, cpu)
    for _ in range(int(taken_per_s * Admission.WINDOW_S)):
        admission.taken()
        clock.now += 1 / taken_per_s
        cpu.now += cpu_ms / 1000
    first, second = admission.retry_after(), admission.retry_after()
    assert second - first == pytest.approx(1 / (Admission.AHEAD * spaced_per_s), rel=0.02)


def test_a_few_streams_taken_are_not_enough_to_trust_their_cost():
    clock, cpu = Clock(), Clock()
    admission = Admission(clock, cpu)
    for _ in range(Admission.SAMPLE - 1):  # cheap, but too few to say what a join costs
        admission.taken()
        clock.now += 0.01
        cpu.now += 0.0001
    first, second = admission.retry_after(), admission.retry_after()
    assert second - first == pytest.approx(1 / (Admission.AHEAD * Admission.FLOOR_PER_S))
    clock.now += 3 * Admission.WINDOW_S  # and what was taken long ago says nothing
    admission.taken()
    assert admission.rate() == Admission.FLOOR_PER_S


def test_the_line_holds_what_is_being_taken_in_line_s_and_what_the_floor_takes_at_least():
    clock = Clock()
    admission = Admission(clock)
    least = int(Admission.FLOOR_PER_S * Admission.LINE_S)
    assert admission.line() == least  # nothing taken yet (a start): what the floor takes
    for _ in range(1200):  # 600 a second over the window
        admission.taken()
        clock.now += 1 / 600
    assert admission.line() == pytest.approx(600 * Admission.LINE_S, abs=1)
    clock.now += 3 * Admission.WINDOW_S
    assert admission.line() == least
