"""The moments a coordinator gives the streams it turns away (agent_calls.Admission): spaced
at the rate streams are being taken, never closer than its floor allows, never too far."""

import itertools

from campugrid.coordinator.agent_calls import Admission


def test_turned_away_streams_are_spaced_at_the_rate_streams_are_taken():
    admission = Admission()
    for _ in range(800):  # 400 a second over its window
        admission.taken()
    moments = [admission.retry_after() for _ in range(4)]
    gaps = [b - a for a, b in itertools.pairwise(moments)]
    assert all(0.002 < g <= 0.0025 for g in gaps), gaps  # 1/400 s apart (less the calls' own time)
    quiet = Admission()  # nothing taken lately: the floor's rate
    first, second = quiet.retry_after(), quiet.retry_after()
    assert abs((second - first) - 1 / Admission.FLOOR_PER_S) < 0.001


def test_no_stream_is_told_to_wait_longer_than_the_most():
    admission = Admission()
    told = [admission.retry_after() for _ in range(int(Admission.FLOOR_PER_S * Admission.MOST_S) + 50)]
    assert max(told) <= Admission.MOST_S + 0.01
