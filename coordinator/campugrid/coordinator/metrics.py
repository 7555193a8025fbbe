"""The coordinator's Prometheus metrics (/metrics) and the scrape tokens that guard them.

Hot paths (a lease, a refused call, a recorded checkpoint) only move a counter or a histogram
in this process; what several coordinator processes share (jobs per state, the oldest queued
job) is read from the database at scrape time. A scrape token is kept as its SHA-256 only.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import hmac
import logging
import secrets
from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    ProcessCollector,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import delete, func, select
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from campugrid.coordinator.apps import check_name
from campugrid.coordinator.db import STATEMENTS, Database
from campugrid.coordinator.models import Job, MetricsToken
from campugrid.coordinator.views import utcnow
from campugrid.protocol.errors import Conflict, Unauthenticated
from campugrid.protocol.states import JobState

log = logging.getLogger("campugrid.coordinator.metrics")
CONTENT_TYPE = CONTENT_TYPE_LATEST
TOKEN_PREFIX = "cgm_"  # noqa: S105 - a prefix that names the kind, not a secret
# A lease is a few milliseconds (bench/scheduler.py): fine buckets there, coarse above.
LEASE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
WAIT_BUCKETS = (0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 86400.0)


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def bearer(authorization: str) -> str:
    """The token of an `Authorization: Bearer …` header ("" for anything else)."""
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


@dataclasses.dataclass(frozen=True)
class TokenView:
    name: str
    created_by: str  # the admin app's id
    created_at: dt.datetime


class ScrapeTokens:
    """Named bearer tokens for Prometheus: minted by an admin, shown once, revoked by name."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def mint(self, name: str, created_by: str) -> tuple[str, TokenView]:
        check_name(name)
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        row = MetricsToken(name=name, token_sha256=token_digest(token), created_by=created_by,
                           created_at=utcnow())
        try:
            with self.db.tx() as s:
                s.add(row)
        except IntegrityError as e:
            raise Conflict(f"a scrape token named {name!r} exists: revoke it first "
                           f"(`campugrid metrics revoke {name}`) or choose another --name") from e
        return token, TokenView(row.name, row.created_by, row.created_at)

    def all(self) -> list[TokenView]:
        with self.db.read() as s:
            return [TokenView(r.name, r.created_by, r.created_at)
                    for r in s.scalars(select(MetricsToken).order_by(MetricsToken.name))]

    def revoke(self, name: str) -> bool:
        with self.db.tx() as s:
            return bool(s.execute(delete(MetricsToken).where(MetricsToken.name == name))
                        .rowcount)  # type: ignore[attr-defined]

    def check(self, token: str) -> str:
        """The name of the token, or Unauthenticated. Only digests are compared (in
        constant time), so neither the database nor the timing holds the token itself."""
        digest, row = token_digest(token), None
        if token:
            with self.db.read() as s:
                row = s.execute(select(MetricsToken.name, MetricsToken.token_sha256)
                                .where(MetricsToken.token_sha256 == digest)).first()
        if row is None or not hmac.compare_digest(row.token_sha256, digest):
            raise Unauthenticated("/metrics needs a scrape token (Authorization: Bearer …): an "
                                  "admin mints one with `campugrid metrics token`")
        return str(row.name)


class _StatementsSent(Collector):
    """What this process sent to the database (db.STATEMENTS): an idle fleet should cost
    none of it."""

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily("campugrid_db_statements",
                                  "Statements this process sent to the database (BEGIN and "
                                  "PRAGMA included; a scrape's own reads too)",
                                  value=STATEMENTS.count)
        yield CounterMetricFamily("campugrid_db_queries",
                                  "Of those, the queries: what reads or writes rows, not "
                                  "BEGIN, PRAGMA or the like", value=STATEMENTS.queries)


class _FromDatabase(Collector):
    """Jobs per state and the oldest queued job, read at scrape time: every coordinator
    process on the database reports the same numbers (aggregate them with max, not sum)."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("campugrid_database_up",
                               "1 if the scrape could read the jobs from the database")
        try:
            with self.db.read() as s:
                counts = dict(s.execute(select(Job.state, func.count()).group_by(Job.state)).all())
                oldest = s.scalar(select(func.min(Job.created_at))
                                  .where(Job.state == JobState.QUEUED.value))
        except SQLAlchemyError as e:
            log.warning("metrics: cannot read the jobs (%s)", type(e).__name__)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        jobs = GaugeMetricFamily("campugrid_jobs", "Jobs in each state", labels=["state"])
        for state in JobState:
            jobs.add_metric([state.value], counts.get(state.value, 0))
        yield jobs
        age = (utcnow() - oldest).total_seconds() if oldest is not None else 0.0
        yield GaugeMetricFamily("campugrid_oldest_queued_job_age_seconds",
                                "Since when the oldest queued job was submitted (0: none queued)",
                                value=max(0.0, age))


class CoordinatorMetrics:
    """One registry per coordinator (not prometheus_client's global one: tests run several
    coordinators in one process)."""

    def __init__(self, db: Database) -> None:
        self.registry = CollectorRegistry()
        self.tokens = ScrapeTokens(db)
        r = self.registry
        self.lease_seconds = Histogram("campugrid_lease_seconds", "Time to answer a Lease call",
                                       buckets=LEASE_BUCKETS, registry=r)
        leases = Counter("campugrid_leases", "Lease calls answered, by whether a task was handed "
                                             "out (rate() of task: leases per second)",
                         ["outcome"], registry=r)
        # Bound once: the lease path does an increment, not a label lookup.
        self._leased, self._empty = leases.labels("task"), leases.labels("empty")
        self.queue_wait = Histogram("campugrid_queue_wait_seconds",
                                    "From submit to the first lease, for a plain job's first "
                                    "attempt", buckets=WAIT_BUCKETS, registry=r)
        self.refusals = Counter("campugrid_refused_calls", "Calls refused, by transport (rest, "
                                "grpc) and reason (stale, unsigned, bad_signature, replayed, …)",
                                ["transport", "reason"], registry=r)
        self.checkpoint_bytes = Counter("campugrid_checkpoint_bytes",
                                        "Bytes of checkpoints recorded", registry=r)
        self.checkpoints = Counter("campugrid_checkpoints", "Checkpoints recorded", registry=r)
        r.register(_StatementsSent())
        r.register(_FromDatabase(db))
        ProcessCollector(registry=r)  # the coordinator's own CPU and memory
        GCCollector(registry=r)  # its garbage collections (server.tune_gc), by generation

    def watch_fleet(self, connected: Callable[[], int], ready: Callable[[], int]) -> None:
        """The machines connected to this process (fleet.py), and those of them waiting for
        work now."""
        Gauge("campugrid_fleet_connected", "Machines with a stream open to this process",
              registry=self.registry).set_function(connected)
        Gauge("campugrid_fleet_ready", "Connected machines waiting for work now",
              registry=self.registry).set_function(ready)

    def leased(self, seconds: float, first_queued_at: dt.datetime | None, handed_out: bool) -> None:
        """One Lease call answered in `seconds`; `first_queued_at` is the submit time of a job
        leased for the first time (its wait in the queue ends now)."""
        self.lease_seconds.observe(seconds)
        (self._leased if handed_out else self._empty).inc()
        if first_queued_at is not None:
            self.queue_wait.observe(max(0.0, (utcnow() - first_queued_at).total_seconds()))

    def refused(self, transport: str, reason: str) -> None:
        self.refusals.labels(transport, reason).inc()

    def checkpoint_recorded(self, size: int) -> None:
        self.checkpoints.inc()
        self.checkpoint_bytes.inc(max(0, size))

    def scrape(self, authorization: str) -> bytes:
        """The text exposition, for a request that carries a scrape token (else
        Unauthenticated)."""
        self.tokens.check(bearer(authorization))
        return generate_latest(self.registry)
