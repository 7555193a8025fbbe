"""The coordinator side of bench/fleet.py: `campugrid coordinator serve` processes as the
bench starts, kills and starts them again, and what it reads of them: their /metrics (the
statements and queries they sent their database, their fleet's gauges), their memory and
TCP connections, and PostgreSQL's own count of the rows written."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import text

from campugrid.cli.seaweed import EmbeddedS3, free_port

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scheduler import _listening  # type: ignore[import-not-found]


class Coordinator:
    """`campugrid coordinator serve` on fixed ports (as bench/scheduler.py's _coordinators
    starts it), so that it can be killed and started again where its agents look for it."""

    def __init__(self, state: Path, url: str, s3: EmbeddedS3, name: str = "coordinator") -> None:
        self.state, self.url, self.s3 = state, url, s3
        self.log = state.parent / f"{name}.log"  # kept across restarts
        self.grpc_port, self.http_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.grpc_port}"
        self.rest = f"http://127.0.0.1:{self.http_port}"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> None:
        """Started; returns once its gRPC port takes connections."""
        env = {**os.environ, "CAMPUGRID_DATABASE_URL": self.url,
               "CAMPUGRID_S3_ENDPOINT": self.s3.endpoint, "CAMPUGRID_S3_ACCESS_KEY": self.s3.access_key,
               "CAMPUGRID_S3_SECRET_KEY": self.s3.secret_key}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "campugrid.cli", "coordinator", "serve",
                 "--state-dir", str(self.state), "--http-port", str(self.http_port),
                 "--grpc-port", str(self.grpc_port), "--lease-seconds", "600",
                 "--admin-identity", str(self.state.parent / "admin.json")],
                env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not _listening(self.grpc_port):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"the coordinator did not start: see {self.log}")
            time.sleep(0.05)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Scraper:
    """The coordinator's /metrics: its statements sent (less what the scrapes themselves
    cost: `own` a scrape) and its fleet's gauges."""

    NAMES = {"campugrid_db_statements_total": "statements", "campugrid_db_queries_total": "queries",
             "campugrid_fleet_connected": "connected", "campugrid_fleet_ready": "ready",
             'python_gc_collections_total{generation="2"}': "full_gcs"}

    def __init__(self, url: str, token: str) -> None:
        self.url, self.token = url, token
        a, b = self.read(), self.read()
        self.own = b["statements"] - a["statements"]  # one scrape's own (the jobs per state)
        self.own_queries = b["queries"] - a["queries"]

    def read(self) -> dict[str, float]:
        answer = httpx.get(f"{self.url}/metrics", timeout=30,
                           headers={"authorization": f"Bearer {self.token}"})
        if answer.status_code != 200:
            raise RuntimeError(f"/metrics answered {answer.status_code}: {answer.text[:300]}")
        text = answer.text
        found = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name in self.NAMES:
                found[self.NAMES[name]] = float(value)
        return found

    def statements(self) -> float:
        return self.read()["statements"]


def wait_fleet(scrapers: list[Scraper], agents: int, timeout: float, stall_s: float = 60) -> float:
    """Seconds until every agent is connected and ready, over these processes together;
    RuntimeError when none joined for `stall_s` or `timeout` passed."""
    started = progressed = said = time.monotonic()
    best = -1.0
    while True:
        reads = [s.read() for s in scrapers]
        g = {k: sum(r[k] for r in reads) for k in ("connected", "ready")}
        if g["connected"] >= agents and g["ready"] >= agents:
            return time.monotonic() - started
        now = time.monotonic()
        if g["ready"] > best:
            best, progressed = g["ready"], now
        if now - said >= 10:  # a fleet of thousands takes minutes: show it coming
            print(f"    {now - started:.0f} s: {g['connected']:.0f} connected, "
                  f"{g['ready']:.0f} ready", file=sys.stderr)
            said = now
        if now - progressed > stall_s or now - started > timeout:
            raise RuntimeError(f"only {g['connected']:.0f} connected, {g['ready']:.0f} ready of "
                               f"{agents} agents after {now - started:.0f} s")
        time.sleep(0.5)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def tcp_connections(port: int) -> int:
    """TCP connections established to this local port (the server's side of each)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                if fields[3] == "01" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    count += 1
    return count


def rows_written(engine: Any) -> int:
    """Rows PostgreSQL has inserted, updated and deleted in this database, by its own count."""
    with engine.connect() as conn:
        return int(conn.scalar(text(
            "SELECT tup_inserted + tup_updated + tup_deleted FROM pg_stat_database "
            "WHERE datname = current_database()")) or 0)
