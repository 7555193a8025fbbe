"""Builders, for real: rootless Buildah with RUN steps under runsc; Kaniko where it can run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from campugrid.agent.buildnet import CA_MOUNT
from campugrid.builders.kaniko import EXECUTOR_IMAGE
from tests.support.oci import busybox_image
from tests.support.provider import buildah_build, run_as_provider, sandbox_run
from tests.support.runtimes import gvisor_kernel
from tests.support.timing import BUILT

pytestmark = pytest.mark.integration
BASE = "FROM localhost/campugrid/python:bookworm\n"


def context(root: Path, provider, dockerfile: str, *, base: str = BASE, **files: str) -> str:
    ctx = root / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(base + dockerfile)
    for name, text in files.items():
        (ctx / name).write_text(text)
    if os.geteuid() == 0:
        for p in (ctx, *ctx.iterdir()):
            os.chown(p, provider.uid, provider.gid)
    return str(ctx)


def remove_image(provider, tag: str) -> None:
    subprocess.run(provider.command(["podman", "rmi", "-f", tag]), capture_output=True)


def test_run_steps_execute_in_gvisor_without_network(provider, shared_tmp):
    probe = ("import json, platform, socket\n"
             "ifs = sorted(l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:])\n"
             "try:\n    socket.create_connection(('127.0.0.1', 22), timeout=2); net = 'reached'\n"
             "except OSError as e:\n    net = 'refused'\n"
             "print('PROBE', json.dumps({'kernel': platform.release(), 'ifs': ifs, 'net': net}))\n")
    ctx = context(shared_tmp, provider, "COPY probe.py /probe.py\nRUN python3 /probe.py && "
                  "python3 -c 'print(6*7)' > /answer\nCMD [\"cat\", \"/answer\"]\n",
                  **{"probe.py": probe})
    tag = "localhost/campugrid-test/buildprobe:1"
    res = buildah_build(provider, ctx, tag)
    try:
        assert res["ok"], res
        probe_line = next(line for line in res["lines"] if line.startswith("PROBE "))
        assert gvisor_kernel(json.loads(probe_line.split(" ", 1)[1])["kernel"]), probe_line
        assert '"ifs": ["lo"]' in probe_line and '"net": "refused"' in probe_line
        # Committed straight into the provider's store, which the log does not name (its
        # path holds the provider's user name).
        assert f"COMMIT {tag}" in res["lines"], res["lines"]
        assert not any("containers-storage:[" in line for line in res["lines"]), res["lines"]
        # Nor Buildah's word on every layer it copies and image it writes.
        assert not any(line.startswith(("Copying blob", "Copying config", "Writing manifest"))
                       for line in res["lines"]), res["lines"]
        out = shared_tmp / "out"
        out.mkdir()
        os.chown(out, provider.uid, provider.gid) if os.geteuid() == 0 else None
        run = sandbox_run(provider, name="t-built", image=tag, command=None,
                          output_dir=str(out))
        assert run["exit_code"] == 0 and run["lines"] == ["42"]
    finally:
        remove_image(provider, tag)


def test_a_multi_stage_build_commits_its_last_stage_into_the_providers_store(provider, shared_tmp):
    """The earlier stage stays in the build's own store; the last is committed straight
    into the provider's, its log line ("[2/2] COMMIT ...") naming the image, timed."""
    ctx = context(shared_tmp, provider, "RUN echo from-the-first-stage > /made\n"
                  "FROM localhost/campugrid/python:bookworm\nCOPY --from=0 /made /made\n"
                  "CMD [\"cat\", \"/made\"]\n")
    tag = "localhost/campugrid-test/stages:1"
    res = buildah_build(provider, ctx, tag)
    try:
        assert res["ok"], res
        assert f"[2/2] COMMIT {tag}" in res["lines"], res["lines"]
        assert any(BUILT.search(line) for line in res["lines"]), res["lines"]
        out = shared_tmp / "out"
        out.mkdir()
        os.chown(out, provider.uid, provider.gid) if os.geteuid() == 0 else None
        run = sandbox_run(provider, name="t-stages", image=tag, command=None,
                          output_dir=str(out))
        assert run["exit_code"] == 0 and run["lines"] == ["from-the-first-stage"], run
    finally:
        remove_image(provider, tag)


def test_run_steps_read_a_volume_that_leaves_no_trace_in_the_image(provider, shared_tmp):
    """How RUN steps see files the agent gives them (extra certificates, agent/buildnet.py):
    read-only, under /dev. Buildah leaves a volume's mount point in the image, as an empty folder; under /dev,
    which every runtime mounts afresh, no container of the image ever sees it."""
    IN_BUILD = CA_MOUNT.replace("build-ca.pem", "shelf")  # where the certificates go too
    shelf = shared_tmp / "shelf"
    shelf.mkdir()
    (shelf / "pkg.txt").write_text("from-the-shelf\n")
    if os.geteuid() == 0:
        for p in (shelf, shelf / "pkg.txt"):
            os.chown(p, provider.uid, provider.gid)
    ctx = context(shared_tmp, provider,
                  f"RUN cp {IN_BUILD}/pkg.txt /got && (touch {IN_BUILD}/x 2>/dev/null "
                  "&& echo writable || echo read-only) > /mode\n")
    tag = "localhost/campugrid-test/volume:1"
    res = buildah_build(provider, ctx, tag, volumes=[(str(shelf), IN_BUILD)])
    try:
        assert res["ok"], res
        layout = shared_tmp / "layout"
        layout.mkdir()
        os.chown(layout, provider.uid, provider.gid) if os.geteuid() == 0 else None
        subprocess.run(provider.command(["skopeo", "copy", "--quiet",
                                         f"containers-storage:{tag}", f"dir:{layout}"]),
                       check=True, timeout=120)
        manifest = json.loads((layout / "manifest.json").read_text())
        with tarfile.open(layout / manifest["layers"][-1]["digest"].split(":")[1]) as top:
            members = {m.name.lstrip("./"): m for m in top.getmembers()}
            names = set(members)
            got = {n: top.extractfile(n).read().decode().strip()  # type: ignore[union-attr]
                   for n in ("got", "mode")}
        assert got == {"got": "from-the-shelf", "mode": "read-only"}
        assert names - {"dev", "run"} == {"got", "mode", IN_BUILD.lstrip("/")}, sorted(names)
        assert members[IN_BUILD.lstrip("/")].isdir()  # empty: nothing below it
    finally:
        remove_image(provider, tag)


def test_a_failing_run_step_fails_the_build_with_the_log_tail(provider, shared_tmp):
    ctx = context(shared_tmp, provider, "RUN echo about-to-fail-7f3a && exit 3\n")
    res = buildah_build(provider, ctx, "localhost/campugrid-test/fails:1")
    assert not res["ok"]
    assert "build failed" in res["reason"]
    assert "about-to-fail-7f3a" in res["tail"]


def test_a_missing_base_image_is_named_in_the_failure(provider, shared_tmp):
    ctx = shared_tmp / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text("FROM localhost/not-on-this-provider:1\nRUN true\n")
    if os.geteuid() == 0:
        os.chown(ctx, provider.uid, provider.gid)
        os.chown(ctx / "Dockerfile", provider.uid, provider.gid)
    res = buildah_build(provider, str(ctx), "localhost/campugrid-test/nobase:1")
    assert not res["ok"] and "not-on-this-provider" in res["reason"]
    assert "not an allowed base image" in res["reason"]


def test_a_memory_hog_run_step_is_stopped_where_limits_hold(provider, shared_tmp):
    hog = "b = bytearray(600 * 1024 * 1024); b[::4096] = b'x' * len(b[::4096]); print('built')"
    ctx = context(shared_tmp, provider, f'RUN python3 -c "{hog}"\n')
    res = buildah_build(provider, ctx, "localhost/campugrid-test/hog:1", memory_mb=256, disk_mb=64)
    remove_image(provider, "localhost/campugrid-test/hog:1")
    if res["limits"]["memory"] != "enforced":
        pytest.skip(f"memory limit on this host: {res['limits']['memory']}")
    assert not res["ok"], "a 600 MB RUN step finished inside a 256 MB build"


def test_a_pulled_base_leaves_the_builds_store_when_the_provider_evicts_it(provider, shared_tmp):
    """Bases pulled for jobs (the image cache's names) are copied into the store builds see;
    the next build drops those the provider's own store no longer has, and only those."""
    ctx = context(shared_tmp, provider, "RUN true\n")
    res = run_as_provider(provider, f"""
        import json, subprocess
        from pathlib import Path
        from campugrid.builders.buildah import PULLED_PREFIX, BuildahBuilder
        b = BuildahBuilder()
        graph, run = b.main_store()
        gone, kept = PULLED_PREFIX + "t-evict:gone", PULLED_PREFIX + "t-evict:kept"
        def bases():
            listed = b._buildah_bases("images", "--json")
            return sorted(n for i in json.loads(listed.stdout) for n in i.get("names") or ())
        for name in (gone, kept):
            subprocess.run(["podman", "tag", "localhost/campugrid/python:bookworm", name], check=True)
            b._buildah_bases("pull", "-q", f"containers-storage:[overlay@{{graph}}+{{run}}]{{name}}")
        before = bases()
        subprocess.run(["podman", "untag", "localhost/campugrid/python:bookworm", gone], check=True)
        b.build(Path({ctx!r}), "localhost/campugrid-test/evict:1", log=lambda line: None,
                timeout_s=300)
        after = bases()
        subprocess.run(["podman", "untag", "localhost/campugrid/python:bookworm", kept])
        subprocess.run(["podman", "rmi", "-f", "localhost/campugrid-test/evict:1"])
        b._drop_evicted()
        print(json.dumps({{"before": before, "after": after, "gone": gone, "kept": kept}}))
    """)
    assert res["gone"] in res["before"] and res["kept"] in res["before"], res
    assert res["gone"] not in res["after"], res
    assert res["kept"] in res["after"] and "localhost/campugrid/python:bookworm" in res["after"], res


def test_kaniko_builds_under_runsc_and_its_image_runs(provider, shared_tmp):
    """RUN steps in gVisor, a disk that holds, the same image from the same inputs, no
    service left behind, and an image that runs."""
    image = os.environ.get("CAMPUGRID_KANIKO_IMAGE", EXECUTOR_IMAGE)
    present = subprocess.run(provider.command(["podman", "image", "exists", image]),
                             capture_output=True).returncode == 0
    if not present:
        pytest.fail(f"no Kaniko executor image ({image}) for {provider.name}: run "
                    "infra/kaniko.sh (infra/setup.sh does, for the test users)")
    # The second step writes past the build's disk (64 MB beyond its base): gVisor's overlay
    # of the executor's root refuses it, and what was written goes with the step.
    # On the smallest base: what Kaniko does, not what it builds (the Python base's 440 MB
    # took most of a minute to unpack and snapshot, twice).
    base = busybox_image(provider.command([]))
    ctx = context(shared_tmp, provider, "RUN uname -r > /kernel\n"
                  "RUN dd if=/dev/zero of=/fill bs=1M count=200 || true; rm -f /fill\n"
                  "CMD [\"cat\", \"/kernel\"]\n", base=f"FROM {base}\n")
    tag, again = "localhost/campugrid-test/kaniko:1", "localhost/campugrid-test/kaniko:2"
    work = shared_tmp / "work"  # where the build's own API service listens, and nothing after
    work.mkdir()
    os.chown(work, provider.uid, provider.gid) if os.geteuid() == 0 else None
    res = run_as_provider(provider, f"""
        import json, os, subprocess, tempfile
        from pathlib import Path
        from campugrid.builders.kaniko import KanikoBuilder
        os.environ["CAMPUGRID_ALLOWED_BASES"] = {base!r}
        tempfile.tempdir = {str(work)!r}
        lines, ids = [], []
        slot = Path({str(work)!r}) / "slot"  # as the agent's output slot: the image folder's disk
        slot.mkdir()
        from campugrid.buildpolicy.dockerfiles import check_dockerfile, pin_bases
        builder = KanikoBuilder({image!r})
        text = (Path({ctx!r}) / "Dockerfile").read_text()
        bases = check_dockerfile(text).bases
        prepared = Path({str(work)!r}) / "Dockerfile.prepared"  # as the agent hands it over
        prepared.write_text(pin_bases(text, builder.pins(bases)))
        for tag, on, dockerfile in (({tag!r}, None, None), ({again!r}, slot, prepared)):
            # the same inputs twice (the second as the agent builds: its copy of the
            # Dockerfile, the bases named as Kaniko finds them): the same image
            builder.build(Path({ctx!r}), tag, log=lines.append, timeout_s=600, disk_mb=64,
                          store_on=on, bases=bases, dockerfile=dockerfile)
            ids.append(subprocess.run(["podman", "image", "inspect", "--format", "{{{{.Id}}}}", tag],
                                      capture_output=True, text=True).stdout.strip())
        left = subprocess.run(["pgrep", "-af", {str(work) + "/kaniko-[^/]*/api[.]sock"!r}], capture_output=True, text=True)
        print(json.dumps({{"lines": lines, "left": left.stdout, "ids": ids,
                          "slot": [p.name for p in slot.iterdir()]}}))  # the pattern matches no script
    """, timeout=900)
    try:
        assert res["left"] == "", res  # the build's Podman API service stopped with it
        assert any("No space left on device" in line for line in res["lines"]), res["lines"]
        assert res["ids"][0] and res["ids"] == [res["ids"][0]] * 2, res["ids"]  # --reproducible
        assert res["slot"] == [], res["slot"]  # the image folder went with the build
        out = shared_tmp / "out"
        out.mkdir()
        os.chown(out, provider.uid, provider.gid) if os.geteuid() == 0 else None
        run = sandbox_run(provider, name="t-kaniko", image=tag, command=None, output_dir=str(out))
        assert len(run["lines"]) == 1 and gvisor_kernel(run["lines"][0]), (res, run)  # gVisor's
    finally:
        remove_image(provider, tag)
        remove_image(provider, again)


def test_the_runsc_a_provider_names_runs_the_run_steps(provider, shared_tmp):
    """`campugrid agent run --runsc PATH`: that runsc, not the first on PATH, runs the RUN
    steps (and the jobs: the runtime gives podman the same path)."""
    real = shutil.which("runsc")
    assert real is not None
    logged = shared_tmp / "runsc-logged"
    calls = shared_tmp / "runsc-calls"
    logged.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\nexec {real} \"$@\"\n")
    calls.write_text("")
    logged.chmod(0o755)
    if os.geteuid() == 0:
        os.chown(calls, provider.uid, provider.gid)
    ctx = context(shared_tmp, provider, "RUN uname -r > /kernel\n")
    tag = "localhost/campugrid-test/named-runsc:1"
    try:
        res = run_as_provider(provider, f"""
            import json
            from pathlib import Path
            from campugrid.agent import backends
            runtime, builder = backends.choose("podman-runsc", "buildah",
                                               backends.BackendOptions(runsc={str(logged)!r}))
            lines = []
            builder.build(Path({ctx!r}), {tag!r}, log=lines.append, timeout_s=300)
            print(json.dumps({{"runtime": runtime.runsc, "lines": lines}}))
        """, timeout=600)
        assert res["runtime"] == str(logged)
        assert " create " in calls.read_text(), (calls.read_text(), res["lines"])
    finally:
        remove_image(provider, tag)
