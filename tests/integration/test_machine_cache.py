"""What a coordinator process remembers of machines (Coordinator.machines.get): a status changed
by another process (approve, revoke, an expired pending machine) holds within about a second,
while calls from unchanged machines cost no read of their own. On SQLite and PostgreSQL."""

from __future__ import annotations

import datetime as dt
import time

import pytest
from sqlalchemy import event, update

from campugrid.coordinator.config import Settings
from campugrid.coordinator.db import make_engine
from campugrid.coordinator.machines import MACHINE_CACHE_S, Status
from campugrid.coordinator.models import FleetProcess, Machine
from campugrid.coordinator.objects import MemoryObjects
from campugrid.coordinator.service import Coordinator
from campugrid.coordinator.store import Store
from campugrid.coordinator.views import utcnow
from campugrid.protocol.errors import Unauthenticated
from tests.support.machines import add_machine

pytestmark = pytest.mark.integration


def process(db_url: str, tmp_path) -> tuple[Coordinator, list[str]]:
    """A coordinator on its own engine, as another process has, and the SQL it runs."""
    store = Store(make_engine(db_url))
    seen: list[str] = []
    event.listen(store.engine, "before_cursor_execute",  # queries, not BEGIN (SQLite's)
                 lambda _c, _cur, statement, *_: statement.startswith("BEGIN") or
                 seen.append(statement))
    settings = Settings(tmp_path, db_url, "", "", "")
    return Coordinator(settings, store, MemoryObjects()), seen  # no S3 needed


def test_another_process_sees_a_status_change_within_a_second(store: Store, db_url: str,
                                                              tmp_path):
    ours, sql = process(db_url, tmp_path)
    machines = [add_machine(store, f"m{i}") for i in range(50)]
    for m in machines:
        assert ours.machines.get(m).status is Status.APPROVED
    sql.clear()
    for _ in range(3):  # every machine calls again, within the second: no reads at all
        for m in machines:
            ours.machines.get(m)
    assert sql == []
    time.sleep(MACHINE_CACHE_S + 0.1)
    for m in machines:
        ours.machines.get(m)
    assert len(sql) == 1 and "machine_epoch" in sql[0]  # one small read for all of them
    store.machines.set_status(machines[7], Status.REVOKED)  # by the other process
    assert ours.machines.get(machines[7]).status is Status.APPROVED  # not yet
    time.sleep(MACHINE_CACHE_S + 0.1)
    assert ours.machines.get(machines[7]).status is Status.REVOKED
    assert ours.machines.get(machines[8]).status is Status.APPROVED
    pending = add_machine(store, "p", approve=False)
    assert ours.machines.get(pending).status is Status.PENDING
    assert store.machines.expire_pending(older_than_s=-1) == 1
    time.sleep(MACHINE_CACHE_S + 0.1)
    with pytest.raises(Unauthenticated):
        ours.machines.get(pending)
    ours.store.close()


def test_a_starting_process_reads_the_machines_heard_from_lately_at_once(store: Store, db_url: str,
                                                                         tmp_path):
    """After a restart every connected machine comes back within seconds: their records are
    read in one query as the process starts, not one read each as they come."""
    lately = [add_machine(store, f"m{i}") for i in range(30)]
    long_ago = add_machine(store, "gone")
    with store.machines.db.tx() as s:
        s.execute(update(Machine).where(Machine.id == long_ago)
                  .values(last_seen_at=utcnow() - dt.timedelta(hours=1)))
    ours, sql = process(db_url, tmp_path)
    assert ours.machines.warm() == len(lately)
    assert len(sql) == 2  # the status epoch, and the machines
    sql.clear()
    assert all(ours.machines.get(m).status is Status.APPROVED for m in lately)
    assert sql == []
    ours.machines.get(long_ago)  # not warmed: read as it calls
    assert len(sql) == 1
    ours.store.close()


def test_a_machine_on_a_stream_is_seen_while_its_process_is_alive(store: Store):
    """An idle fleet's "seen": each process says it is alive (one row), not each of its
    machines; a machine that left a process after it connected to another stays the other's;
    a process that stopped saying it is alive takes its machines offline with it."""
    one, two, three = (add_machine(store, f"m{i}") for i in range(3))
    machines = store.machines

    def an_hour_ago() -> None:  # what the machines' own rows say: offline
        with machines.db.tx() as s:
            s.execute(update(Machine).values(last_seen_at=utcnow() - dt.timedelta(hours=1)))

    def stored_seen(machine_id: str) -> dt.datetime:
        with machines.db.read() as s:
            return s.get(Machine, machine_id).last_seen_at

    an_hour_ago()
    assert machines.online() == []
    machines.alive("process-a", {one: True, two: True})
    machines.alive("process-b", {three: True})
    an_hour_ago()  # they connected long ago: seen only through their processes now
    assert {m.id for m in machines.online()} == {one, two, three}
    written = stored_seen(one)
    machines.alive("process-a", {})  # nothing came or went: the process's row alone
    assert stored_seen(one) == written
    assert machines.get(one).last_seen_at > written + dt.timedelta(minutes=59)
    # `two` moves to process-b; process-a hears it leave only afterwards.
    machines.alive("process-b", {two: True})
    machines.alive("process-a", {two: False})
    an_hour_ago()
    with store.db.tx() as s:  # process-a is gone (killed): its last word was an hour ago
        s.execute(update(FleetProcess).where(FleetProcess.id == "process-a")
                  .values(alive_at=utcnow() - dt.timedelta(hours=1)))
    assert {m.id for m in machines.online()} == {two, three}
    # A machine that leaves its stream is seen until then, by its own row.
    machines.alive("process-b", {three: False})
    assert stored_seen(three) > written
    assert {m.id for m in machines.online()} == {two, three}
    assert [m.id for m in machines.seen_since(utcnow() - dt.timedelta(minutes=5), 10)
            ] in ([two, three], [three, two])
