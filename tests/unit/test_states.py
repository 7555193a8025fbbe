from campugrid.protocol.states import ACTIVE, FINAL, TRANSITIONS, JobState, can_move, sources_of


def test_final_states_have_no_way_out():
    for state in FINAL:
        assert TRANSITIONS[state] == frozenset()
        assert state.final and not state.active


def test_every_state_is_listed_and_reachable_from_queued():
    assert set(TRANSITIONS) == set(JobState)
    seen, todo = {JobState.QUEUED}, [JobState.QUEUED]
    while todo:
        for nxt in TRANSITIONS[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    assert seen == set(JobState)


def test_only_a_leased_attempt_can_succeed():
    assert sources_of(JobState.SUCCEEDED) == {JobState.BUILDING, JobState.RUNNING}
    assert not can_move(JobState.QUEUED, JobState.SUCCEEDED)
    assert not can_move(JobState.CANCELLED, JobState.SUCCEEDED)


def test_expired_leases_requeue_from_both_active_states():
    assert {s for s in ACTIVE if can_move(s, JobState.QUEUED)} == ACTIVE
    assert sources_of(JobState.CANCELLED) == {JobState.QUEUED, *ACTIVE}
