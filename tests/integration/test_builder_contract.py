"""The image Builder contract: one body per case, run against Buildah, Kaniko (its executor
image made by infra/kaniko.sh) and the fake builder (which takes what the build does from
Dockerfile comments, which real builders ignore)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Protocol

import pytest

from campugrid.builders.fake import FakeBuilder
from campugrid.builders.kaniko import EXECUTOR_IMAGE
from campugrid.cli.platform import ProviderUser
from campugrid.protocol.errors import BuildFailed
from campugrid.sandbox.fake import FakeRuntime
from tests.support.oci import BUSYBOX, busybox_image
from tests.support.provider import run_as_provider

pytestmark = pytest.mark.integration
BASE = f"FROM {BUSYBOX}\n"  # what a builder does, not what it builds: the smallest base
KANIKO_IMAGE = os.environ.get("CAMPUGRID_KANIKO_IMAGE", EXECUTOR_IMAGE)

BUILD_SCRIPT = """
import json, os, sys, threading, time
from pathlib import Path
from campugrid.builders.buildah import BuildahBuilder
from campugrid.builders.kaniko import KanikoBuilder
from campugrid.protocol.errors import BuildFailed
from campugrid.sandbox import limits
args = json.loads(sys.argv[1])
os.environ["CAMPUGRID_ALLOWED_BASES"] = args["base"]
builder = (BuildahBuilder(scope="a-contract-tests") if args["kind"] == "buildah"
           else KanikoBuilder(args["kaniko_image"]))
cancel = threading.Event()
lines = []
def log(line):
    lines.append(line)
    if line == args["cancel_on"]:
        cancel.set()
t0 = time.monotonic()
try:
    builder.build(Path(args["context"]), args["tag"], log=log, timeout_s=300,
                  cancel=cancel, memory_mb=1024, disk_mb=512)
    out = {"ok": True}
except BuildFailed as e:
    out = {"ok": False, "reason": e.reason, "tail": e.log_tail}
if args["kind"] == "buildah":
    limits.sweep(builder.limits, builder.scope)  # as the agent does after every task
print(json.dumps(out | {"lines": lines, "seconds": time.monotonic() - t0}))
"""


class Backend(Protocol):
    def build(self, context: Path, tag: str, cancel_on: str | None) -> dict[str, Any]:
        """Build; a log line equal to `cancel_on` cancels the build."""
        ...
    def exists(self, tag: str) -> bool: ...
    def remove(self, tag: str) -> None: ...


class Real:
    """Buildah or Kaniko as the provider user; images removed by the runtime's own verb."""

    def __init__(self, kind: str, provider: ProviderUser) -> None:
        self.kind, self.provider = kind, provider

    def build(self, context: Path, tag: str, cancel_on: str | None) -> dict[str, Any]:
        args = {"kind": self.kind, "kaniko_image": KANIKO_IMAGE, "context": str(context),
                "tag": tag, "cancel_on": cancel_on,
                "base": busybox_image(self.provider.command([]))}
        proc = subprocess.run(self.provider.command([sys.executable, "-c", BUILD_SCRIPT,
                                                     json.dumps(args)]),
                              capture_output=True, text=True, timeout=600, cwd="/")
        assert proc.returncode == 0, proc.stderr[-3000:]
        result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
        return result

    def exists(self, tag: str) -> bool:
        return subprocess.run(self.provider.command(["podman", "image", "exists", tag]),
                              capture_output=True).returncode == 0

    def remove(self, tag: str) -> None:
        run_as_provider(self.provider, f"""
            from campugrid.sandbox.podman_runsc import PodmanRunsc
            PodmanRunsc().remove_image({tag!r})
            print("null")
        """)


class Fake:
    def __init__(self) -> None:
        self.images: set[str] = set()
        self.builder = FakeBuilder(images=self.images)
        self.runtime = FakeRuntime(images=self.images)

    def build(self, context: Path, tag: str, cancel_on: str | None) -> dict[str, Any]:
        cancel = threading.Event()
        lines: list[str] = []

        def log(line: str) -> None:
            lines.append(line)
            if line == cancel_on:
                cancel.set()

        t0 = time.monotonic()
        try:
            self.builder.build(context, tag, log=log, timeout_s=300, cancel=cancel)
            out: dict[str, Any] = {"ok": True}
        except BuildFailed as e:
            out = {"ok": False, "reason": e.reason, "tail": e.log_tail}
        return out | {"lines": lines, "seconds": time.monotonic() - t0}

    def exists(self, tag: str) -> bool:
        return tag in self.images

    def remove(self, tag: str) -> None:
        self.runtime.remove_image(tag)


@pytest.fixture(params=["buildah", "kaniko", "fake"])
def backend(request: pytest.FixtureRequest) -> Backend:
    if request.param == "fake":
        return Fake()
    provider: ProviderUser = request.getfixturevalue("provider")
    if request.param == "kaniko":
        present = subprocess.run(provider.command(["podman", "image", "exists", KANIKO_IMAGE]),
                                 capture_output=True).returncode == 0
        if not present:
            pytest.fail(f"no Kaniko executor image ({KANIKO_IMAGE}) for {provider.name}: run "
                        "infra/kaniko.sh (infra/setup.sh does, for the test users)")
    return Real(request.param, provider)


def context(root: Path, provider: ProviderUser, dockerfile: str) -> Path:
    ctx = root / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(BASE + dockerfile)
    if os.geteuid() == 0:
        for p in (ctx, ctx / "Dockerfile"):
            os.chown(p, provider.uid, provider.gid)
    return ctx


def test_a_good_dockerfile_builds_and_its_image_can_be_removed(backend, provider, shared_tmp):
    ctx = context(shared_tmp, provider, "# fake: log=built-5e1d\n"
                                        "RUN echo built-5e1d && echo 42 > /answer\n"
                                        'CMD ["cat", "/answer"]\n')
    tag = "localhost/campugrid-test/contract-good:1"
    try:
        res = backend.build(ctx, tag, None)
        assert res["ok"], res
        assert "built-5e1d" in res["lines"]
        assert backend.exists(tag)
    finally:
        backend.remove(tag)
    assert not backend.exists(tag)


def test_a_failing_run_step_fails_the_build_with_the_log_tail(backend, provider, shared_tmp):
    ctx = context(shared_tmp, provider, "# fake: log=about-to-fail-7f3a\n"
                                        "# fake: fail=build failed (RUN step exit 3)\n"
                                        "RUN echo about-to-fail-7f3a && exit 3\n")
    tag = "localhost/campugrid-test/contract-fails:1"
    res = backend.build(ctx, tag, None)
    assert not res["ok"] and "build failed" in res["reason"], res
    assert "about-to-fail-7f3a" in res["tail"].splitlines(), res  # the step's own output
    assert not backend.exists(tag)


def test_a_cancelled_build_stops_and_its_log_came_as_it_ran(backend, provider, shared_tmp):
    ctx = context(shared_tmp, provider, "# fake: log=waiting-9c1e\n# fake: run_for=120\n"
                                        "RUN echo waiting-9c1e && sleep 120\n")
    tag = "localhost/campugrid-test/contract-cancelled:1"
    # Cancelled by its own log line: a log read only once the step ended would never cancel it.
    res = backend.build(ctx, tag, "waiting-9c1e")
    assert not res["ok"] and res["reason"] == "build cancelled", res
    assert res["seconds"] < 60
    assert not backend.exists(tag)
