"""The simulated fleet of bench/fleet.py: idle agents, thousands to a process, each as the
agent is on its stream (campugrid.agent.link.Link, its own TLS connection), and the processes
that run them, as the bench drives them.

    python bench/fleet_agents.py ADDRESS   (the bench starts it: the certificate, the
                                            machines and the start window on stdin)

An agent opens its stream, sends a heartbeat with its capabilities and says it is ready for
work, then its unchanged heartbeat every link.STREAM_BEAT_S. A lease that comes down the
stream is reported (a line of JSON on stdout), and the agent says at once that it is ready
again. When a stream ends, or cannot be opened, the agent tries again when the agent's own
link.Backoff says (when the coordinator said, or after a jittered backoff that grows), as
link.Waiting does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from campugrid.agent.link import OPEN_S, STREAM_BEAT_S, TURNED_AWAY, Backoff, Closed, Link
from campugrid.client import Api
from campugrid.protocol import agent_pb2 as pb
from campugrid.protocol import keys
from campugrid.protocol.spec import JobSpec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scheduler import _cpu  # type: ignore[import-not-found]

OPEN_TIMEOUT_S = OPEN_S  # what link.Link gives an opening stream
CAPS = pb.Capabilities(runtime="runsc", builder="buildah", cpus=8, memory_mb=32_000,
                       speed_gflops=100.0, disk_mb=100_000, limits={"memory": "enforced"})
OFFER = pb.LeaseRequest(hold_kinds=True, cpus=8, memory_mb=32_000, disk_mb=100_000,
                        enforced_limits=["memory"])


# --- the simulator (processes of their own) ----------------------------------------------

@dataclasses.dataclass
class Counts:
    joined: int = 0  # agents whose stream was up at least once
    up: int = 0  # streams up now (opened, heartbeat and ready sent)
    opens: int = 0  # streams tried
    failed: int = 0  # tries that got no stream up (refused, unreachable, timed out)
    ended: int = 0  # streams that ended after they were up
    beats: int = 0
    leases: int = 0
    codes: dict[str, int] = dataclasses.field(default_factory=dict)  # failed and ended, why


async def stream_agent(address: str, pem: str, cred: tuple[str, str], counts: Counts,
                       start_s: float) -> None:
    """One idle agent: its own link (campugrid.agent.link), opened again after a jittered
    backoff whenever it ends. Runs until cancelled."""
    key = keys.Ed25519PrivateKey.from_private_bytes(bytes.fromhex(cred[1]))
    await asyncio.sleep(random.uniform(0, start_s))  # agents start at any moment
    backoff, joined, kept = Backoff(), False, None
    while True:
        # As link.Waiting: a stream turned away (link.TURNED_AWAY) is tried again on its link's
        # connection; any other end makes a new one.
        link, kept = kept or Link(address, pem, key, cred[0]), None
        up, waiting, ended = False, None, None
        counts.opens += 1
        try:
            async with asyncio.timeout(OPEN_TIMEOUT_S):  # (wait_for's task would outlive a stop)
                await _start(link)
            up = True
            counts.up += 1
            if not joined:
                counts.joined, joined = counts.joined + 1, True
            waiting = asyncio.create_task(link.lease())
            while True:
                # Nothing changes on an idle simulated machine: its heartbeat says nothing
                # new, which the agent sends on a stream every STREAM_BEAT_S only.
                done, _ = await asyncio.wait({waiting}, timeout=STREAM_BEAT_S)
                if waiting in done:
                    reply = waiting.result()  # Closed when the stream ended
                    print(json.dumps({"job": reply.job_id, "at": time.time()}), flush=True)
                    counts.leases += 1
                    backoff.reset()  # as link.Waiting: a lease resets it
                    await link.ready(OFFER)  # the task ended at once: ready again
                    waiting = asyncio.create_task(link.lease())
                else:
                    await link.heartbeat(CAPS)
                    counts.beats += 1
        except (Closed, TimeoutError) as e:
            why = (e.code.name if e.code else e.reason[:40]) if isinstance(e, Closed) else "timeout"
            ended = e if isinstance(e, Closed) else Closed("timeout", grpc.StatusCode.UNAVAILABLE)
            counts.codes[why] = counts.codes.get(why, 0) + 1
            if up:
                counts.ended += 1
            else:
                counts.failed += 1
        finally:
            if up:
                counts.up -= 1
            if waiting is not None:
                waiting.cancel()
            if not up and ended is not None and ended.code in TURNED_AWAY:
                await link.end()
                kept = link
            else:
                await link.close()
        assert ended is not None  # the stream ended (a stop cancels, and ends the loop)
        await asyncio.sleep(backoff.after(ended))


async def _start(link: Link) -> None:
    """What an agent sends on a new stream: its capabilities, then that it is ready."""
    await link.open()
    await link.heartbeat(CAPS)
    await link.ready(OFFER)


async def simulate(address: str) -> None:
    """Reads the certificate, the machines and the start window from stdin, runs them,
    reports on request: "counts" prints the counters; "stop" (or stdin's end) ends."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=2**30)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    given = json.loads(await reader.readline())
    counts = Counts()
    agents = [asyncio.create_task(stream_agent(address, given["pem"], tuple(c), counts,
                                               given["start_s"]))
              for c in given["creds"]]
    while line := (await reader.readline()).decode().strip():
        if line == "counts":
            print(json.dumps({"counts": dataclasses.asdict(counts)}), flush=True)
        elif line == "stop":
            break
    for agent in agents:
        agent.cancel()
    await asyncio.wait(agents, timeout=60)


# --- the processes, as the bench drives them -------------------------------------------

class Simulators:
    """The agents `creds`, dealt over `processes` simulator processes; with several
    coordinator addresses (processes of one database, one certificate), simulator i's agents
    connect to address i modulo their number."""

    def __init__(self, address: str | list[str], pem: str, creds: list[tuple[str, str]],
                 processes: int, start_s: float, nice: int = 0) -> None:
        addresses = [address] if isinstance(address, str) else address
        # `nice` execs the simulator: its pid is the simulator's (cpu() reads it).
        self.procs = [subprocess.Popen(["nice", "-n", str(nice), sys.executable, __file__,
                                        addresses[i % len(addresses)]],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                      for i in range(processes)]
        self.leased: dict[str, float] = {}  # job id -> when an agent had its lease
        self._answers: list[list[dict[str, Any]]] = [[] for _ in self.procs]
        self._got = threading.Condition()
        for i, proc in enumerate(self.procs):
            assert proc.stdin is not None
            proc.stdin.write(json.dumps({"pem": pem, "creds": creds[i::processes],
                                         "start_s": start_s}) + "\n")
            proc.stdin.flush()
            threading.Thread(target=self._read, args=(i,), daemon=True).start()

    def _read(self, i: int) -> None:
        stdout = self.procs[i].stdout
        assert stdout is not None
        for line in stdout:
            said = json.loads(line)
            with self._got:
                if "job" in said:
                    self.leased[said["job"]] = said["at"]
                else:
                    self._answers[i].append(said["counts"])
                self._got.notify_all()

    def _tell(self, what: str) -> None:
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(what + "\n")
            proc.stdin.flush()

    def counts(self) -> dict[str, Any]:
        """All the simulators' counters, added up."""
        with self._got:
            seen = [len(a) for a in self._answers]
            self._tell("counts")
            if not self._got.wait_for(lambda: all(len(a) > n for a, n in zip(self._answers, seen, strict=True)),
                                      timeout=60):
                raise RuntimeError("a simulator did not answer")
            answers = [a[-1] for a in self._answers]
        total: dict[str, Any] = {k: sum(a[k] for a in answers) for k in answers[0] if k != "codes"}
        total["codes"] = {}
        for a in answers:
            for code, n in a["codes"].items():
                total["codes"][code] = total["codes"].get(code, 0) + n
        return total

    def cpu(self) -> float:
        return float(sum(_cpu(p.pid) for p in self.procs))

    def wait_leased(self, jobs: set[str], timeout: float = 60) -> dict[str, float]:
        """When each of `jobs` reached an agent."""
        with self._got:
            if not self._got.wait_for(lambda: jobs <= self.leased.keys(), timeout=timeout):
                missing = len(jobs - self.leased.keys())
                raise RuntimeError(f"{missing} of {len(jobs)} jobs reached no agent in {timeout} s")
            return {job: self.leased[job] for job in jobs}

    def dispatch(self, api: Api, context: bytes, spec: JobSpec) -> float:
        """One job submitted through REST: seconds from its record's creation to its lease."""
        job = api.submit(context, spec)
        created = dt.datetime.fromisoformat(job["created_at"]).timestamp()
        return float(self.wait_leased({job["id"]})[job["id"]]) - created

    def dispatches(self, api: Api, context: bytes, spec: JobSpec, count: int) -> list[float]:
        """`count` jobs submitted one at a time, each one's dispatch (seconds), sorted."""
        taken = []
        for _ in range(count):
            taken.append(self.dispatch(api, context, spec))
            time.sleep(0.3)
        return sorted(taken)

    def stop(self) -> None:
        for proc in self.procs:
            try:
                assert proc.stdin is not None
                proc.stdin.write("stop\n")
                proc.stdin.close()
            except OSError:
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    asyncio.run(simulate(sys.argv[1]))
