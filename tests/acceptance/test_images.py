"""Build once, run anywhere, for real: three agents, the embedded registry, the coordinator's
tokens. A sharded job builds its image on one machine and the others pull it by digest;
a "verified" job is built by two machines to the same digest before anyone pulls it."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from campugrid.cli.platform import Platform
from campugrid.cli.seaweed import free_port
from campugrid.client import tar_folder
from campugrid.protocol.spec import JobSpec

pytestmark = pytest.mark.acceptance
DIGEST = r"sha256:[0-9a-f]{64}"
SHARD = ("import os, time; time.sleep(0.3); "
         "print(open('/built.txt').read().strip(), os.environ['CAMPUGRID_SHARD_INDEX'])")


@pytest.fixture(scope="module")
def three() -> Iterator[Platform]:
    """The platform as `campugrid up` starts it (registry included), with three agents."""
    root = Path(tempfile.mkdtemp(prefix="campugrid-images-"))
    os.chmod(root, 0o711)
    p = Platform(root / "state", http_port=free_port(), lease_seconds=4.0,
                 admin_identity=root / "admin.json").start()
    try:
        for i in range(3):
            p.start_agent(f"images-{i}", args=("--metrics-port", "0"))
        yield p
    finally:
        p.stop()
        for i in range(3):
            log = root / "state" / "agents" / f"images-{i}.log"
            if log.exists():
                print(f"--- images-{i} (tail) ---\n" + "\n".join(log.read_text().splitlines()[-15:]))
        shutil.rmtree(root, ignore_errors=True)


def context(tmp_path: Path, mark: str, more: str = "") -> bytes:
    ctx = tmp_path / mark
    ctx.mkdir()
    (ctx / "Dockerfile").write_text("FROM localhost/campugrid/python:bookworm\n"
                                    f"RUN echo {mark} > /built.txt\n{more}")
    return tar_folder(ctx)


# A file on PyPI's file host, which never changes: Kaniko fetches an ADD's URL itself.
WHEEL = ("https://files.pythonhosted.org/packages/31/b4/b9b800c45527aadd64d5b442f9b932b00648617"
         "eb5d63d2c7a6587b7cafc/jmespath-1.0.1-py3-none-any.whl")
WHEEL_SHA256 = "02e2e4cc71b5bcab88332eebf907519190dd9e6e82107fa7f83b1003a6252980"


def image_events(api, job_id: str) -> list[str]:
    return [e["detail"] for e in api.job(job_id)["events"] if e["kind"] == "image"]


def build_lines(api, job_id: str) -> list[str]:
    return [line for c in api.logs(job_id)["chunks"] if c["stream"] == "build"
            for line in c["text"].splitlines() if line.startswith("[campugrid]")]


def test_a_sharded_job_over_three_agents_builds_its_image_once(three, tmp_path):
    with three.api() as api:
        spec = JobSpec.from_dict({"command": ["python3", "-c", SHARD],
                                  "shards": [{"payload": i} for i in range(40)]})
        job = api.submit(context(tmp_path, "once"), spec)
        final = api.wait(job["id"], timeout_s=600, poll_s=0.2)
        assert final["state"] == "succeeded", final
        shards = list(api.shards(job["id"]))
        assert all(s["result"] == f"once {s['index']}" for s in shards), shards[:3]
        machines = {s["machine_id"] for s in shards}
        assert len(machines) >= 2, machines  # the work was spread, the build was not
        events = image_events(api, job["id"])
        built = [e for e in events if "built and pushed" in e]
        assert len(built) == 1, events
        digest = re.search(DIGEST, built[0]).group(0)
        pulls = [e for e in events if "pulls image" in e]
        assert pulls and all(digest in e for e in pulls), events
        pullers = {e.split()[1] for e in pulls}
        builder = built[0].split()[1]
        assert machines <= pullers | {builder}, (machines, pullers, builder)
        lines = build_lines(api, job["id"])
        assert sum("building with buildah" in line for line in lines) == 1, lines
        assert any(f"pulled image {digest}" in line for line in lines), lines


def test_verified_reuse_builds_on_two_machines_then_pulls(three, tmp_path):
    with three.api() as api:
        ctx = context(tmp_path, "verified")
        spec = JobSpec.from_dict({"command": ["python3", "-c", SHARD], "image": {"reuse": "verified"},
                                  "shards": [{"payload": i} for i in range(24)]})
        first = api.wait(api.submit(ctx, spec)["id"], timeout_s=600, poll_s=0.2)
        assert first["state"] == "succeeded", first
        built = [e for e in image_events(api, first["id"]) if "built and pushed" in e]
        assert len({e.split()[1] for e in built}) >= 2, built  # independent machines
        digests = {re.search(DIGEST, e).group(0) for e in built}
        assert len(digests) == 1, built  # reproducible: the same digest on each
        assert sum("building with buildah" in line for line in build_lines(api, first["id"])) >= 2
        # Verified now: the next job of the same context builds nowhere.
        again = JobSpec.from_dict({"command": ["cat", "/built.txt"], "image": {"reuse": "verified"}})
        second = api.wait(api.submit(ctx, again)["id"], timeout_s=300, poll_s=0.2)
        assert second["state"] == "succeeded" and second["result"] == "verified", second
        assert not any("building with" in line for line in build_lines(api, second["id"]))
        [pulled] = [e for e in image_events(api, second["id"]) if "pulls image" in e]
        assert digests.pop() in pulled


def test_two_jobs_of_one_context_build_once_and_the_other_pulls(three, tmp_path):
    """Jobs, not shards: the first to ask builds, starts its job on the build and pushes
    beside it (its task reports only once the push is recorded); the other pulls."""
    with three.api() as api:
        ctx = context(tmp_path, "twice")
        spec = JobSpec.from_dict({"command": ["python3", "-c",
                                              "import time; time.sleep(2); "
                                              "print(open('/built.txt').read().strip())"]})
        jobs = [api.submit(ctx, spec)["id"] for _ in range(2)]
        finals = [api.wait(job, timeout_s=300, poll_s=0.2) for job in jobs]
        assert all(f["state"] == "succeeded" and f["result"] == "twice" for f in finals), finals
        events = [e for job in jobs for e in image_events(api, job)]
        built = [e for e in events if "built and pushed" in e]
        assert len(built) == 1, events
        digest = re.search(DIGEST, built[0]).group(0)
        builder = next(job for job in jobs if any("built and pushed" in e
                                                   for e in image_events(api, job)))
        puller = next(job for job in jobs if job != builder)
        lines = build_lines(api, builder)
        assert any(f"pushed image {digest} for the other machines in" in line
                   for line in lines), lines
        assert any(f"pulled image {digest}" in line or f"image {digest}" in line
                   for line in build_lines(api, puller)), build_lines(api, puller)


def test_an_image_kaniko_built_is_pushed_and_another_machine_pulls_it(tmp_path, monkeypatch):
    """A provider on the Kaniko builder (`agent run --builder kaniko`) builds a job's image
    through the agent's whole path (its copy of the Dockerfile, the build network: an ADD of
    a URL fetched by Kaniko itself over TLS, trusting the authorities its executor image
    holds, with no certificates of the operator's) and shares it; another Kaniko machine that
    takes the second job of the same context pulls that build by digest rather than building
    its own. (A Buildah machine builds its own: the builder is one of a build's inputs,
    coordinator/images.py.)"""
    monkeypatch.delenv("CAMPUGRID_BUILD_CA_FILE", raising=False)  # as on a provider's network
    root = Path(tempfile.mkdtemp(prefix="campugrid-kaniko-"))
    os.chmod(root, 0o711)
    p = Platform(root / "state", http_port=free_port(), lease_seconds=4.0,
                 admin_identity=root / "admin.json").start()
    try:
        kaniko = ("--metrics-port", "0", "--builder", "kaniko")
        first = p.start_agent("kaniko-1", args=kaniko)
        with p.api() as api:
            ctx = context(tmp_path, "by-kaniko", f"ADD {WHEEL} /added.whl\n"
                                                 "RUN echo \"$(cat /built.txt) $(sha256sum /added.whl)\" > /built.txt\n")
            spec = JobSpec.from_dict({"command": ["cat", "/built.txt"]})
            jobs = [api.submit(ctx, spec)["id"] for _ in range(2)]
            # The second job waits for the first one's build, on a machine that came later.
            deadline = time.monotonic() + 120
            while not any("building with kaniko" in line for line in build_lines(api, jobs[0])):
                assert time.monotonic() < deadline, api.job(jobs[0])
                time.sleep(0.3)
            second = p.start_agent("kaniko-2", args=kaniko)
            finals = [api.wait(job, timeout_s=300, poll_s=0.3) for job in jobs]
            assert [f["result"].split() for f in finals] == [
                ["by-kaniko", WHEEL_SHA256, "/added.whl"]] * 2, finals
            assert finals[0]["machine_id"] == first.machine_id(), finals[0]
            assert finals[1]["machine_id"] == second.machine_id(), finals[1]
            [built] = [e for e in image_events(api, jobs[0]) if "built and pushed" in e]
            digest = re.search(DIGEST, built).group(0)
            lines = build_lines(api, jobs[1])
            assert any(f"pulled image {digest}" in line for line in lines), lines
            assert not any("building with" in line for line in lines), lines
            # One agent stopped for good (as bench/builds.py hands over between runscs): it
            # exits, and the platform neither keeps nor restarts it.
            p.stop_agent(first)
            assert first.proc.poll() is not None and first not in p.agents
            assert second in p.agents and second.proc.poll() is None
    finally:
        p.stop()
        for name in ("kaniko-1", "kaniko-2"):
            log = root / "state" / "agents" / f"{name}.log"
            if log.exists():
                print(f"--- {name} (tail) ---\n" + "\n".join(log.read_text().splitlines()[-15:]))
        shutil.rmtree(root, ignore_errors=True)
