"""The store's named transitions, on SQLite and on a real PostgreSQL."""

from __future__ import annotations

import datetime as dt
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from campugrid.coordinator.db import make_engine
from campugrid.coordinator.store import Store
from campugrid.coordinator.views import utcnow
from campugrid.protocol.errors import Conflict, IllegalTransition, NotFound, StaleAttempt
from campugrid.protocol.spec import JobSpec
from campugrid.protocol.states import JobState
from tests.support.holds import attempt
from tests.support.machines import add_machine

pytestmark = pytest.mark.integration


def submit(store: Store, client_id: str | None = None, **spec: object):
    job, _ = store.submit(JobSpec.from_dict({"client_job_id": client_id, **spec}
                                            if client_id else dict(spec)), "contexts/x.tar", "ab" * 32)
    return job


def test_a_job_goes_through_its_whole_life(store: Store):
    job = submit(store)
    assert job.state is JobState.QUEUED and job.attempt == 0
    m = add_machine(store, "m1", {})
    leased = store.claim_next(m, lease_s=30)
    assert leased is not None and leased.id == job.id
    assert leased.state is JobState.BUILDING and leased.attempt == 1 and leased.machine_id == m
    assert store.claim_next(m, lease_s=30) is None  # nothing else queued
    running = store.renew_lease(attempt(job.id, 1, m), JobState.RUNNING, lease_s=30)
    assert running.state is JobState.RUNNING
    done = store.finish(attempt(job.id, 1, m), succeeded=True, exit_code=0, reason=None, result="42",
                        output_key="outputs/x", limits={"memory": "enforced"})
    assert done.state is JobState.SUCCEEDED and done.result == "42"
    kinds = [e.kind for e in store.events(job.id)]
    assert kinds == ["submitted", "leased", "succeeded"]


def test_same_client_id_returns_the_same_job_and_a_different_spec_conflicts(store: Store):
    first = submit(store, "run-7", command=["a"])
    again, created = store.submit(JobSpec.from_dict({"client_job_id": "run-7", "command": ["a"]}),
                                  "contexts/x.tar", "ab" * 32)
    assert again.id == first.id and not created
    with pytest.raises(Conflict, match="run-7"):
        submit(store, "run-7", command=["b"])
    assert len(store.list_jobs()) == 1


def test_concurrent_retries_of_one_submit_make_one_job(store: Store):
    spec = JobSpec.from_dict({"client_job_id": "retry-me", "command": ["x"]})
    barrier = threading.Barrier(20)

    def go(_: int) -> str:
        barrier.wait()
        return store.submit(spec, "contexts/x.tar", "cd" * 32)[0].id

    with ThreadPoolExecutor(20) as pool:
        ids = set(pool.map(go, range(20)))
    assert len(ids) == 1
    assert [j.id for j in store.list_jobs()] == list(ids)


def test_concurrent_claims_never_lease_one_job_twice(store: Store):
    for _ in range(30):
        submit(store)
    machines = [add_machine(store, f"m{i}", {}) for i in range(8)]
    barrier = threading.Barrier(len(machines))

    def drain(machine: str) -> list[str]:
        barrier.wait()
        got = []
        while (job := store.claim_next(machine, lease_s=60)) is not None:
            got.append(job.id)
        return got

    with ThreadPoolExecutor(len(machines)) as pool:
        claimed = [j for batch in pool.map(drain, machines) for j in batch]
    assert len(claimed) == 30 and len(set(claimed)) == 30


def test_a_stale_attempt_is_refused_and_recorded(store: Store):
    job = submit(store, max_attempts=3)
    m1 = add_machine(store, "lost", {})
    m2 = add_machine(store, "fresh", {})
    store.claim_next(m1, lease_s=30)
    assert store.requeue_expired(utcnow() + dt.timedelta(seconds=31)) == [job.id]
    second = store.claim_next(m2, lease_s=30)
    assert second is not None and second.attempt == 2
    with pytest.raises(StaleAttempt, match="current attempt is 2"):
        store.finish(attempt(job.id, 1, m1), succeeded=True, exit_code=0, reason=None, result="late",
                     output_key=None, limits={})
    with pytest.raises(StaleAttempt):
        store.renew_lease(attempt(job.id, 1, m1), JobState.RUNNING, 30)
    with pytest.raises(StaleAttempt):
        store.append_logs(attempt(job.id, 1, m1), "run", 1, "late log")
    after = store.get(job.id)
    assert after.state is JobState.BUILDING and after.attempt == 2 and after.result is None
    refused = [e for e in store.events(job.id) if e.kind == "refused"]
    assert len(refused) == 3 and all(e.attempt == 1 for e in refused)
    assert "complete from attempt 1 refused" in refused[0].detail


def test_expiry_uses_up_attempts_then_fails_with_the_history(store: Store):
    job = submit(store, max_attempts=2)
    m = add_machine(store, "flaky", {})
    later = utcnow()
    for _ in range(2):
        assert store.claim_next(m, lease_s=1) is not None
        later += dt.timedelta(seconds=5)
        store.requeue_expired(later)
    failed = store.get(job.id)
    assert failed.state is JobState.FAILED
    assert "all 2 attempts used" in (failed.reason or "")
    assert [e.kind for e in store.events(job.id)].count("lease_expired") == 2


def test_a_live_lease_is_not_expired(store: Store):
    job = submit(store)
    m = add_machine(store, "m", {})
    store.claim_next(m, lease_s=30)
    assert store.requeue_expired() == []
    assert store.get(job.id).state is JobState.BUILDING


def test_cancel_stops_renewal_and_refuses_completion(store: Store):
    job = submit(store)
    m = add_machine(store, "m", {})
    store.claim_next(m, lease_s=30)
    assert store.cancel(job.id).state is JobState.CANCELLED
    with pytest.raises(IllegalTransition, match="cancelled"):
        store.renew_lease(attempt(job.id, 1, m), JobState.RUNNING, 30)
    with pytest.raises(IllegalTransition):
        store.finish(attempt(job.id, 1, m), succeeded=True, exit_code=0, reason=None, result=None,
                     output_key=None, limits={})
    with pytest.raises(IllegalTransition, match="already cancelled"):
        store.cancel(job.id)


def test_another_machine_cannot_complete_an_attempt_it_does_not_hold(store: Store):
    job = submit(store)
    m = add_machine(store, "holder", {})
    thief = add_machine(store, "thief", {})
    store.claim_next(m, lease_s=30)
    store.renew_lease(attempt(job.id, 1, m), JobState.RUNNING, 30)
    with pytest.raises(IllegalTransition):
        store.finish(attempt(job.id, 1, thief), succeeded=True, exit_code=0, reason=None, result="x",
                     output_key=None, limits={})
    assert store.get(job.id).state is JobState.RUNNING


def test_logs_are_stored_once_per_sequence_number(store: Store):
    job = submit(store)
    m = add_machine(store, "m", {})
    store.claim_next(m, lease_s=30)
    store.append_logs(attempt(job.id, 1, m), "build", 1, "step 1\n")
    store.append_logs(attempt(job.id, 1, m), "build", 1, "step 1\n")  # a retried upload
    store.append_logs(attempt(job.id, 1, m), "run", 2, "hello\n")
    logs = store.logs(job.id)
    assert [(c.stream, c.text) for c in logs] == [("build", "step 1\n"), ("run", "hello\n")]
    assert store.logs(job.id, after_id=logs[0].id)[0].text == "hello\n"


def test_machines_are_pending_until_approved_and_keep_only_their_public_key(store: Store):
    from sqlalchemy import text

    from campugrid.coordinator.machines import Status
    from campugrid.protocol import keys

    key = keys.Ed25519PrivateKey.generate()
    record = store.machines.register("m", keys.public_text(key))
    assert record.status is Status.PENDING
    assert record.fingerprint == keys.key_fingerprint(key)
    # The same key again is the same machine (an agent that joins twice), not a second one.
    assert store.machines.register("m", keys.public_text(key)).id == record.id
    store.machines.heartbeat(record.id, {})
    assert store.machines.online() == [] and store.machines.pending_online() == 1
    store.machines.set_status(record.id, Status.APPROVED)
    assert [m.id for m in store.machines.online()] == [record.id]
    with store.engine.connect() as conn:
        dump = " ".join(str(v) for row in conn.execute(text("SELECT * FROM machines")) for v in row)
    private = key.private_bytes_raw()
    import base64

    assert base64.b64encode(private).decode() not in dump and private.hex() not in dump


def test_pending_machines_nobody_approves_are_forgotten(store: Store):
    waiting = add_machine(store, "never-approved", approve=False)
    approved = add_machine(store, "approved")
    assert store.machines.expire_pending(older_than_s=3600) == 0  # not old yet
    assert store.machines.expire_pending(older_than_s=-1) == 1
    assert [m.id for m in store.machines.all()] == [approved]
    assert waiting not in {m.id for m in store.machines.all()}


def test_a_revoked_machine_loses_its_lease_at_once_and_cannot_be_approved_again(store: Store):
    from campugrid.coordinator.machines import Status
    from campugrid.protocol.errors import Forbidden

    job = submit(store)
    m = add_machine(store, "m")
    claim = store.claim(m, 60)
    assert claim is not None and claim.job.id == job.id
    store.machines.set_status(m, Status.REVOKED)
    assert store.requeue_expired() == [job.id]
    assert store.get(job.id).state is JobState.QUEUED
    with pytest.raises(Forbidden, match="revoked"):
        store.machines.set_status(m, Status.APPROVED)


def test_jobs_belong_to_their_owner_and_client_ids_are_per_owner(store: Store):
    spec = JobSpec(client_job_id="sweep-1")
    a, created_a = store.submit(spec, "contexts/x", "0" * 64, owner="app-a")
    b, created_b = store.submit(spec, "contexts/x", "0" * 64, owner="app-b")
    assert created_a and created_b and a.id != b.id  # the same id is another app's own
    again, created = store.submit(spec, "contexts/x", "0" * 64, owner="app-a")
    assert again.id == a.id and not created
    assert store.get(a.id, owner="app-a").id == a.id
    with pytest.raises(NotFound):
        store.get(a.id, owner="app-b")
    with pytest.raises(NotFound):
        store.cancel(a.id, owner="app-b")
    assert store.get(a.id).state is JobState.QUEUED  # the refused cancel changed nothing
    assert [j.id for j in store.list_jobs(owner="app-b")] == [b.id]
    assert {j.id for j in store.list_jobs()} == {a.id, b.id}  # an admin sees both


def test_invites_are_single_use_and_expire(store: Store):
    from campugrid.protocol import keys
    from campugrid.protocol.errors import Unauthenticated

    pub = lambda: keys.public_text(keys.Ed25519PrivateKey.generate())  # noqa: E731
    code, _ = store.apps.invite("alice", "admin-id")
    app = store.apps.redeem(code, pub())
    assert app.name == "alice" and not app.admin
    with pytest.raises(Unauthenticated, match="already used"):
        store.apps.redeem(code, pub())
    late, _ = store.apps.invite("bob", "admin-id", ttl_s=-1)
    with pytest.raises(Unauthenticated, match="expired"):
        store.apps.redeem(late, pub())
    with pytest.raises(Unauthenticated, match="unknown invite"):
        store.apps.redeem("cgi_guessed", pub())


def test_a_nonce_is_used_once_per_signer_across_processes(store: Store, db_url: str):
    from campugrid.protocol.errors import Unauthenticated

    store.nonces.use("app-a", "nonce-0001", 300)
    store.nonces.use("app-b", "nonce-0001", 300)  # another signer's nonce is its own
    other = Store(make_engine(db_url))  # a second coordinator on the same database
    with pytest.raises(Unauthenticated, match="replay"):
        other.nonces.use("app-a", "nonce-0001", 300)
    other.close()


def test_unknown_job_is_not_found(store: Store):
    with pytest.raises(NotFound):
        store.get("00000000-0000-0000-0000-000000000000")


def test_checkpoints_are_recorded_for_the_current_attempt_only_and_pruned(store: Store):
    job = submit(store)
    m = add_machine(store, "m", {})
    store.claim_next(m, lease_s=30)
    dropped = []
    for epoch in range(5):
        dropped += store.checkpoints.record(attempt(job.id, 1, m), epoch=epoch, key=f"k{epoch}", size=10,
                                           sha256="00" * 32, keep=2)
    assert dropped == ["k0", "k1", "k2"]
    assert [c.epoch for c in store.checkpoints.of(job.id)] == [3, 4]
    assert store.checkpoints.latest(job.id).key == "k4"
    store.requeue_expired(utcnow() + dt.timedelta(seconds=60))
    with pytest.raises(IllegalTransition):  # queued again: nobody may add checkpoints
        store.checkpoints.record(attempt(job.id, 1, m), epoch=9, key="late", size=1, sha256="00" * 32, keep=2)
    store.claim_next(m, lease_s=30)
    with pytest.raises(StaleAttempt):
        store.checkpoints.record(attempt(job.id, 1, m), epoch=9, key="late", size=1, sha256="00" * 32, keep=2)
    assert store.checkpoints.latest(job.id).epoch == 4


def test_a_drained_attempt_does_not_count_against_max_attempts(store: Store):
    job = submit(store, max_attempts=1)
    m = add_machine(store, "m", {})
    store.claim_next(m, lease_s=30)
    released = store.release(attempt(job.id, 1, m), "owner needs the GPU")
    assert released.state is JobState.QUEUED and released.attempt == 1
    assert store.claim_next(m, lease_s=1).attempt == 2
    # attempt 2 is lost: with one drained attempt, one attempt of one has now failed
    store.requeue_expired(utcnow() + dt.timedelta(seconds=5))
    assert store.get(job.id).state is JobState.FAILED
    kinds = [e.kind for e in store.events(job.id)]
    assert kinds.count("drained") == 1 and kinds[-1] == "lease_expired"
    with pytest.raises(IllegalTransition):
        store.release(attempt(job.id, 2, m), "too late")


def test_a_drain_does_not_use_up_the_only_attempt(store: Store):
    job = submit(store, max_attempts=2)
    m = add_machine(store, "m", {})
    store.claim_next(m, lease_s=30)
    store.release(attempt(job.id, 1, m), "drain")
    store.claim_next(m, lease_s=1)
    store.requeue_expired(utcnow() + dt.timedelta(seconds=5))
    assert store.get(job.id).state is JobState.QUEUED  # 1 failed attempt of 2


def test_a_restarted_coordinator_gives_running_jobs_one_more_lease(store: Store):
    job = submit(store)
    m = add_machine(store, "m", {})
    store.claim_next(m, lease_s=0.01)
    time.sleep(0.05)
    assert store.extend_active_leases(30) == 1
    assert store.requeue_expired() == []
    assert store.get(job.id).state is JobState.BUILDING


def test_nul_bytes_from_agents_are_stored_not_crashed_on(store: Store):
    job = submit(store)
    m = add_machine(store, "m", {})
    store.claim_next(m, lease_s=30)
    store.append_logs(attempt(job.id, 1, m), "run", 1, "binary\x00junk\n")
    done = store.finish(attempt(job.id, 1, m), succeeded=False, exit_code=1, reason="bad\x00reason",
                        result="\x00", output_key=None, limits={})
    assert "\x00" not in store.logs(job.id)[0].text and "\x00" not in (done.reason or "")


def test_a_provider_side_failure_counts_as_an_attempt(store: Store):
    job = submit(store, max_attempts=2)
    m = add_machine(store, "m", {})
    for number in (1, 2):
        store.claim_next(m, lease_s=30)
        after = store.release(attempt(job.id, number, m), "disk full", failed=True)
    assert after.state is JobState.FAILED and "all 2 attempts used" in (after.reason or "")
    assert [e.kind for e in store.events(job.id)].count("handed_back") == 2


def test_a_claim_hands_out_the_job_exactly_as_stored(store: Store):
    # On SQLite the common claim runs on the DBAPI cursor (claims._take_next_sqlite): what it
    # hands out must be what the store reads back, dates included.
    job = submit(store, "exact", command=["x"], env={"A": "1"})
    m = add_machine(store, "m", {})
    claim = store.claim(m, lease_s=30)
    assert claim is not None and claim.job.id == job.id
    assert claim.job == store.get(job.id)
    assert claim.job.lease_expires_at is not None
    assert claim.job.lease_expires_at.tzinfo is not None
    assert claim.job.created_at == job.created_at


def test_a_job_is_named_by_its_id_or_any_start_of_it_that_is_its_alone(store: Store, monkeypatch):
    import uuid

    from campugrid.protocol.errors import InvalidInput

    ids = iter([uuid.UUID("abcd1234-0000-4000-8000-000000000001"),
                uuid.UUID("abcd1234-0000-4000-8000-000000000002"),
                uuid.UUID("abcd9999-0000-4000-8000-000000000003")])
    monkeypatch.setattr("campugrid.coordinator.store.uuid.uuid4", lambda: next(ids))
    one, _ = store.submit(JobSpec(), "contexts/x", "0" * 64, owner="app-a")
    two, _ = store.submit(JobSpec(), "contexts/x", "0" * 64, owner="app-b")
    three, _ = store.submit(JobSpec(), "contexts/x", "0" * 64, owner="app-a")
    monkeypatch.undo()
    assert store.job_id(one.id) == one.id
    assert store.job_id(" ABCD9999 ") == three.id  # as printed, upper case and spaces aside
    assert store.job_id("abcd9") == three.id
    with pytest.raises(InvalidInput, match=f"several jobs \\({one.id}, {two.id}, …\\): give more"):
        store.job_id("abcd1234")
    # Among one app's own jobs the start is its alone; another app's ids are never confirmed.
    assert store.job_id("abcd1234", owner="app-a") == one.id
    with pytest.raises(NotFound, match="no job whose id starts with 'abcd1234-0000-4000-8000-00000000000'"):
        store.job_id("abcd1234-0000-4000-8000-00000000000", owner="app-c")
    for bad in ("abc", "zzzz1234", "abcd'; --", ""):
        with pytest.raises(NotFound, match="a job id is a UUID, or its first characters"):
            store.job_id(bad)


def test_a_renewal_that_crosses_its_attempts_end_is_refused_without_a_line_in_the_history(
        store: Store):
    job = submit(store)
    m = add_machine(store, "m", {})
    store.claim_next(m, lease_s=30)
    store.finish(attempt(job.id, 1, m), succeeded=True, exit_code=0, reason=None, result=None,
                 output_key=None, limits={})
    with pytest.raises(IllegalTransition, match="the job is succeeded"):
        store.renew_lease(attempt(job.id, 1, m), JobState.RUNNING, 30)
    assert "refused" not in [e.kind for e in store.events(job.id)]
    with pytest.raises(StaleAttempt):  # another attempt's late call is still recorded
        store.renew_lease(attempt(job.id, 7, m), JobState.RUNNING, 30)
    assert [e.kind for e in store.events(job.id)].count("refused") == 1


def test_a_renewal_sent_while_building_that_comes_after_the_start_renews_the_running_job(
        store: Store):
    """An agent's renewal from its build, retried through another coordinator after the job
    started, must not cost the attempt (tests/acceptance/test_coordinators.py lost one so)."""
    job = submit(store)
    m = add_machine(store, "m", {})
    store.claim_next(m, lease_s=30)
    ref = attempt(job.id, 1, m)
    store.renew_lease(ref, JobState.RUNNING, 30)  # it started
    before = store.get(job.id).lease_expires_at
    late = store.renew_lease(ref, JobState.BUILDING, 600)
    assert late.state is JobState.RUNNING and late.lease_expires_at > before
    assert "refused" not in [e.kind for e in store.events(job.id)]
    with pytest.raises(StaleAttempt):  # another attempt's is still refused
        store.renew_lease(attempt(job.id, 2, m), JobState.BUILDING, 30)
