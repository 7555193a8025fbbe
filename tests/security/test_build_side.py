"""Hostile builds, for real: rootless Buildah as the provider user, RUN steps under gVisor.

Most of these go *around* the Dockerfile check on purpose (the builder is handed the bases
itself), to show the build is closed even where a check missed something: Buildah's own
process reaches nothing but the egress proxy (tests/security/test_build_network.py), sees no
image but the allowed bases, writes at most its disk limit, and nothing of it outlives a
killed agent.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from campugrid.buildpolicy.dockerfiles import check_dockerfile
from campugrid.cli.platform import ProviderUser
from campugrid.protocol.errors import InvalidInput
from tests.support import hostile
from tests.support.dockerfiles import CORPUS
from tests.support.provider import SYSCALLS

pytestmark = pytest.mark.integration
BASE = "localhost/campugrid/python:bookworm"
SCOPE = "a-security-tests"

BUILD = """
import json, os, sys
from pathlib import Path
from campugrid.builders.buildah import BuildahBuilder
from campugrid.buildpolicy.dockerfiles import check_dockerfile
from campugrid.protocol.errors import BuildFailed
args = json.loads(sys.argv[1])
os.environ["CAMPUGRID_ALLOWED_BASES"] = args["base"]
if args.get("builder") == "kaniko":
    from campugrid.builders.kaniko import EXECUTOR_IMAGE, KanikoBuilder
    builder = KanikoBuilder(EXECUTOR_IMAGE)
else:
    builder = BuildahBuilder(scope=args["scope"])
# Around the check: the bases of a harmless file, whatever the real one says.
bases = check_dockerfile("FROM " + args["base"]).bases if args["around_check"] else None
lines = []
out = {"limits": builder.limits.as_dict() if hasattr(builder, "limits") else {}}
print(json.dumps({"pid": os.getpid()}), flush=True)
from campugrid.agent import buildnet
from campugrid.egress.policy import CA_ENV, Policy, parse_pins
if args.get("ca"):  # the operator's extra certificates for builds, which RUN steps see
    import tempfile
    ca = Path(tempfile.mkdtemp()) / "ca.pem"
    ca.write_text(args["ca"])
    os.environ[CA_ENV] = str(ca)
# As the agent builds: online through its egress proxy (here in local mode: this machine's
# own way out, by the platform's rules), unless the test asks for an offline build.
policy = Policy(hosts=tuple(args.get("hosts") or Policy().hosts), pins=parse_pins(args.get("pins", "")))
with buildnet.open_network([], wanted="default" if args.get("online", True) else "none",
                           mode="local", disk_mb=args["disk_mb"], log=lines.append,
                           policy=policy) as net:
    try:
        builder.build(Path(args["context"]), args["tag"], log=lines.append,
                      timeout_s=args["timeout_s"], memory_mb=args["memory_mb"],
                      disk_mb=args["disk_mb"], bases=bases, egress=net.socket,
                      volumes=net.volumes)
        out.update(ok=True)
    except BuildFailed as e:
        out.update(ok=False, reason=e.reason, tail=e.log_tail)
out["lines"] = lines
if args["sweep"] and hasattr(builder, "limits"):  # as the agent does after every task
    from campugrid.sandbox import limits
    limits.sweep(builder.limits, args["scope"])
print(json.dumps(out))
"""


class Recorder(http.server.BaseHTTPRequestHandler):
    seen: list[str] = []

    def do_GET(self) -> None:
        Recorder.seen.append(self.path)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"host data\n")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def listener() -> Iterator[int]:
    """A host service on loopback, as the coordinator or SeaweedFS would be: records hits."""
    Recorder.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def make_context(root: Path, provider, dockerfile: str, **files: str) -> str:
    ctx = root / f"ctx-{len(list(root.iterdir()))}"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(dockerfile)
    for name, text in files.items():
        (ctx / name).write_text(text)
    if os.geteuid() == 0:
        os.chown(root, provider.uid, provider.gid)
        for p in (ctx, *ctx.iterdir()):
            os.chown(p, provider.uid, provider.gid)
    return str(ctx)


def build(provider, context: str, tag: str, *, around_check: bool = True, disk_mb: int = 256,
          memory_mb: int = 1024, timeout_s: float = 300, online: bool = True,
          hosts: tuple[str, ...] = (), pins: str = "", builder: str = "buildah",
          base: str = BASE, ca: str = "") -> dict:
    args = {"context": context, "tag": tag, "timeout_s": timeout_s, "memory_mb": memory_mb,
            "disk_mb": disk_mb, "scope": SCOPE, "base": base, "around_check": around_check,
            "sweep": True, "online": online, "hosts": list(hosts), "pins": pins,
            "builder": builder, "ca": ca}
    proc = subprocess.run(provider.command([sys.executable, "-c", BUILD, json.dumps(args)]),
                          capture_output=True, text=True, timeout=timeout_s + 120, cwd="/")
    if proc.returncode != 0:
        raise AssertionError(f"build script failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def provider_processes(provider, pattern: str) -> list[str]:
    out = subprocess.run(["pgrep", "-u", str(provider.uid), "-a", "-f", pattern],
                         capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


def scope_cgroups() -> list[str]:
    root = hostile.delegated(ProviderUser.resolve(), "memory") / SCOPE
    return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def scope_processes() -> list[str]:
    """The command lines of everything in the test scope's cgroups (the build's processes,
    including what left buildah's process group)."""
    root = hostile.delegated(ProviderUser.resolve(), "pids") / SCOPE
    out = []
    for procs in root.glob("*/cgroup.procs"):
        for pid in procs.read_text().split():
            with contextlib.suppress(OSError):
                out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
    return out


def sweep_scope(provider) -> list[str]:
    code = ("from campugrid.sandbox import limits; "
            f"print(limits.sweep(limits.detect(), {SCOPE!r}))")
    return subprocess.run(provider.command([sys.executable, "-c", code]), capture_output=True,
                          text=True, check=True, timeout=120).stdout


def image_exists(provider, ref: str) -> bool:
    return subprocess.run(provider.command(["podman", "image", "exists", ref]),
                          capture_output=True).returncode == 0


# Every spelling that hides a fetch, heredocs included (Buildah 1.28 runs their body lines).
URL_SPELLINGS = [c for c in CORPUS if c[3] in (None, "plain word", "heredocs") and "ADD" in c[1]]


@pytest.mark.parametrize("case", URL_SPELLINGS, ids=[c[0] for c in URL_SPELLINGS])
def test_no_spelling_of_a_url_reaches_the_host_even_around_the_check(provider, shared_tmp,
                                                                      listener, case):
    _, text, _, _ = case
    text = text.replace("127.0.0.1/", f"127.0.0.1:{listener}/")
    for port in ("8750", "8888", "8333"):
        text = text.replace(f"127.0.0.1:{port}/", f"127.0.0.1:{listener}/")
    assert f"127.0.0.1:{listener}" in text or "$" in text or "git@" in text
    if case[3] is None:  # an http ADD: the check lets it through to the network ...
        check_dockerfile(text)
    else:
        with pytest.raises(InvalidInput):  # the check refuses it ...
            check_dockerfile(text)
    res = build(provider, make_context(shared_tmp, provider, text), "localhost/campugrid-test/url:1")
    # ... and a build handed it anyway fetches nothing: the listener saw no request.
    assert Recorder.seen == [], (Recorder.seen, res)
    assert not image_exists(provider, "localhost/campugrid-test/url:1") or res["ok"]
    if case[0] in ("continued URL", "escape directive", "JSON form", "ARG holding a URL",
                   "heredoc hiding an ADD"):  # Buildah did try, and the build log says so:
        # Go skips the proxy for loopback, and the build namespace's own loopback has nothing
        log = "\n".join(res["lines"])
        assert f"dial tcp 127.0.0.1:{listener}: connect: connection refused" in log, log
    subprocess.run(provider.command(["podman", "rmi", "-f", "localhost/campugrid-test/url:1"]),
                   capture_output=True)


def test_the_listener_is_reachable_without_the_namespace(provider, listener):
    """The control: the provider user reaches the listener from the host network, so the
    tests above would see a fetch if Buildah's network namespace were missing."""
    code = f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{listener}/x').read())"
    subprocess.run(provider.command([sys.executable, "-c", code]), check=True,
                   capture_output=True, timeout=60)
    assert Recorder.seen == ["/x"]


@pytest.fixture(scope="module")
def victim(provider) -> Iterator[str]:
    """Another job's image in the provider's store, holding a secret."""
    root = Path(tempfile.mkdtemp(prefix="campugrid-victim-"))
    os.chmod(root, 0o711)
    ctx = make_context(root, provider, f"FROM {BASE}\nRUN echo victim-secret-5d1 > /secret\n")
    tag = f"localhost/campugrid-job/a-other/victim:{os.getpid()}"
    res = build(provider, ctx, tag)
    assert res["ok"], res
    yield tag
    subprocess.run(provider.command(["podman", "rmi", "-f", tag]), capture_output=True)
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("how", ["FROM", "COPY --from", "RUN --mount from"])
def test_another_jobs_image_cannot_be_named_even_around_the_check(provider, shared_tmp, victim, how):
    dockerfile = {
        "FROM": f"FROM {victim}\nRUN cat /secret\n",
        "COPY --from": f"FROM {BASE}\nCOPY --from={victim} /secret /s\nRUN cat /s\n",
        "RUN --mount from": f"FROM {BASE}\nRUN --mount=type=bind,from={victim},target=/v cat /v/secret\n",
    }[how]
    with pytest.raises(InvalidInput):
        check_dockerfile(dockerfile)
    res = build(provider, make_context(shared_tmp, provider, dockerfile), "localhost/campugrid-test/steal:1")
    assert not res["ok"], res
    assert "victim-secret-5d1" not in "\n".join(res["lines"])
    assert image_exists(provider, victim)  # it exists: only the build could not see it


def host_disk_free() -> int:
    return shutil.disk_usage("/").free


def test_a_build_that_writes_past_its_disk_limit_fails_saying_so(provider, shared_tmp):
    free = host_disk_free()
    # Random bytes (zeros could be stored sparse). The step fails at the wall: dd's ENOSPC is
    # its exit status. (Whether a layer that filled the store to the brim then commits is
    # Buildah's business either way; the sparse-file tests below make the commit the wall.)
    ctx = make_context(shared_tmp, provider, f"FROM {BASE}\n"
                       "RUN dd if=/dev/urandom of=/fill bs=1M count=2000 && echo wrote\n")
    res = build(provider, ctx, "localhost/campugrid-test/disk:1", disk_mb=64, memory_mb=512)
    assert not res["ok"] and "more than 64 MB of disk" in res["reason"], res
    # The bound is the build store itself (a 64 MB tmpfs): dd stopped inside it.
    assert "No space left on device" in "\n".join(res["lines"])
    after = host_disk_free()
    assert free - after < 200 * 1024**2, f"host disk fell by {(free - after) // 1024**2} MB"
    assert not image_exists(provider, "localhost/campugrid-test/disk:1")


SPARSE = "RUN python3 -c \"f = open('/big', 'wb'); f.seek(1 << 30); f.write(b'x')\"\n"


@pytest.mark.parametrize("where", ["final stage", "earlier stage"])
def test_a_sparse_file_does_not_grow_past_the_disk_limit_when_the_layer_is_committed(
        provider, shared_tmp, where):
    """A 1 GB file of one written byte takes a few KB of the build's tmpfs, but a layer
    holds it in full: the commit must stop near the limit, not fill the host's disk. Made in
    an earlier stage and copied over, it is the final layer's again."""
    free = host_disk_free()
    dockerfile = f"FROM {BASE}\n{SPARSE}" if where == "final stage" else \
        f"FROM {BASE} AS first\n{SPARSE}FROM {BASE}\nCOPY --from=first /big /big\n"
    ctx = make_context(shared_tmp, provider, dockerfile)
    res = build(provider, ctx, "localhost/campugrid-test/sparse:1", disk_mb=64, memory_mb=512)
    assert not res["ok"] and "more than 64 MB of disk" in res["reason"], res
    after = host_disk_free()
    assert free - after < 200 * 1024**2, f"host disk fell by {(free - after) // 1024**2} MB"
    assert not image_exists(provider, "localhost/campugrid-test/sparse:1")


def test_empty_folders_that_take_no_disk_do_not_inflate_the_committed_layer(provider, shared_tmp):
    """200,000 empty folders take no data on the tmpfs, but 512 bytes each of the layer's
    tar: 98 MB, past the layer limit of an 8 MB build (8 x 1.25 + 64 MB)."""
    ctx = make_context(shared_tmp, provider, f"FROM {BASE}\n"
                       "RUN python3 -c \"import os; [os.makedirs(f'/d/{i // 1000}/{i}') "
                       "for i in range(200000)]\"\n")
    res = build(provider, ctx, "localhost/campugrid-test/folders:1", disk_mb=8, memory_mb=512)
    assert not res["ok"] and "more than 8 MB of disk" in res["reason"], res
    assert not image_exists(provider, "localhost/campugrid-test/folders:1")


def test_a_build_within_its_disk_limit_succeeds(provider, shared_tmp):
    """40 MB of 64: the commit writes its layer into the provider's store, not into the
    build's tmpfs beside the working layer (where both together would not fit)."""
    ctx = make_context(shared_tmp, provider, f"FROM {BASE}\n"
                       "RUN dd if=/dev/zero of=/fill bs=1M count=40\n")
    tag = "localhost/campugrid-test/disk-ok:1"
    res = build(provider, ctx, tag, disk_mb=64)
    try:
        assert res["ok"], res
        assert image_exists(provider, tag)
    finally:
        subprocess.run(provider.command(["podman", "rmi", "-f", tag]), capture_output=True)


def test_a_fork_bomb_in_a_run_step_is_held(provider, shared_tmp):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    ctx = make_context(shared_tmp, provider, f"FROM {BASE}\nCOPY bomb.py /b.py\n"
                       "RUN timeout 10 python3 /b.py; echo survived\n", **{"bomb.py": bomb})
    before = len(provider_processes(provider, "."))
    res = build(provider, ctx, "localhost/campugrid-test/bomb:1", timeout_s=120)
    subprocess.run(provider.command(["podman", "rmi", "-f", "localhost/campugrid-test/bomb:1"]),
                   capture_output=True)
    # Held: inside gVisor (fork fails) or at the build cgroup's pids ceiling (the sandbox dies);
    # either way nothing of it is left, and the next build on this host works.
    wait_until(lambda: len(provider_processes(provider, ".")) <= before + 2, 30,
               f"the bomb's processes to be gone (build: {res.get('reason', 'ok')})")
    sweep_scope(provider)  # as the agent does after every task
    assert scope_cgroups() == []
    ctx = make_context(shared_tmp, provider, f"FROM {BASE}\nRUN echo next-build-fine\n")
    after = build(provider, ctx, "localhost/campugrid-test/after-bomb:1")
    subprocess.run(provider.command(["podman", "rmi", "-f", "localhost/campugrid-test/after-bomb:1"]),
                   capture_output=True)
    assert after["ok"] and "next-build-fine" in after["lines"], after


def test_network_from_a_run_step_reaches_nothing(provider, shared_tmp, listener):
    probe = (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {listener}), timeout=3)\n"
             "    print('NET reached')\nexcept OSError as e:\n    print('NET refused', e)\n")
    ctx = make_context(shared_tmp, provider, f"FROM {BASE}\nCOPY p.py /p.py\nRUN python3 /p.py\n",
                       **{"p.py": probe})
    res = build(provider, ctx, "localhost/campugrid-test/net:1")
    subprocess.run(provider.command(["podman", "rmi", "-f", "localhost/campugrid-test/net:1"]),
                   capture_output=True)
    assert any(line.startswith("NET refused") for line in res["lines"]), res
    assert Recorder.seen == []


def test_a_build_does_not_outlive_a_killed_agent(provider, shared_tmp):
    ctx = make_context(shared_tmp, provider, f"FROM {BASE}\n"
                       "RUN echo build-started-7c2 && sleep 300\n")
    args = {"context": ctx, "tag": "localhost/campugrid-test/orphan:1", "timeout_s": 600,
            "memory_mb": 512, "disk_mb": 64, "scope": SCOPE, "base": BASE, "around_check": True,
            "sweep": False}
    proc = subprocess.Popen(provider.command([sys.executable, "-c", BUILD, json.dumps(args)]),
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        pid = json.loads(proc.stdout.readline())["pid"]
        # The RUN step runs inside gVisor: on the host it is runsc's sandbox, in the build's cgroup.
        wait_until(lambda: any("runsc-sandbox" in c or "boot" in c for c in scope_processes()), 60,
                   "the RUN step's sandbox to start")
        members = scope_processes()
        assert any("buildah" in c for c in members), members
        os.kill(pid, signal.SIGKILL)  # the agent's own process, as kill -9 would
        wait_until(lambda: scope_processes() == [], 20, "every process of the build to be killed")
        wait_until(lambda: scope_cgroups() == [], 20, "the build's cgroups to be removed")
        assert not provider_processes(provider, "campugrid-test/orphan")
        assert not image_exists(provider, "localhost/campugrid-test/orphan:1")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def wait_until(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def test_run_steps_get_the_strict_seccomp_profile_too(provider, shared_tmp):
    ctx = make_context(shared_tmp, provider, f"FROM {BASE}\nCOPY s.py /s.py\nRUN python3 /s.py\n",
                       **{"s.py": SYSCALLS.replace("print(json.dumps(", "print('SYSCALLS', json.dumps(")})
    res = build(provider, ctx, "localhost/campugrid-test/seccomp:1")
    subprocess.run(provider.command(["podman", "rmi", "-f", "localhost/campugrid-test/seccomp:1"]),
                   capture_output=True)
    seen = json.loads(next(line for line in res["lines"] if line.startswith("SYSCALLS "))[9:])
    assert seen["getpid"] == seen["select"] == "ok" and seen["unshare"] != "ok" and seen["ptrace"] != "ok", seen
