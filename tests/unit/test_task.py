"""Every way a task ends (agent/task.py), fast: the fake runtime and builder take the job's
faults from data (env, Dockerfile comments), a recording fake stands in for the coordinator,
and presigned URLs are answered in memory. tests/integration/test_runtime_contract.py and
test_builder_contract.py hold the fakes to the real podman+runsc and Buildah on these cases."""

from __future__ import annotations

import io
import json
import os
import tarfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from campugrid.agent.fake import FakeCoordinator
from campugrid.agent.messages import Lease, Outcome
from campugrid.agent.task import Task
from campugrid.builders.fake import FakeBuilder
from campugrid.sandbox import fake
from campugrid.sandbox.fake import FakeRuntime
from campugrid.sandbox.podman_ops import CliOps

BASE = "FROM localhost/campugrid/python:bookworm\n"
CONTEXT_URL = "http://objects.test/contexts/job-1.tar?X-Amz-Signature=s"
OUTPUT_URL = "http://objects.test/outputs/job-1.tar.gz?X-Amz-Signature=s"


def outcome(client: FakeCoordinator) -> Outcome:
    """The one completion the task sent (and no hand-back), for the test's hold."""
    assert client.released == [], client.released
    [(job_id, token, done)] = client.completed
    assert (job_id, token) == ("job-1", 7)
    return done


class ObjectStub:
    """Presigned URLs, answered in memory: GET of the context, PUT of the output."""

    def __init__(self) -> None:
        self.context = b""
        self.puts: dict[str, bytes] = {}

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET" and str(request.url) == CONTEXT_URL:
            return httpx.Response(200, content=self.context)
        if request.method == "PUT" and str(request.url) == OUTPUT_URL:
            self.puts[str(request.url)] = request.read()
            return httpx.Response(200)
        return httpx.Response(404)

    def output_files(self) -> dict[str, int]:
        with tarfile.open(fileobj=io.BytesIO(self.puts[OUTPUT_URL]), mode="r:gz") as tar:
            return {m.name: m.size for m in tar.getmembers()}


@pytest.fixture
def objects(monkeypatch: pytest.MonkeyPatch) -> ObjectStub:
    stub = ObjectStub()
    real = httpx.Client

    def client(*args: object, **kwargs: object) -> httpx.Client:
        return real(*args, transport=httpx.MockTransport(stub.handle), **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(httpx, "Client", client)
    return stub


def tar_of(dockerfile: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        data = dockerfile.encode()
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class Setup:
    def __init__(self, tmp_path: Path, objects: ObjectStub, client: FakeCoordinator) -> None:
        self.tmp_path, self.objects, self.client = tmp_path, objects, client
        self.images: set[str] = set()
        self.runtime = FakeRuntime(images=self.images, scope="a-test")
        self.builder = FakeBuilder(images=self.images, scope="a-test")

    def task(self, *, env: dict[str, str] | None = None, dockerfile: str = "",
             **resources: int) -> Task:
        self.objects.context = tar_of(BASE + dockerfile + 'CMD ["python3", "job.py"]\n')
        spec = {"env": env or {}, "resources": {"wall_time_s": 30, "output_mb": 16, **resources}}
        lease = Lease(job_id="job-1", attempt=1, fencing_token=7, spec_json=json.dumps(spec),
                      lease_seconds=12.0, context_url=CONTEXT_URL, output_url=OUTPUT_URL)
        work = self.tmp_path / "work"
        work.mkdir()
        self.client.grant(lease)
        return Task(self.client, lease, work, self.builder, self.runtime)  # type: ignore[arg-type]

    def run(self, **kwargs: object) -> Task:
        task = self.task(**kwargs)  # type: ignore[arg-type]
        task.run()
        return task

    def after(self, task: Task) -> None:
        """Nothing of the task is left, whatever the ending, but its image: the agent's
        (worker.JobImages)."""
        assert not task.work.exists()
        assert self.runtime.removed_images == []
        assert not self.runtime.exists(task.name)
        wait_for("the checkpoint poller to end", lambda: not task.uploader._thread.is_alive(), 5)


@pytest.fixture
def setup(tmp_path: Path, objects: ObjectStub) -> Setup:
    return Setup(tmp_path, objects, FakeCoordinator())


def test_success_reports_the_last_line_and_uploads_the_output(setup: Setup) -> None:
    task = setup.run(env=fake.env(stdout="warming up\nthe answer is 42", write_mb=1))
    done = outcome(setup.client)
    assert done.succeeded and done.exit_code == 0 and done.reason == ""
    assert done.result == "the answer is 42" and done.output_uploaded
    assert setup.objects.output_files() == {fake.OUTPUT_FILE: 1024 * 1024}
    assert done.limits["memory"] == "enforced" and done.limits["output"].startswith("not enforced")
    assert ("run", "the answer is 42") in setup.client.lines
    assert any(s == "build" and "building with fake" in t for s, t in setup.client.lines)
    assert setup.client.renewals[:1] == ["running"]
    [req] = setup.runtime.runs
    assert req.name == task.name and req.image == task.image and req.file_mb == 17
    assert dict(req.env)["CAMPUGRID_JOB_ID"] == "job-1" and req.agent == "machine-test"
    setup.after(task)


def test_the_build_may_use_every_cpu_the_machine_offers_and_the_run_what_the_job_asked(
        setup: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    task = setup.run(env=fake.env(stdout="done"), cpus=0.5, memory_mb=300, disk_mb=200)
    assert outcome(setup.client).succeeded
    assert setup.builder.limits == [{"memory_mb": 300, "cpus": 6.0, "disk_mb": 200}]
    [req] = setup.runtime.runs
    assert (req.cpus, req.memory_mb) == (0.5, 300)
    assert any(s == "build" and "building with fake on 6 CPUs" in t for s, t in setup.client.lines)
    setup.after(task)


def test_a_non_zero_exit_fails_the_job_with_its_status(setup: Setup) -> None:
    task = setup.run(env=fake.env(stdout="about to fail", exit_code=3))
    done = outcome(setup.client)
    assert not done.succeeded and done.exit_code == 3
    assert done.reason == "the job's command exited with status 3"
    assert done.result == "about to fail" and not done.output_uploaded
    setup.after(task)


def test_out_of_memory_names_the_limit(setup: Setup) -> None:
    task = setup.run(env=fake.env(oom=1, run_for=0.1), memory_mb=256)
    done = outcome(setup.client)
    assert not done.succeeded
    assert done.reason == "out of memory: the job used more than 256 MB"
    setup.after(task)


def test_the_wall_time_stops_the_job(setup: Setup) -> None:
    t0 = time.monotonic()
    task = setup.run(env=fake.env(run_for=60), wall_time_s=1)
    done = outcome(setup.client)
    assert not done.succeeded and time.monotonic() - t0 < 20
    assert done.reason == "wall time of 1 s exceeded; the job was stopped"
    setup.after(task)


def test_a_sandbox_that_vanishes_mid_run_fails_the_attempt(setup: Setup) -> None:
    task = setup.run(env=fake.env(run_for=60, vanish_after=0.2))
    done = outcome(setup.client)
    assert not done.succeeded and done.exit_code == fake.KILLED
    assert done.reason == f"the job's command exited with status {fake.KILLED}"
    setup.after(task)


def test_a_failed_build_is_final_with_the_log_tail(setup: Setup) -> None:
    task = setup.run(dockerfile="# fake: log=about-to-fail-7f3a\n"
                                "# fake: fail=build failed (RUN step exit 3)\n"
                                "RUN echo about-to-fail-7f3a && exit 3\n")
    done = outcome(setup.client)
    assert not done.succeeded and done.exit_code == -1
    assert done.reason.startswith("build failed (RUN step exit 3); last lines of the build log:\n")
    assert "about-to-fail-7f3a" in done.reason
    assert setup.runtime.runs == []
    setup.after(task)


class ReleaseRecorder:
    """An image cache that cannot move images (so the task builds), recording releases: the
    real ImageCache.release is tests/integration/test_image_cache.py's."""

    available = False

    def __init__(self) -> None:
        self.ops = CliOps()  # what the task reads images with, as without a cache
        self.released: list[str] = []

    def release(self, user: str) -> list[str]:
        self.released.append(user)
        return []


@pytest.mark.parametrize("dockerfile", ["", "# fake: fail=build failed (RUN step exit 3)\n"])
def test_a_task_lets_go_of_the_cached_images_it_used_as_it_ends(setup: Setup,
                                                                 dockerfile: str) -> None:
    """Whatever the ending: else an image it used would stay held, never evicted."""
    task = setup.task(dockerfile=dockerfile)
    cache = ReleaseRecorder()
    task.cache = cache  # type: ignore[assignment]
    task.run()
    assert cache.released == ["job-1:7"]
    assert outcome(setup.client).succeeded is (dockerfile == "")
    setup.after(task)


def test_a_sandbox_that_cannot_start_is_handed_back_as_the_providers_failure(setup: Setup) -> None:
    setup.runtime.images = set()  # the built image is not in the runtime's store
    task = setup.run()
    [(job_id, token, reason, failed)] = setup.client.released
    assert (job_id, token, failed) == ("job-1", 7, True)
    assert reason.startswith("SandboxError: the sandbox could not start (exit 125)")
    assert "image not known" in reason
    assert setup.client.completed == []
    setup.after(task)


def run_in_thread(task: Task) -> threading.Thread:
    thread = threading.Thread(target=task.run, daemon=True)
    thread.start()
    return thread


def wait_for(what: str, condition: object, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_drain_asks_the_job_to_stop_and_hands_the_task_back(setup: Setup) -> None:
    task = setup.task(env=fake.env(run_for=60, on_term=0))
    thread = run_in_thread(task)
    wait_for("the sandbox", lambda: setup.runtime.exists(task.name))
    task.drain(grace_s=10)
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert setup.runtime.signals == [(task.name, "TERM")]
    assert setup.client.released == [("job-1", 7, "the provider is shutting down", False)]
    assert setup.client.completed == []
    setup.after(task)


def test_a_drain_during_the_build_hands_the_task_back_unrun(setup: Setup) -> None:
    task = setup.task(dockerfile="# fake: run_for=60\n")
    thread = run_in_thread(task)
    wait_for("the build", lambda: setup.builder.builds)
    task.drain(grace_s=10)
    thread.join(timeout=30)
    assert setup.client.released == [("job-1", 7, "the provider is shutting down", False)]
    assert setup.runtime.runs == [] and setup.client.completed == []
    setup.after(task)


def test_a_lost_lease_stops_the_job_and_reports_nothing(tmp_path: Path, objects: ObjectStub) -> None:
    setup = Setup(tmp_path, objects, FakeCoordinator())
    task = setup.task(env=fake.env(run_for=60))
    setup.client.cancel("job-1")  # before its first renewal: the lease is gone
    t0 = time.monotonic()
    task.run()
    assert time.monotonic() - t0 < 20
    assert task.lost.is_set() and "job job-1 was cancelled" in task.renewer.reason
    assert setup.client.completed == [] and setup.client.released == []
    assert OUTPUT_URL not in objects.puts
    setup.after(task)


def test_output_past_output_mb_stops_the_job_at_once(setup: Setup) -> None:
    # 2 MB in one file passes RLIMIT_FSIZE (output_mb + 1) but not output_mb: the watchdog.
    task = setup.run(env=fake.env(write_mb=2, run_for=60), output_mb=1)
    done = outcome(setup.client)
    assert not done.succeeded and not done.output_uploaded
    assert done.reason == ("the job wrote more than 1 MB to /output and /checkpoints "
                           "(resources.output_mb); it was stopped")
    assert setup.runtime.killed == [task.name]
    setup.after(task)


def test_one_file_past_output_mb_is_stopped_by_the_file_size_limit(setup: Setup) -> None:
    task = setup.run(env=fake.env(write_mb=5), output_mb=1)
    done = outcome(setup.client)
    assert not done.succeeded and done.exit_code == 153
    assert done.reason.startswith("a file the job wrote reached 1 MB (resources.output_mb")
    setup.after(task)


def test_the_builders_names_for_bases_replace_the_checked_lines_pulled_bases_included():
    """A pulled base (a multi-line FROM) is named by its local image, unless the builder names
    it by digest (Kaniko); the key stays the checked use, whose lines pin_bases replaces."""
    from campugrid.agent.task import base_pins
    from campugrid.buildpolicy.dockerfiles import AllowedBase, BaseUse, check_dockerfile, pin_bases

    text = ("FROM localhost/campugrid/python:bookworm AS a\nRUN true\n"
            "FROM \\\n  docker.io/library/python:3.11-slim\nCOPY --from=a /x /x\n")
    checked = check_dockerfile(text, registries=("docker.io",)).bases
    own, remote = checked
    assert remote.remote and remote.end_line == 4
    pulled = {remote: "localhost/campugrid-cache/s:abc"}
    given = [own, BaseUse(remote.line, AllowedBase(pulled[remote]), None)]  # as the builder gets them
    assert base_pins(pulled, {}) == pulled  # Buildah: the pulled base by its local name
    named = {given[0]: "localhost/campugrid/python@sha256:1", given[1]: "localhost/campugrid-cache/s@sha256:2"}
    pins = base_pins(pulled, named)
    assert pins == {own: "localhost/campugrid/python@sha256:1", remote: "localhost/campugrid-cache/s@sha256:2"}
    assert pin_bases(text, pins).split("\n")[:4] == [
        "FROM localhost/campugrid/python@sha256:1 AS a", "RUN true",
        "FROM localhost/campugrid-cache/s@sha256:2", "COPY --from=a /x /x"]
