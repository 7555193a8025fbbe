"""The sandbox Runtime contract: one body per case, run against the fake runtime (which takes
the job's behaviour from its env) and the real podman+runsc (which runs the command, as the
provider user). What the fake answers is only worth testing agent code with because the real
runtime answers the same here."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from campugrid.cli.platform import ProviderUser
from campugrid.protocol.spec import ENFORCED
from campugrid.sandbox import fake
from campugrid.sandbox.fake import FakeRuntime
from campugrid.sandbox.runtime import RunRequest
from tests.support.provider import DEFAULT_IMAGE
from tests.support.runtimes import READY, drive, drive_as_provider

pytestmark = pytest.mark.integration
MB = 1024 * 1024
WAITS = f"echo {READY}; exec sleep 300"  # up, then busy for longer than any case


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    command: tuple[str, ...]  # what the job runs in the real sandbox
    fake: dict[str, str]  # what the fake job is told to do: the same
    expect: dict[str, Any]  # fields of the result
    action: str = ""  # cancel, stop, kill, term: `after_s` after the job printed READY
    after_s: float = 0.5
    memory_mb: int = 256
    wall_time_s: int = 30
    file_mb: int | None = None
    image: str = DEFAULT_IMAGE
    output_mb: int | None = None  # size of /output/fake-output.bin afterwards
    needs_cgroups: bool = False  # only where the host enforces limits (else: skipped)


HANDLES_TERM = ("import signal, sys, time\n"
                "def drained(*_):\n    print('drained', flush=True); sys.exit(0)\n"
                f"signal.signal(signal.SIGTERM, drained)\nprint({READY!r}, flush=True)\n"
                "time.sleep(300)")
HOG = "b = bytearray(400 * 1024 * 1024); b[::4096] = b'x' * len(b[::4096]); print('survived')"

CASES = [
    Case("exit-3", ("sh", "-c", "echo about to fail; exit 3"),
         fake.env(stdout="about to fail", exit_code=3),
         {"exit_code": 3, "lines": ["about to fail"], "timed_out": False, "cancelled": False,
          "oom_killed": False}),
    Case("writes-output", ("sh", "-c", "head -c 2097152 /dev/zero > /output/fake-output.bin "
                                       "&& echo wrote"),
         fake.env(stdout="wrote", write_mb=2),
         {"exit_code": 0, "lines": ["wrote"]}, output_mb=2),
    Case("file-size-limit", ("sh", "-c", "dd if=/dev/zero of=/output/fake-output.bin bs=1M "
                                         "count=8 2>/dev/null"),
         fake.env(write_mb=8), {"exit_code": 153}, file_mb=2, output_mb=2),
    Case("out-of-memory", ("python3", "-c", HOG), fake.env(oom=1),
         {"oom_killed": True, "timed_out": False}, memory_mb=128, needs_cgroups=True),
    Case("wall-time", ("sh", "-c", WAITS), fake.env(stdout=READY, run_for=300),
         {"timed_out": True, "cancelled": False}, wall_time_s=2),
    Case("cancel", ("sh", "-c", WAITS), fake.env(stdout=READY, run_for=300),
         {"cancelled": True, "timed_out": False}, action="cancel"),
    Case("term-kills", ("sh", "-c", WAITS), fake.env(stdout=READY, run_for=300),
         {"exit_code": 143, "timed_out": False, "cancelled": False}, action="term"),
    Case("term-handled", ("python3", "-c", HANDLES_TERM),
         fake.env(stdout=READY, run_for=300, on_term=0),
         {"exit_code": 0, "timed_out": False, "cancelled": False}, action="term"),
    Case("stopped-from-outside", ("sh", "-c", WAITS), fake.env(stdout=READY, run_for=300),
         {"exit_code": 137, "timed_out": False, "cancelled": False}, action="stop"),
    Case("killed", ("sh", "-c", WAITS), fake.env(stdout=READY, run_for=300),
         {"exit_code": 137, "timed_out": False, "cancelled": False}, action="kill",
         needs_cgroups=True),
    Case("missing-command-is-the-jobs", ("/no/such/command",), fake.env(exit_code=126),
         {"exit_code": 126, "error": None}),
]
UNKNOWN_IMAGE = "localhost/campugrid-test/not-on-this-provider:1"
Driver = Callable[[RunRequest, str, float], dict[str, Any]]


@pytest.fixture(params=["fake", "podman-runsc"])
def runtime(request: pytest.FixtureRequest) -> tuple[str, Driver]:
    if request.param == "fake":
        fake_runtime = FakeRuntime(images={DEFAULT_IMAGE})
        return "fake", lambda req, action, after_s: drive(fake_runtime, req, action, after_s)
    provider: ProviderUser = request.getfixturevalue("provider")
    return "podman-runsc", lambda req, action, after_s: drive_as_provider(provider, req, action,
                                                                          after_s)


def output_folder(root: Path, provider: ProviderUser) -> Path:
    out = root / "output"
    out.mkdir()
    if os.geteuid() == 0:
        os.chown(out, provider.uid, provider.gid)
    return out


def request(case: Case, name: str, out: Path) -> RunRequest:
    return RunRequest(name=name, image=case.image, command=case.command,
                      env=tuple(case.fake.items()), output_dir=out, data_dir=None,
                      memory_mb=case.memory_mb, cpus=1.0, tmp_mb=16,
                      wall_time_s=case.wall_time_s, file_mb=case.file_mb,
                      agent="contract-tests")


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_the_runtime_contract(runtime, case: Case, provider, shared_tmp):
    check_case(*runtime, case, provider, shared_tmp)


# The real runtime asks Podman its questions (state, signals, removal, sweeps) through
# podman-py on its own API service; where that cannot start, through the command line. The
# cases where those questions decide the outcome run that way too.
AFTER_START = [c for c in CASES if c.action or c.id == "exit-3"]


@pytest.mark.parametrize("case", AFTER_START, ids=[c.id for c in AFTER_START])
def test_the_runtime_contract_on_the_podman_command_line(case: Case, provider, shared_tmp):
    check_case("podman-runsc (cli)", lambda req, action, after_s: drive_as_provider(
        provider, req, action, after_s, ops="cli"), case, provider, shared_tmp)


def check_case(kind: str, run: Driver, case: Case, provider: ProviderUser, shared_tmp: Path) -> None:
    out = output_folder(shared_tmp, provider)
    res = run(request(case, f"t-contract-{case.id}", out), case.action, case.after_s)
    if case.needs_cgroups and res["limits"]["memory"] != ENFORCED:
        pytest.skip(f"{kind}: limits on this host: {res['limits']['memory']}")
    assert res["error"] is None, res
    assert {k: res[k] for k in case.expect} == case.expect, res
    if case.action:
        assert res["fired"], f"the job never printed {READY!r}: {res}"
    if case.output_mb is not None:
        assert (out / fake.OUTPUT_FILE).stat().st_size == case.output_mb * MB
    assert res["seconds"] < case.wall_time_s + 20
    assert not res["still_exists"]
    assert set(res["limits"]) >= {"memory", "cpu", "pids", "disk", "wall_time"}


def test_a_sandbox_that_cannot_start_raises_sandbox_error(runtime, provider, shared_tmp):
    """Podman's own failure (exit 125, with its stderr), not the job's exit status."""
    kind, run = runtime
    case = Case("unknown-image", ("true",), {}, {}, image=UNKNOWN_IMAGE)
    res = run(request(case, "t-contract-unknown-image", output_folder(shared_tmp, provider)),
              "", 0.0)
    assert res["error"] is not None, res
    if kind == "podman-runsc":  # the command line tells the same
        (shared_tmp / "cli").mkdir()
        cli = drive_as_provider(provider, request(case, "t-contract-unknown-image-cli",
                                                  output_folder(shared_tmp / "cli", provider)),
                                ops="cli")
        assert cli["error"] == res["error"] | {"stderr_tail": cli["error"]["stderr_tail"]}
    assert res["error"]["exit_code"] == 125
    assert "image not known" in res["error"]["stderr_tail"]
    assert not res["still_exists"]


def test_a_sandbox_names_its_host_processes_and_none_other(runtime, provider, shared_tmp):
    """What NVML shows using a job's GPU is told apart by these: the owner-first watch
    drains the job for any other process. The real sandbox is conmon and runsc below it; the
    fake's runs in the test's own process, so it has none. Either way: never the agent."""
    kind, run = runtime
    case = Case("processes", ("sh", "-c", WAITS), fake.env(stdout=READY, run_for=300), {})
    res = run(request(case, "t-contract-processes", output_folder(shared_tmp, provider)),
              "processes", 0.0)
    assert res["error"] is None and res["fired"], res
    pids = {pid for pid, _ in res["processes"]}
    assert res["driver_pid"] not in pids
    if kind == "podman-runsc":
        names = [name for _, name in res["processes"]]
        assert "conmon" in names and len(names) >= 2, res["processes"]
    else:
        assert pids == set()
    assert res["processes_after"] == [] and not res["still_exists"]
