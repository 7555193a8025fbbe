"""The host checks themselves (tests/support/hostile.py) see what a leak would leave: each
kind of leftover is made for real, as the provider user, and must be reported. Without this,
a check that saw nothing would pass every hostile test."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid

import pytest

from campugrid.cli.platform import BASE_IMAGE
from tests.support import hostile

pytestmark = pytest.mark.acceptance


@pytest.fixture
def token() -> str:
    return str(uuid.uuid4())  # stands for a job id of the platform under test


def take(provider, canary: hostile.Canary) -> hostile.HostSnapshot:
    return hostile.snapshot(provider, disk_path=canary.path.parent, watch=[canary])


def test_each_kind_of_leftover_is_reported(provider, shared_tmp, token):
    canary = hostile.Canary.plant(shared_tmp / "canary.txt", provider, label="self-test")
    scope = hostile.Scope(tokens={token})
    before = take(provider, canary)
    assert hostile.differences(before, take(provider, canary), scope=scope) == []

    name = f"campugrid-{token}-1"
    listener = ("import socket, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); "
                "s.listen(); time.sleep(300)")
    procs = [subprocess.Popen(provider.command(["sleep", "300"]), cwd="/"),
             subprocess.Popen(provider.command([sys.executable, "-c", listener]), cwd="/")]
    cgroups = [hostile.delegated(provider, c) / name for c in ("pids", "memory")]
    made = []
    try:
        for cg in cgroups:
            if cg.parent.is_dir():
                cg.mkdir()
                made.append(cg)
        subprocess.run(provider.command(["podman", "create", "--name", name, BASE_IMAGE, "true"]),
                       check=True, capture_output=True, timeout=120, cwd="/")
        canary.path.write_text("changed\n")
        deadline = time.monotonic() + 30
        while True:
            problems = "\n".join(hostile.differences(before, take(provider, canary), scope=scope))
            if "listening socket" in problems or time.monotonic() > deadline:
                break
            time.sleep(0.2)  # the listener's interpreter is still starting
        assert "a new process of the provider user remains" in problems and "sleep 300" in problems
        assert "a new listening socket of the provider user: tcp 127.0.0.1:" in problems
        for cg in made:
            assert f"a cgroup was left behind: {cg}" in problems
        assert f"a podman container of the provider remains: {name}" in problems
        assert f"watched file {canary.path} was changed" in problems
        with pytest.raises(AssertionError, match="the host was affected"):
            hostile.assert_host_unaffected(before, take(provider, canary), scope=scope)
        # Someone else's container (no token of ours in its name) is not blamed.
        other = hostile.differences(before, take(provider, canary),
                                    scope=hostile.Scope(tokens={str(uuid.uuid4())}))
        assert not [p for p in other if name in p]
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)
        subprocess.run(provider.command(["podman", "rm", "--force", name]), capture_output=True,
                       timeout=120, cwd="/")
        for cg in made:
            cg.rmdir()


def test_build_cgroups_can_be_tolerated_by_option(provider, shared_tmp, token):
    canary = hostile.Canary.plant(shared_tmp / "canary.txt", provider, label="self-test")
    base = hostile.delegated(provider, "pids")
    if not base.is_dir():
        pytest.skip("no delegated pids cgroup on this host")
    before = take(provider, canary)
    cg = base / f"a-selftest{os.getpid()}" / f"build-localhost-campugrid-job-{token}-1"
    cg.mkdir(parents=True)
    try:
        after = take(provider, canary)
        scope = hostile.Scope(tokens={token})
        assert any("build-" in p for p in hostile.differences(before, after, scope=scope))
        assert hostile.differences(before, after, scope=scope, ignore_build_cgroups=True) == []
    finally:
        cg.rmdir()
        cg.parent.rmdir()


def test_the_canary_listener_sees_a_connection():
    with hostile.CanaryListener("127.0.0.1") as witness:
        socket.create_connection(("127.0.0.1", witness.port), timeout=5).close()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.sendto(b"x", ("127.0.0.1", witness.port))
        hits = witness.settle()
    assert sorted(h.split()[0] for h in hits) == ["tcp", "udp"], hits
