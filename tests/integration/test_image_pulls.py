"""Shared images, a machine's side (agent/images.py): what it pulls by digest, held to what a
build here could make and to what its cache keeps, what it pushes beside the job, and the
layers it need not fetch, against the real docker-registry trusting the coordinator's tokens
(the `registry` fixture, tests/integration/conftest.py), driven by skopeo."""

from __future__ import annotations

import json
import os
import threading

import pytest

from campugrid.agent.images import ImageCache, ImageJob, obtain
from campugrid.agent.messages import Hold, ImageStep, Lease
from campugrid.builders.fake import FakeBuilder
from campugrid.coordinator.images import build_key, repository
from campugrid.protocol.errors import SandboxError
from campugrid.sandbox.podman_ops import CliOps
from tests.support.oci import oci_image, push, skopeo, skopeo_inspect

pytestmark = pytest.mark.integration


class PullOnly:
    """The coordinator's answers for a task told to pull `digest`."""

    machine_id = "machine-test"

    def __init__(self, step: ImageStep) -> None:
        self.step, self.asked, self.inputs = step, [], []

    def image(self, hold: Hold, step: str, inputs_json: str, digest: str = "") -> ImageStep:
        self.asked.append(step)
        self.inputs.append(inputs_json)
        return self.step


def test_the_build_options_a_spec_sets_are_part_of_the_build_key(tmp_path):
    """Two jobs of one context whose specs build differently (build.network: an offline build
    cannot fetch what an online one does) must not share an image; a spec that sets none
    keeps the key builds had before."""
    from campugrid.agent.images import declared
    from campugrid.protocol.spec import BuildOptions

    sent = []
    for build in (BuildOptions(), BuildOptions(network="none")):
        client = PullOnly(ImageStep(True, action="build"))
        lease = Lease(job_id="j", attempt=1, fencing_token=1, spec_json="{}", lease_seconds=10,
                      context_url="", output_url="")
        obtain(client, ImageCache(tmp_path, "test", CliOps()),  # type: ignore[arg-type]
               ImageJob(lease=lease, builder=FakeBuilder(), bases=(), tag="localhost/t:1",
                        work=tmp_path, log=lambda line: None, stop=threading.Event(),
                        build=lambda: None, disk_mb=1, declared=declared(build)))
        sent.append(client.inputs[0])
    assert len({build_key("c" * 64, inputs) for inputs in sent}) == 2
    assert sent[0] == json.dumps(FakeBuilder().inputs(()), sort_keys=True)


def test_an_image_larger_than_a_build_here_could_make_is_built_here_instead(registry, tmp_path):
    """A dishonest builder could push anything under a build key: what a machine pulls is
    held to the job's disk budget (plus its bases, which are here already)."""
    reg, tokens = registry
    repo = repository("f" * 64)
    token = tokens.mint("machine:m1", repo, ("push", "pull"))
    digest = push(reg, oci_image(tmp_path / "big", {"w": os.urandom(3 * 1024**2)}), repo, token,
                  tmp_path)
    cache = ImageCache(tmp_path, "test", CliOps())
    assert cache.download_bytes(reg.address, repo, digest, token) > 3 * 1024**2
    client = PullOnly(ImageStep(True, action="pull", registry=reg.address, repository=repo,
                                digest=digest, token=token, built_by="m1"))
    builds, lines = [], []
    lease = Lease(job_id="j", attempt=1, fencing_token=1, spec_json="{}", lease_seconds=10,
                  context_url="", output_url="")
    got = obtain(client, cache,  # type: ignore[arg-type]
                 ImageJob(lease=lease, builder=FakeBuilder(), bases=(), tag="localhost/t:1",
                          work=tmp_path, log=lines.append, stop=threading.Event(),
                          build=lambda: builds.append(1), disk_mb=1))
    assert got == "localhost/t:1" and builds == [1] and client.asked == ["resolve"]
    assert any("more than the bases and resources.build_mb (1 MB)" in line for line in lines), lines


def test_a_pulled_image_the_cache_cannot_keep_stays_only_while_its_task_runs(registry, tmp_path):
    """Another machine's build may be larger than this machine's image cache keeps (it is
    held to the job's disk, not to the cache): the task runs it, the build log says it goes
    when the task ends, and the task's end removes it; a cache that can keep it keeps it."""
    from campugrid.agent.images import task_user

    reg, tokens = registry
    repo = repository("d" * 64)
    token = tokens.mint("machine:m1", repo, ("push", "pull"))
    digest = push(reg, oci_image(tmp_path / "img", {"w": os.urandom(3 * 1024**2)}), repo, token,
                  tmp_path)
    lease = Lease(job_id="j", attempt=1, fencing_token=7, spec_json="{}", lease_seconds=10,
                  context_url="", output_url="")
    for max_mb, kept in ((2, False), (64, True)):
        cache = ImageCache(tmp_path, f"t-{os.urandom(3).hex()}", CliOps(), max_mb=max_mb)
        client = PullOnly(ImageStep(True, action="pull", registry=reg.address, repository=repo,
                                    digest=digest, token=token, built_by="m1"))
        lines: list[str] = []
        try:
            got = obtain(client, cache,  # type: ignore[arg-type]
                         ImageJob(lease=lease, builder=FakeBuilder(), bases=(),
                                  tag="localhost/t:1", work=tmp_path, log=lines.append,
                                  stop=threading.Event(),
                                  build=lambda: pytest.fail("pulled, not built"), disk_mb=16))
            assert got == cache.name(digest) and cache.ops.image_size(got) is not None
            said = [line for line in lines if "it is removed when this task ends" in line]
            assert said == ([] if kept else [
                f"[campugrid] the image's 3 MB are more than this machine's image cache "
                f"holds ({max_mb} MB, --image-cache-mb): it is removed when this task ends"]), lines
            assert cache.release(task_user(lease)) == ([] if kept else [digest])
            assert (cache.ops.image_size(got) is not None) is kept
        finally:
            cache.ops.remove_image(cache.name(digest))


def test_a_pull_is_held_to_its_size_unpacked_and_lands_only_within_it(registry, tmp_path):
    """A layer that is small to download can unpack to anything (64 MB of zeros gzip to
    64 KB): the pull counts every layer as it unpacks before the image enters the store."""
    reg, tokens = registry
    repo = repository("e" * 64)
    token = tokens.mint("machine:m1", repo, ("push", "pull"))
    bomb = push(reg, oci_image(tmp_path / "bomb", {"z": bytes(64 * 1024**2)}, gzipped=True),
                repo, token, tmp_path)
    cache = ImageCache(tmp_path, f"t-{os.urandom(3).hex()}", CliOps())
    assert cache.download_bytes(reg.address, repo, bomb, token) < 1024**2  # passes that check
    with pytest.raises(SandboxError, match="unpacks to more than 16 MB"):
        cache.pull(reg.address, repo, bomb, token, work=tmp_path, limit_bytes=16 * 1024**2,
                   cancel=None)
    assert cache.ops.image_size(cache.name(bomb)) is None and cache.lookup(bomb) is None
    assert not (tmp_path / "pulled").exists()  # nor left on disk
    fine = push(reg, oci_image(tmp_path / "fine", {"w": os.urandom(2 * 1024**2)}, gzipped=True),
                repo, token, tmp_path)
    try:
        got = cache.pull(reg.address, repo, fine, token, work=tmp_path,
                         limit_bytes=16 * 1024**2, cancel=None)
        assert got == cache.name(fine) and cache.lookup(fine) == got
        assert (cache.ops.image_size(got) or 0) >= 2 * 1024**2
    finally:
        cache.ops.remove_image(cache.name(fine))


def test_layers_the_store_holds_are_neither_fetched_nor_counted_and_a_wrong_guess_costs_a_retry(
        registry, tmp_path):
    """A machine that has an image's base pulls only the layers above it: the base's blob is
    not downloaded, nor counted against the limit (it takes no new space). Which blobs the
    store holds comes from the store's own records; where a guess is wrong (here a record of
    a push that never was), the store does not reuse, and the pull is made again in full."""
    reg, tokens = registry
    repo = repository("d" * 64)
    token = tokens.mint("machine:m1", repo, ("push", "pull"))
    base_files = {"base.bin": os.urandom(8 * 1024**2)}
    base = push(reg, oci_image(tmp_path / "base", [base_files], gzipped=True), repo, token,
                tmp_path)
    job = push(reg, oci_image(tmp_path / "job", [base_files, {"w": os.urandom(1024**2)}],
                              gzipped=True), repo, token, tmp_path)
    cache = ImageCache(tmp_path, f"t-{os.urandom(3).hex()}", CliOps())
    pulled = []
    try:
        with pytest.raises(SandboxError, match="unpacks to more than 4 MB"):  # 8 MB, none held
            cache.pull(reg.address, repo, job, token, work=tmp_path, limit_bytes=4 * 1024**2,
                       cancel=None)
        pulled.append(cache.pull(reg.address, repo, base, token, work=tmp_path,
                                 limit_bytes=16 * 1024**2, cancel=None))
        base_blob = json.loads(skopeo_inspect(reg, repo, base, token))["layers"][0]["digest"]
        assert base_blob in cache.held_layers()
        pulled.append(cache.pull(reg.address, repo, job, token, work=tmp_path,
                                 limit_bytes=4 * 1024**2, cancel=None))  # 1 MB new
        assert (cache.ops.image_size(pulled[-1]) or 0) > 9 * 1024**2
        # a wrong record: the store does not have this blob, though the record says so
        other = push(reg, oci_image(tmp_path / "other", [{"x": os.urandom(1024**2)}],
                                    gzipped=True), repo, token, tmp_path)
        other_blob = json.loads(skopeo_inspect(reg, repo, other, token))["layers"][0]["digest"]
        held_diff = next(d for d in cache.held_layers() if d != base_blob)
        cache.blobs_file.write_text(json.dumps({other_blob: held_diff}))
        assert other_blob in cache.held_layers()
        lines: list[str] = []
        pulled.append(cache.pull(reg.address, repo, other, token, work=tmp_path,
                                 limit_bytes=4 * 1024**2, cancel=None, log=lines.append))
        assert any("pulling them in full" in line for line in lines), lines
        assert (cache.ops.image_size(pulled[-1]) or 0) >= 1024**2
    finally:
        for image in pulled:
            cache.ops.remove_image(image)


def test_a_machine_knows_the_blobs_it_pushed_and_pulls_its_own_build_without_its_base(
        registry, tmp_path):
    """A push compresses this machine's layers into blobs its store has no record of: the
    cache notes which blob holds which of its layers, so that pulling its own build back
    (after the cache let it go) fetches only what the store no longer has."""
    reg, tokens = registry
    repo = repository("c" * 64)
    token = tokens.mint("machine:m1", repo, ("push", "pull"))
    base_files = {"base.bin": os.urandom(8 * 1024**2)}
    mark = os.urandom(3).hex()
    base, built = f"localhost/t-{mark}/base:1", f"localhost/t-{mark}/built:1"
    cache = ImageCache(tmp_path, f"t-{mark}", CliOps())
    names = [base, built]
    try:  # as a build here leaves them: uncompressed layers, the base under its own name
        assert skopeo(oci_image(tmp_path / "base", [base_files]), f"containers-storage:{base}"
                      ).returncode == 0
        assert skopeo(oci_image(tmp_path / "job", [base_files, {"w": os.urandom(1024**2)}]),
                      f"containers-storage:{built}").returncode == 0
        digest = cache.push(built, reg.address, repo, "m1", token, tmp_path, cancel=None)
        names.append(cache.name(digest))
        blobs = [layer["digest"] for layer in
                 json.loads(skopeo_inspect(reg, repo, digest, token))["layers"]]
        assert blobs[0] in cache.held_layers()  # a gzip blob the store never saw
        for name in names[1:]:
            cache.ops.remove_image(name)
        got = cache.pull(reg.address, repo, digest, token, work=tmp_path,
                         limit_bytes=4 * 1024**2, cancel=None)  # 1 MB new; the base is here
        assert got == cache.name(digest) and (cache.ops.image_size(got) or 0) > 9 * 1024**2
    finally:
        for name in names:
            cache.ops.remove_image(name)


class Scripted:
    """The coordinator's answers, one per step, for a task told to build and push."""

    machine_id = "machine-test"

    def __init__(self, steps: dict[str, ImageStep]) -> None:
        self.steps, self.asked, self.digests = steps, [], []

    def image(self, hold: Hold, step: str, inputs_json: str, digest: str = "") -> ImageStep:
        self.asked.append(step)
        self.digests.append(digest)
        return self.steps[step]


def test_the_job_starts_on_its_build_while_the_push_goes_on_beside_it(registry, tmp_path):
    """The machine that builds an image for the others hands the push to `later` (the task
    runs it in a thread and waits for it before it reports): obtain returns the build's own
    tag at once, and the push, when it runs, records the digest and keeps the image in the
    cache under it."""
    reg, tokens = registry
    repo = repository("d1" * 32)
    token = tokens.mint("machine:machine-test", repo, ("push", "pull"))
    mark = os.urandom(3).hex()
    tag = f"localhost/t-{mark}/built:1"
    cache = ImageCache(tmp_path, f"t-{mark}", CliOps())
    client = Scripted({"resolve": ImageStep(True, action="build", push=True),
                       "push": ImageStep(True, action="push", registry=reg.address,
                                         repository=repo, token=token),
                       "pushed": ImageStep(True, action="recorded")})
    lease = Lease(job_id="j", attempt=1, fencing_token=1, spec_json="{}", lease_seconds=10,
                  context_url="", output_url="")
    pending: list = []
    lines: list[str] = []

    def build() -> None:
        assert skopeo(oci_image(tmp_path / "job", {"w": os.urandom(1024**2)}),
                      f"containers-storage:{tag}").returncode == 0

    try:
        got = obtain(client, cache,  # type: ignore[arg-type]
                     ImageJob(lease=lease, builder=FakeBuilder(), bases=(), tag=tag,
                              work=tmp_path, log=lines.append, stop=threading.Event(),
                              build=build, disk_mb=8), later=pending.append)
        assert got == tag and client.asked == ["resolve"]  # the job may start: no push yet
        [share] = pending
        share()
        assert client.asked == ["resolve", "push", "pushed"]
        digest = client.digests[-1]
        assert digest.startswith("sha256:") and cache.lookup(digest) == cache.name(digest)
        assert any(f"pushed image {digest} for the other machines in" in line
                   for line in lines), lines
    finally:
        cache.ops.remove_image(tag)
        if client.digests[-1]:
            cache.ops.remove_image(cache.name(client.digests[-1]))
