"""Every (from, to) pair of the job, sharded-job, verified-job and shard tables against a real store
(SQLite): the guarded move takes exactly the legal ones and refuses the rest unchanged."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

from campugrid.coordinator.db import job_row, make_engine, migrate
from campugrid.coordinator.models import Shard
from campugrid.coordinator.moves import move_job, move_shards
from campugrid.coordinator.store import Store
from campugrid.protocol.errors import IllegalTransition, StaleAttempt
from campugrid.protocol.spec import JobSpec
from campugrid.protocol.states import SHARD_TRANSITIONS, JobKind, JobState, ShardState


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    engine = make_engine(f"sqlite:///{Path(tmp_path_factory.mktemp('moves')) / 'db.sqlite'}")
    migrate(engine)
    yield Store(engine)
    engine.dispose()


SPECS = {JobKind.PLAIN: {}, JobKind.SHARDED: {"command": ["true"], "shards": [{"payload": 1}]},
         JobKind.VERIFIED: {"verify": {"replicas": 2}}}


def job_in(store: Store, state: JobState, *, kind: JobKind) -> str:
    job = store.submit(JobSpec.from_dict(SPECS[kind]), "contexts/x.tar", "ab" * 32)[0]
    with store.tx() as s:
        job_row(s, job.id).state = state.value
    return job.id


@pytest.mark.parametrize("kind", list(JobKind), ids=[k.value for k in JobKind])
def test_a_job_moves_exactly_where_its_table_allows(store: Store, kind: JobKind):
    for src, dst in itertools.product(JobState, JobState):
        job_id = job_in(store, src, kind=kind)
        legal = dst in kind.transitions[src]
        with store.tx() as s:
            try:
                move_job(s, job_id, dst, kind=kind)
                moved = True
            except IllegalTransition as e:
                moved = False
                assert f"cannot become {dst.value}" in str(e)
        assert moved == legal, f"{src} -> {dst}"
        assert store.get(job_id).state == (dst if legal else src)


def test_the_wrong_table_is_never_used_for_a_job(store: Store):
    plain, sharded, verified = (job_in(store, JobState.QUEUED, kind=k) for k in JobKind)
    with store.tx() as s, pytest.raises(IllegalTransition):
        move_job(s, plain, JobState.RUNNING, kind=JobKind.SHARDED)  # only theirs skip BUILDING
    with store.tx() as s, pytest.raises(IllegalTransition):
        move_job(s, plain, JobState.SUCCEEDED, kind=JobKind.VERIFIED)
    with store.tx() as s, pytest.raises(IllegalTransition):
        move_job(s, sharded, JobState.BUILDING)  # a sharded job is never leased whole
    with store.tx() as s, pytest.raises(IllegalTransition):
        move_job(s, verified, JobState.BUILDING)  # nor a verified one: its replicas are


def test_a_shard_moves_exactly_where_its_table_allows(store: Store):
    job_id = job_in(store, JobState.QUEUED, kind=JobKind.SHARDED)
    for src, dst in itertools.product(ShardState, ShardState):
        with store.tx() as s:
            s.get(Shard, (job_id, 0)).state = src.value
        legal = dst in SHARD_TRANSITIONS[src]
        with store.tx() as s:
            try:
                move_shards(s, job_id, dst, where=[Shard.idx == 0],
                            refused=lambda: StaleAttempt("not held"))
                moved = True
            except StaleAttempt:
                moved = False
        assert moved == legal, f"{src} -> {dst}"
        assert store.shards.shards(job_id)[0].state == (dst if legal else src).value


def test_stay_and_within_narrow_and_widen_the_sources(store: Store):
    job_id = job_in(store, JobState.RUNNING, kind=JobKind.PLAIN)
    with store.tx() as s, pytest.raises(IllegalTransition):
        move_job(s, job_id, JobState.RUNNING)  # not a transition
    with store.tx() as s:
        move_job(s, job_id, JobState.RUNNING, stay=True, within={JobState.RUNNING})  # a renewal
    with store.tx() as s, pytest.raises(IllegalTransition):
        move_job(s, job_id, JobState.FAILED, within={JobState.BUILDING})
