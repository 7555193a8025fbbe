"""The hostile-job suite's platform: coordinator, SeaweedFS and one agent as the provider
user, exactly as `campugrid up` runs them, with canaries planted where no job may reach, a
`guard` that proves, after each attack, that the host is as it was and (with a probe job) the
agent still works, and `serves_a_job_at_the_end`: a probe job once the module's tests are over.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from campugrid.cli.platform import AgentHandle, Platform, ProviderUser
from campugrid.cli.seaweed import free_port
from campugrid.client import FINAL, Api, tar_folder
from campugrid.protocol.spec import JobSpec
from tests.support import hostile

BASE = "localhost/campugrid/python:bookworm"
# No build step: the job's code comes in its spec's command, and the image is the base itself
# (about 1 s to build, against about 5 s for a COPY layer: this suite runs some fifty jobs).
PLAIN = f"FROM {BASE}\n"
# Every job this suite submitted: the host checks blame only containers and cgroups of these.
JOB_IDS: set[str] = set()
# The agent now empties and removes build cgroups too (they were left behind when a build's
# background `runsc delete` still ran in them); set True to tolerate `build-*` leftovers.
IGNORE_BUILD_CGROUPS = False


def submit(api: Api, context: bytes, spec: dict[str, Any] | None = None) -> dict[str, Any]:
    job = api.submit(context, JobSpec.from_dict(spec or {}))
    JOB_IDS.add(job["id"])
    return job


def wait_final(api: Api, job_id: str, timeout: float = 240) -> dict[str, Any]:
    final = api.wait(job_id, timeout_s=timeout, poll_s=0.2, check=False)
    assert final["state"] in FINAL, f"job {job_id} still {final['state']} after {timeout:.0f} s"
    return final


def run_job(api: Api, dockerfile: str, files: dict[str, str], spec: dict[str, Any] | None = None,
            timeout: float = 240) -> dict[str, Any]:
    """Tar a folder of `Dockerfile` and `files`, submit it as a researcher would, wait for
    the job to end and return it (its logs: api.logs(job["id"]), or `run_log`)."""
    with tempfile.TemporaryDirectory(prefix="campugrid-sec-ctx-") as tmp:
        folder = Path(tmp)
        (folder / "Dockerfile").write_text(dockerfile)
        for name, text in files.items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(text)
        context = tar_folder(folder)
    return wait_final(api, submit(api, context, spec)["id"], timeout)


def run_python(api: Api, code: str, spec: dict[str, Any] | None = None,
               timeout: float = 240) -> dict[str, Any]:
    """A job whose command is `python3 -c code` on the plain base image."""
    return run_job(api, PLAIN, {}, {"command": ["python3", "-c", code], **(spec or {})}, timeout)


def run_log(api: Api, job_id: str) -> str:
    return "".join(c["text"] for c in api.logs(job_id)["chunks"] if c["stream"] == "run")


def result_of(job: dict[str, Any]) -> Any:
    """The JSON object a probe job printed as its last line."""
    assert job["result"], f"the job printed no result: {job['state']}, {job['reason']}"
    try:
        return json.loads(job["result"])
    except ValueError as e:
        raise AssertionError(f"the job's last line is not JSON: {job['result'][:300]!r}") from e


def stamp(s: str) -> float:
    return dt.datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()


def seconds_running(job: dict[str, Any]) -> float:
    """From the lease to the end, by the job's own events."""
    events = {e["kind"]: e["at"] for e in job["events"]}
    return stamp(events[job["state"]]) - stamp(events["leased"])


def brief(job: dict[str, Any]) -> str:
    return (f"job {job['id']}: {job['state']}, exit {job.get('exit_code')}, reason "
            f"{(job.get('reason') or '')[:600]!r}, result {(job.get('result') or '')[:300]!r}")


def rss_kb(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for pid {pid}")


def reset_peak_rss(pid: int) -> None:
    """Reset VmHWM (Linux >= 4.0): what it reads afterwards is the peak since now."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def measure_agent_peak(agent: AgentHandle, run: Callable[[], dict[str, Any]]
                       ) -> tuple[dict[str, Any], int]:
    """Run `run()` and return its job and the agent's peak resident memory growth in KiB."""
    pid = agent.pid()
    base = rss_kb(pid)
    reset_peak_rss(pid)
    job = run()
    return job, rss_kb(pid, "VmHWM") - base


@pytest.fixture(scope="module")
def platform() -> Iterator[Platform]:
    """The whole platform as `campugrid up` starts it, with one agent as the provider user."""
    root = Path(tempfile.mkdtemp(prefix="campugrid-sec-"))
    os.chmod(root, 0o711)
    p = Platform(root / "state", http_port=free_port(), lease_seconds=4.0,
                 admin_identity=root / "admin.json").start()
    try:
        p.start_agent("security-agent")
        with p.api() as api:  # one job first: the agent's cold start is no attack's cost
            warm = run_job(api, PLAIN, {}, {"command": ["true"]}, timeout=180)
            assert warm["state"] == "succeeded", (warm["reason"], warm)
        yield p
    finally:
        p.stop()
        log = root / "state" / "agents" / "security-agent.log"
        if log.exists():
            print("--- agent log (tail) ---\n" + "\n".join(log.read_text().splitlines()[-40:]))
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def api(platform: Platform) -> Iterator[Api]:
    with platform.api() as client:
        yield client


@pytest.fixture(scope="module")
def agent(platform: Platform) -> AgentHandle:
    return platform.agents[0]


@dataclasses.dataclass(frozen=True)
class Canaries:
    home: hostile.Canary  # in the provider's home
    state: hostile.Canary  # in the agent's state folder, beside its credentials
    credentials: Path  # the agent's own machine.key (its private key, 0600)
    machine_secret: str  # the key's base64 line, as a job would print it

    def secrets(self) -> list[str]:
        return [self.home.token, self.state.token, self.machine_secret]


@pytest.fixture(scope="module")
def canaries(agent: AgentHandle, provider: ProviderUser) -> Iterator[Canaries]:
    home = hostile.Canary.plant(provider.home / f".campugrid-security-canary-{uuid.uuid4().hex[:8]}",
                                provider, label="home")
    state = hostile.Canary.plant(agent.state_dir / "security-canary.txt", provider, label="state")
    creds = agent.state_dir / "machine.key"
    secret = creds.read_text().splitlines()[1]
    try:
        yield Canaries(home, state, creds, secret)
    finally:
        home.remove()
        state.remove()


def probe(api: Api) -> dict[str, Any]:
    """(c) the agent serves the next job: a trivial one, to its result."""
    job = run_job(api, PLAIN, {}, {"command": ["echo", "probe ok"]}, timeout=120)
    assert job["state"] == "succeeded" and job["result"] == "probe ok", (
        f"the agent did not serve the job after the attack: {job['state']}, {job['reason']}")
    return job


@pytest.fixture(scope="module")
def serves_a_job_at_the_end(api: Api) -> Iterator[None]:
    """(c) after a module's last test, whichever ran (`-k` too): a probe job, which the
    attacks that only read or probe (`guard.check(probe=False)`) otherwise leave to the next
    test's job. A module uses it for all its tests (pytest.mark.usefixtures)."""
    yield
    probe(api)


@dataclasses.dataclass
class Guard:
    """The before-picture of one test, and the after-checks every attack ends with."""

    platform: Platform
    api: Api
    agent: AgentHandle
    provider: ProviderUser
    canaries: Canaries
    scope: hostile.Scope
    before: hostile.HostSnapshot | None = None

    def snapshot(self) -> hostile.HostSnapshot:
        return hostile.snapshot(self.provider, disk_path=self.agent.state_dir,
                                watch=[self.canaries.home, self.canaries.state,
                                       self.canaries.credentials])

    def probe(self) -> dict[str, Any]:
        return probe(self.api)

    def check(self, *, probe: bool = True, timeout_s: float = 45) -> hostile.HostSnapshot:
        """(b) and (c): the next job runs, then the host matches the before-picture."""
        assert self.before is not None
        if probe:
            self.probe()
        # Slack for other work on this disk meanwhile: a job's leak is GBs (4 GiB in these).
        return hostile.wait_host_unaffected(self.before, self.snapshot, timeout_s=timeout_s,
                                            scope=self.scope, disk_slack_mb=1024,
                                            ignore_build_cgroups=IGNORE_BUILD_CGROUPS)

    def assert_not_leaked(self, job: dict[str, Any], *, output: bytes = b"") -> None:
        hostile.assert_not_leaked(self.canaries.secrets(), result=job.get("result") or "",
                                  reason=job.get("reason") or "",
                                  logs=run_log(self.api, job["id"]), output=output)


@pytest.fixture
def guard(platform: Platform, api: Api, agent: AgentHandle, provider: ProviderUser,
          canaries: Canaries) -> Guard:
    g = Guard(platform, api, agent, provider, canaries, hostile.Scope(tokens=JOB_IDS))
    deadline = time.monotonic() + 60
    while True:  # the agent between tasks: the last test's clean-up is over
        g.before = g.snapshot()
        busy = [n for n in g.before.containers if g.scope.owns_name(n)]
        if not busy:
            return g
        assert time.monotonic() < deadline, f"the agent is still busy with {busy}"
        time.sleep(0.5)
