"""What an idle fleet costs one coordinator process, and how fast new work reaches it.

    .venv/bin/python bench/fleet.py [--agents 100,1000] [--seconds 20] [--submits 20]

For each fleet size, one `campugrid coordinator serve` process (SQLite, an embedded S3
server) gets that many approved machines, and a simulator process (asyncio, grpc.aio, many
agents in one process) connects them and has each behave exactly as an idle agent does
today (agent/worker.py): a signed Heartbeat with its capabilities every 10 s, a signed Lease
asking to be held (wait_ms 8000), and when it comes back empty, the rest of a 1 s poll. Each
call is signed with the machine's own key by the agent's own signing code
(agent.client.signed_metadata), over a TLS channel per agent with the agent's options.

Measured over --seconds once every agent has joined: the coordinator's CPU (its process,
/proc), the statements it sent to the database (campugrid_db_statements_total, less what
the two scrapes cost), the asks for work answered per second, and its resident memory less
what it held before the agents came (per agent). Then --submits jobs are submitted one at a
time through REST, and each one's dispatch is the time from its record's created_at (stored
before the answer) to the moment a simulated agent has its lease.

The simulator shares the machine's two cores with the coordinator: the coordinator's CPU is
its own process's, whatever the simulator costs; dispatch times include the simulator's
scheduling.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime as dt
import json
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import grpc
import httpx

from campugrid.agent.client import CHANNEL_OPTIONS, signed_metadata
from campugrid.agent.link import Closed, Link
from campugrid.cli.seaweed import EmbeddedS3
from campugrid.client import Api, tar_folder
from campugrid.coordinator.db import make_engine, migrate
from campugrid.protocol import agent_pb2 as pb
from campugrid.protocol import keys
from campugrid.protocol.identities import Identity
from campugrid.protocol.spec import JobSpec
from campugrid.protocol.wire import MACHINE_HEADER

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from scheduler import _coordinators, _cpu, seed_machines  # noqa: E402  (the same helpers)

HEARTBEAT = "/campugrid.v1.AgentService/Heartbeat"
LEASE = "/campugrid.v1.AgentService/Lease"
HEARTBEAT_S, POLL_S, WAIT_MS = 10.0, 1.0, 8000  # agent/worker.py's, when idle


# --- the simulator (a process of its own) -------------------------------------------------

@dataclasses.dataclass
class Counts:
    asks: int = 0
    beats: int = 0
    errors: int = 0
    joined: int = 0
    codes: dict[str, int] = dataclasses.field(default_factory=dict)  # the errors, by status


async def polling_agent(address: str, pem: str, cred: tuple[str, str], counts: Counts,
                        stop: asyncio.Event) -> None:
    """One idle agent of today's design, on a connection of its own."""
    machine, key = cred[0], keys.Ed25519PrivateKey.from_private_bytes(bytes.fromhex(cred[1]))
    credentials = grpc.ssl_channel_credentials(root_certificates=pem.encode())
    async with grpc.aio.secure_channel(address, credentials, options=list(CHANNEL_OPTIONS)) as ch:
        beat = ch.unary_unary(HEARTBEAT, request_serializer=pb.HeartbeatRequest.SerializeToString,
                              response_deserializer=pb.HeartbeatReply.FromString)
        ask = ch.unary_unary(LEASE, request_serializer=pb.LeaseRequest.SerializeToString,
                             response_deserializer=pb.LeaseReply.FromString)
        caps = pb.HeartbeatRequest(capabilities=pb.Capabilities(
            runtime="runsc", builder="buildah", cpus=8, memory_mb=32_000, speed_gflops=100.0,
            disk_mb=100_000, limits={"memory": "enforced"}))
        want = pb.LeaseRequest(wait_ms=WAIT_MS, hold_kinds=True, cpus=8, memory_mb=32_000,
                               disk_mb=100_000, enforced_limits=["memory"])
        loop = asyncio.get_running_loop()
        await asyncio.sleep(random.uniform(0, HEARTBEAT_S))  # agents start at any moment
        next_beat, joined = 0.0, False
        while not stop.is_set():
            try:
                if loop.time() >= next_beat:
                    await beat(caps, timeout=30, metadata=_signed(key, machine, HEARTBEAT, caps))
                    counts.beats += 1
                    next_beat = loop.time() + HEARTBEAT_S
                    if not joined:
                        counts.joined, joined = counts.joined + 1, True
                asked = loop.time()
                reply = await ask(want, timeout=WAIT_MS / 1000 + 10,
                                  metadata=_signed(key, machine, LEASE, want))
                counts.asks += 1
            except grpc.aio.AioRpcError as e:
                counts.errors += 1
                counts.codes[e.code().name] = counts.codes.get(e.code().name, 0) + 1
                await asyncio.sleep(2)
                continue
            if reply.has_task:  # busy from now on, as an agent running the task is
                print(json.dumps({"job": reply.job_id, "at": time.time()}), flush=True)
                await stop.wait()
                return
            await asyncio.sleep(max(0.0, POLL_S - (loop.time() - asked)))


async def stream_agent(address: str, pem: str, cred: tuple[str, str], counts: Counts,
                       stop: asyncio.Event) -> None:
    """One idle agent of the stream design: the agent's own link (campugrid.agent.link),
    its heartbeats on the stream every 10 s, ready for work once."""
    key = keys.Ed25519PrivateKey.from_private_bytes(bytes.fromhex(cred[1]))
    caps = pb.Capabilities(runtime="runsc", builder="buildah", cpus=8, memory_mb=32_000,
                           speed_gflops=100.0, disk_mb=100_000, limits={"memory": "enforced"})
    await asyncio.sleep(random.uniform(0, HEARTBEAT_S))  # agents start at any moment
    link = Link(address, pem, key, cred[0])
    try:
        await link.open()
        await link.heartbeat(caps)
        await link.ready(pb.LeaseRequest(hold_kinds=True, cpus=8, memory_mb=32_000,
                                         disk_mb=100_000, enforced_limits=["memory"]))
        counts.beats += 1
        counts.joined += 1
        waiting = asyncio.create_task(link.lease())
        while not stop.is_set():
            done, _ = await asyncio.wait({waiting}, timeout=HEARTBEAT_S)
            if waiting in done:
                reply = waiting.result()
                print(json.dumps({"job": reply.job_id, "at": time.time()}), flush=True)
                await stop.wait()  # busy from now on, as an agent running the task is
                return
            await link.heartbeat(caps)
            counts.beats += 1
    except Closed as e:
        counts.errors += 1
        counts.codes[e.code.name if e.code else "closed"] = counts.codes.get(
            e.code.name if e.code else "closed", 0) + 1
    finally:
        await link.close()


def _signed(key: keys.Ed25519PrivateKey, machine: str, method: str,
            request: Any) -> list[tuple[str, str]]:
    return [(MACHINE_HEADER, machine),
            *signed_metadata(key, method, request.SerializeToString(), machine)]


async def simulate(address: str, design: str) -> None:
    """Reads the certificate and the machines from stdin, runs them, reports on request:
    "counts" prints the counters; "stop" ends."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=2**30)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    given = json.loads(await reader.readline())
    counts, stop = Counts(), asyncio.Event()
    agent = stream_agent if design == "stream" else polling_agent
    agents = [asyncio.create_task(agent(address, given["pem"], tuple(c), counts, stop))
              for c in given["creds"]]
    while line := (await reader.readline()).decode().strip():
        if line == "counts":
            print(json.dumps({"counts": dataclasses.asdict(counts)}), flush=True)
        elif line == "stop":
            break
    stop.set()
    await asyncio.wait(agents, timeout=30)


# --- the measurement ----------------------------------------------------------------------

class Simulator:
    def __init__(self, address: str, pem: str, creds: list[tuple[str, str]], design: str) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--simulate", address,
                                      "--design", design],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"pem": pem, "creds": creds}) + "\n")
        self.proc.stdin.flush()
        self.leased: dict[str, float] = {}  # job id -> when an agent had its lease
        self._counts: list[dict[str, int]] = []
        self._got = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            said = json.loads(line)
            with self._got:
                if "job" in said:
                    self.leased[said["job"]] = said["at"]
                else:
                    self._counts.append(said["counts"])
                self._got.notify_all()

    def tell(self, what: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()

    def counts(self) -> dict[str, int]:
        with self._got:
            seen = len(self._counts)
            self.tell("counts")
            if not self._got.wait_for(lambda: len(self._counts) > seen, timeout=60):
                raise RuntimeError("the simulator did not answer")
            return self._counts[-1]

    def wait_leased(self, job: str, timeout: float = 60) -> float:
        with self._got:
            if not self._got.wait_for(lambda: job in self.leased, timeout=timeout):
                raise RuntimeError(f"no agent got job {job} in {timeout} s")
            return self.leased[job]

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.tell("stop")
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class Scraper:
    """campugrid_db_statements_total, less what the scrapes themselves cost."""

    def __init__(self, url: str, token: str) -> None:
        self.url, self.token = url, token
        a, b = self._raw(), self._raw()
        self.own = b - a  # one scrape's own statements (the jobs per state it reads)

    def _raw(self) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=30,
                         headers={"authorization": f"Bearer {self.token}"}).text
        return next(float(line.split()[-1]) for line in text.splitlines()
                    if line.startswith("campugrid_db_statements_total "))

    def statements(self) -> float:
        return self._raw()


def row(design: str, agents: int, seconds: float, submits: int, root: Path,
        s3: EmbeddedS3) -> dict[str, Any]:
    state = root / f"{design}-{agents}" / "state"  # its admin identity beside it, its own
    state.parent.mkdir()
    url = f"sqlite:///{state.parent / 'fleet.db'}"
    engine = make_engine(url)
    migrate(engine)
    creds = seed_machines(engine, agents)
    engine.dispose()
    [coordinator], [address] = _coordinators(state, url, s3, 1)
    sim = None
    try:
        pem = (state / "tls" / "coordinator.crt").read_text()
        rest = f"http://127.0.0.1:{_http_port(coordinator)}"
        identity = state.parent / "admin-1.json"
        while not identity.exists():  # made once the process is up
            time.sleep(0.2)
        api = Api(rest, Identity.load(identity))
        scraper = Scraper(rest, api.mint_scrape_token(f"fleet-{agents}")["token"])
        rss_before = rss_bytes(coordinator.pid)
        # What the coordinator sends the database with no agent at all (its lease reaper):
        # the fleet's own share is what comes on top.
        b0, t_b = scraper.statements(), time.monotonic()
        time.sleep(min(seconds, 10.0))
        baseline = (scraper.statements() - b0 - scraper.own) / (time.monotonic() - t_b)
        sim = Simulator(address, pem, creds, design)
        deadline = time.monotonic() + 120
        while sim.counts()["joined"] < agents:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {sim.counts()['joined']} of {agents} agents joined")
            time.sleep(1)
        time.sleep(HEARTBEAT_S)  # every agent in its rhythm
        c0, s0, n0, t0 = _cpu(coordinator.pid), scraper.statements(), sim.counts(), time.monotonic()
        time.sleep(seconds)
        c1, s1, n1, t1 = _cpu(coordinator.pid), scraper.statements(), sim.counts(), time.monotonic()
        rss = rss_bytes(coordinator.pid)
        wall = t1 - t0
        dispatch = []
        spec = JobSpec.from_dict({"command": ["true"]})
        context = tar_folder(_hello(root))
        for _ in range(submits):
            job = api.submit(context, spec)
            created = dt.datetime.fromisoformat(job["created_at"]).timestamp()
            dispatch.append(sim.wait_leased(job["id"]) - created)
            time.sleep(0.3)
        dispatch.sort()
        return {"design": design, "agents": agents, "cpu": (c1 - c0) / wall,
                "statements_per_s": (s1 - s0 - scraper.own) / wall,
                "baseline_per_s": baseline,
                "asks_per_s": (n1["asks"] - n0["asks"]) / wall,
                "beats_per_s": (n1["beats"] - n0["beats"]) / wall,
                "errors": n1["errors"] - n0["errors"], "codes": n1["codes"],
                "dispatch_p50_ms": statistics.median(dispatch) * 1000,
                "dispatch_p95_ms": dispatch[max(0, int(len(dispatch) * 0.95) - 1)] * 1000,
                "kb_per_agent": max(0, rss - rss_before) / agents / 1024}
    finally:
        if sim is not None:
            sim.stop()
        coordinator.send_signal(signal.SIGTERM)
        try:
            coordinator.wait(timeout=30)
        except subprocess.TimeoutExpired:
            coordinator.kill()


def _http_port(proc: subprocess.Popen[bytes]) -> int:
    args = proc.args
    assert isinstance(args, list)
    return int(args[args.index("--http-port") + 1])


def _hello(root: Path) -> Path:
    folder = root / "context"
    if not folder.exists():
        folder.mkdir()
        (folder / "Dockerfile").write_text("FROM localhost/campugrid/python:bookworm\n")
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--agents", default="100,1000", help="fleet sizes, one row each")
    ap.add_argument("--designs", default="polling,stream", help="polling, stream, or both")
    ap.add_argument("--seconds", type=float, default=20.0, help="the idle window of each row")
    ap.add_argument("--submits", type=int, default=20, help="jobs submitted for dispatch times")
    ap.add_argument("--simulate", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--design", default="polling", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.simulate:
        asyncio.run(simulate(args.simulate, args.design))
        return
    root = Path(tempfile.mkdtemp(prefix="campugrid-fleet-"))
    s3 = EmbeddedS3(root / "s3", "bench", uuid.uuid4().hex).start()
    rows = []
    try:
        for n in (int(x) for x in args.agents.split(",")):
            for design in args.designs.split(","):
                rows.append(row(design, n, args.seconds, args.submits, root, s3))
                print(f"  measured {n} idle agents, {design}", file=sys.stderr)
    finally:
        s3.stop()
        shutil.rmtree(root, ignore_errors=True)
    print(f"\nidle agents on one coordinator process (SQLite), {args.seconds:.0f} s window; "
          f"dispatch over {args.submits} submits, one at a time\n")
    print("| design  | idle agents | coordinator CPU (cores) | DB statements/s (none connected) "
          "| asks answered/s | heartbeats/s | dispatch p50 ms | p95 ms | coordinator KB/agent "
          "| errors |")
    print("|---------|-------------|-------------------------|----------------------------------"
          "|-----------------|--------------|-----------------|--------|----------------------"
          "|--------|")
    for r in rows:
        statements = f"{r['statements_per_s']:.1f} ({r['baseline_per_s']:.1f})"
        print(f"| {r['design']:<7} | {r['agents']:>11} | {r['cpu']:23.2f} "
              f"| {statements:>32} | {r['asks_per_s']:15.0f} | {r['beats_per_s']:12.0f} "
              f"| {r['dispatch_p50_ms']:15.1f} | {r['dispatch_p95_ms']:6.1f} "
              f"| {r['kb_per_agent']:20.1f} | {r['errors']:>6} |")
    for r in rows:
        if r["codes"]:
            print(f"errors ({r['design']}, {r['agents']} agents), by status: {r['codes']}")
    print("\npolling: today's idle agents (a held Lease every second, a heartbeat every 10 s); "
          "stream: one stream per agent (campugrid.agent.link), heartbeats on it, work sent "
          "down it. Statements: what the coordinator sent to SQLite (BEGIN and PRAGMA "
          "included), and in brackets the same with no agent connected (its lease reaper); "
          "asks: the polling agents' Lease calls answered.")


if __name__ == "__main__":
    main()
