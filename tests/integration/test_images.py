"""Shared images: who builds and who pulls (coordinator/images.py, on SQLite and a real
PostgreSQL), and the registry's token authentication for real: Debian's docker-registry
trusting the coordinator's tokens, driven by skopeo as agents drive it."""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jwt
import pytest

from campugrid.agent.images import ImageCache, obtain
from campugrid.agent.messages import ImageStep, Lease
from campugrid.builders.fake import FakeBuilder
from campugrid.cli.registry import EmbeddedRegistry
from campugrid.coordinator.images import Images, build_key, repository
from campugrid.coordinator.registry import ISSUER, SERVICE, RegistryTokens, ensure_signing_key
from campugrid.coordinator.store import Store
from campugrid.protocol.errors import InvalidInput, SandboxError, StaleAttempt
from campugrid.protocol.spec import JobSpec
from tests.support.machines import add_machine
from tests.support.oci import oci_image

pytestmark = pytest.mark.integration
CONTEXT = "ab" * 32
INPUTS = json.dumps({"builder": "buildah 1.28.2", "base localhost/x": "sha256:" + "1" * 64})


def leased(store: Store, machine: str, reuse: str = "first", context: str = CONTEXT) -> tuple[str, int]:
    """A job of `context` leased by `machine`: (job id, fencing token)."""
    job, _ = store.submit(JobSpec.from_dict({"image": {"reuse": reuse}}), f"contexts/{context}.tar",
                          context)
    while (got := store.claim_next(machine, lease_s=60)) is not None and got.id != job.id:
        pass
    assert got is not None
    return job.id, got.attempt


def events(store: Store, job_id: str) -> list[str]:
    return [e.detail or "" for e in store.events(job_id) if e.kind == "image"]


# --- who builds, who pulls ----------------------------------------------------------------


def test_the_key_is_the_coordinators_context_and_the_machines_inputs():
    assert build_key(CONTEXT, INPUTS) == build_key(CONTEXT, json.dumps(json.loads(INPUTS)))
    assert build_key(CONTEXT, INPUTS) != build_key("cd" * 32, INPUTS)
    other_base = json.dumps({**json.loads(INPUTS), "base localhost/x": "sha256:" + "2" * 64})
    assert build_key(CONTEXT, INPUTS) != build_key(CONTEXT, other_base)
    for bad in ("", "[]", "{}", "not json", json.dumps({"x": "y" * 5000})):
        with pytest.raises(InvalidInput, match="inputs_json"):
            build_key(CONTEXT, bad)


def test_first_reuse_one_machine_builds_the_others_wait_then_pull(store: Store):
    images = Images(store.db)
    a, b = add_machine(store, "a"), add_machine(store, "b")
    (ja, ta), (jb, tb) = leased(store, a), leased(store, b)
    key = build_key(CONTEXT, INPUTS)
    first = images.resolve(key=key, reuse="first", job_id=ja, token=ta, machine_id=a)
    assert (first.action, first.push) == ("build", True)
    assert images.resolve(key=key, reuse="first", job_id=ja, token=ta, machine_id=a).action == "build"
    assert images.resolve(key=key, reuse="first", job_id=jb, token=tb, machine_id=b).action == "wait"
    assert images.may_push(key=key, reuse="first", job_id=ja, token=ta, machine_id=a)
    assert not images.may_push(key=key, reuse="first", job_id=jb, token=tb, machine_id=b)
    images.record(key=key, context_sha256=CONTEXT, digest="sha256:" + "d" * 64, job_id=ja,
                  token=ta, machine_id=a)
    pull = images.resolve(key=key, reuse="first", job_id=jb, token=tb, machine_id=b)
    assert (pull.action, pull.digest, pull.built_by) == ("pull", "sha256:" + "d" * 64, a)
    assert any(f"machine {a} built and pushed image sha256:{'d' * 64}" in e for e in events(store, ja))
    assert any(f"machine {b} pulls image sha256:{'d' * 64} built by machine {a}" in e for e in events(store, jb))
    assert images.builds(CONTEXT)[0]["machine_id"] == a


def test_a_lone_job_builds_without_pushing_and_keeps_no_one_waiting(store: Store):
    """Pushing costs the builder seconds (every layer, compressed): only when another task
    could use the image now, i.e. another live job of the same context or more shards."""
    images = Images(store.db)
    a, b = add_machine(store, "a"), add_machine(store, "b")
    key = build_key(CONTEXT, INPUTS)
    ja, ta = leased(store, a)
    alone = images.resolve(key=key, reuse="first", job_id=ja, token=ta, machine_id=a)
    assert (alone.action, alone.push) == ("build", False)
    assert not images.may_push(key=key, reuse="first", job_id=ja, token=ta, machine_id=a)
    jb, tb = leased(store, b)  # the same context again, while the first still runs
    later = images.resolve(key=key, reuse="first", job_id=jb, token=tb, machine_id=b)
    assert (later.action, later.push) == ("build", True)  # not made to wait for a
    sharded, _ = store.submit(JobSpec.from_dict({"command": ["x"], "shards": [
        {"payload": i} for i in range(3)]}), "contexts/x.tar", "ef" * 32)
    c = add_machine(store, "c")
    claim = store.claim(c, 30)
    assert claim is not None and claim.job.id == sharded.id
    more = images.resolve(key=build_key("ef" * 32, INPUTS), reuse="first", job_id=sharded.id,
                          token=claim.token, machine_id=c)
    assert more.push  # two shards are still queued


def test_a_claim_passes_on_when_its_task_is_gone_or_its_push_failed(store: Store):
    images = Images(store.db)
    a, b, c = add_machine(store, "a"), add_machine(store, "b"), add_machine(store, "c")
    (ja, ta), (jb, tb), (jc, tc) = leased(store, a), leased(store, b), leased(store, c)
    key = build_key(CONTEXT, INPUTS)
    assert images.resolve(key=key, reuse="first", job_id=ja, token=ta, machine_id=a).action == "build"
    store.release(ja, ta, a, "drained", failed=False)  # a's task ends without pushing
    took = images.resolve(key=key, reuse="first", job_id=jb, token=tb, machine_id=b)
    assert (took.action, took.push) == ("build", True)
    images.record(key=key, context_sha256=CONTEXT, digest="", job_id=jb, token=tb, machine_id=b)
    assert images.resolve(key=key, reuse="first", job_id=jc, token=tc, machine_id=c).action == "build"
    assert any("could not push" in e for e in events(store, jb))


def test_machines_asking_at_once_get_one_builder(store: Store):
    images = Images(store.db)
    tasks = [(m, *leased(store, m)) for m in (add_machine(store, f"m{i}") for i in range(6))]
    key = build_key(CONTEXT, INPUTS)
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda t: images.resolve(key=key, reuse="first", job_id=t[1],
                                                     token=t[2], machine_id=t[0]).action, tasks))
    assert sorted(got) == ["build"] + ["wait"] * 5


def test_verified_reuse_needs_two_machines_with_the_same_digest(store: Store):
    images = Images(store.db)
    ms = [add_machine(store, n) for n in "abcd"]
    tasks = [leased(store, m, "verified") for m in ms]
    key = build_key(CONTEXT, INPUTS)

    def ask(i: int) -> tuple[str, bool, str]:
        d = images.resolve(key=key, reuse="verified", job_id=tasks[i][0], token=tasks[i][1],
                           machine_id=ms[i])
        return d.action, d.push, d.digest

    def pushed(i: int, digest: str) -> None:
        images.record(key=key, context_sha256=CONTEXT, digest=digest, job_id=tasks[i][0],
                      token=tasks[i][1], machine_id=ms[i])

    good, bad = "sha256:" + "e" * 64, "sha256:" + "f" * 64
    assert ask(0) == ("build", True, "") and ask(1) == ("build", True, "")  # nobody waits
    pushed(0, good)
    assert ask(0) == ("build", False, "")  # its own vote is in: it builds, pushes nothing
    assert ask(2) == ("build", True, "")  # one build is not verified
    pushed(1, bad)  # a second machine disagrees: still not verified
    assert ask(2) == ("build", True, "")
    assert not images.may_push(key=key, reuse="verified", job_id=tasks[0][0], token=tasks[0][1],
                               machine_id=ms[0])
    pushed(2, good)
    assert ask(3) == ("pull", False, good)


def test_never_reuse_builds_everywhere_and_records_nothing(store: Store):
    images = Images(store.db)
    a = add_machine(store, "a")
    ja, ta = leased(store, a, "never")
    d = images.resolve(key=build_key(CONTEXT, INPUTS), reuse="never", job_id=ja, token=ta,
                       machine_id=a)
    assert (d.action, d.push) == ("build", False)
    assert not images.may_push(key=build_key(CONTEXT, INPUTS), reuse="never", job_id=ja,
                               token=ta, machine_id=a)
    assert events(store, ja) == []


def test_only_the_machine_holding_the_task_takes_a_step(store: Store):
    images = Images(store.db)
    a, b = add_machine(store, "a"), add_machine(store, "b")
    ja, ta = leased(store, a)
    for job, token, machine in ((ja, ta, b), (ja, ta + 1, a), ("no-such-job", 1, a)):
        with pytest.raises(StaleAttempt):
            images.step(job, token, machine, "resolve", INPUTS)
    assert images.step(ja, ta, a, "resolve", INPUTS).action == "build"  # no registry: build
    with pytest.raises(InvalidInput, match="no image registry"):
        images.step(ja, ta, a, "push", INPUTS)


def test_builds_no_live_job_can_use_are_garbage_once_idle(store: Store):
    images = Images(store.db)
    a = add_machine(store, "a")
    ja, ta = leased(store, a)
    key = build_key(CONTEXT, INPUTS)
    images.resolve(key=key, reuse="first", job_id=ja, token=ta, machine_id=a)
    images.record(key=key, context_sha256=CONTEXT, digest="sha256:" + "d" * 64, job_id=ja,
                  token=ta, machine_id=a)
    assert images.unneeded(dt.timedelta(0)) == []  # its job still runs
    store.finish(ja, ta, a, succeeded=True, exit_code=0, reason=None, result=None,
                 output_key=None, limits={})
    assert images.unneeded(dt.timedelta(hours=1)) == []  # pulled (recorded) just now
    assert images.unneeded(dt.timedelta(0)) == [(key, "sha256:" + "d" * 64)]
    store.submit(JobSpec(), f"contexts/{CONTEXT}.tar", CONTEXT)  # queued again: needed
    assert images.unneeded(dt.timedelta(0)) == []


# --- the registry, for real ----------------------------------------------------------------


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmbeddedRegistry, RegistryTokens]]:
    if shutil.which("docker-registry") is None or shutil.which("skopeo") is None:
        pytest.fail("docker-registry and skopeo are missing: run infra/setup.sh")
    root = tmp_path_factory.mktemp("registry")
    _, cert = ensure_signing_key(root / "keys")
    running = EmbeddedRegistry(root / "reg", cert).start()
    try:
        yield running, RegistryTokens(root / "keys", running.address)
    finally:
        running.stop()


def skopeo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["skopeo", "copy", "--quiet", *args], capture_output=True, text=True,
                          timeout=120, check=False)


def push(registry: EmbeddedRegistry, image: str, repo: str, token: str, tmp: Path) -> str:
    out = skopeo("--dest-registry-token", token, "--dest-tls-verify=false", "--digestfile",
                 str(tmp / "digest"), image, f"docker://{registry.address}/{repo}:t")
    assert out.returncode == 0, out.stderr
    return (tmp / "digest").read_text().strip()


def test_a_token_opens_its_one_repository_for_its_actions_only(registry, tmp_path: Path):
    reg, tokens = registry
    image = oci_image(tmp_path / "img", {"hello.txt": b"hello"})
    mine, other = repository("a" * 64), repository("b" * 64)
    digest = push(reg, image, mine, tokens.mint("machine:m1", mine, ("push", "pull")), tmp_path)
    assert digest.startswith("sha256:") and tokens.has_manifest(mine, digest)
    # another repository with the same token: refused
    out = skopeo("--dest-registry-token", tokens.mint("machine:m1", mine, ("push", "pull")),
                 "--dest-tls-verify=false", image, f"docker://{reg.address}/{other}:t")
    assert out.returncode != 0 and "denied" in out.stderr
    # a pull token cannot push, even where the blobs are there already
    out = skopeo("--dest-registry-token", tokens.mint("machine:m1", mine, ("pull",)),
                 "--dest-tls-verify=false", image, f"docker://{reg.address}/{mine}:u")
    assert out.returncode != 0
    # pulls by digest with a pull token
    out = skopeo("--src-registry-token", tokens.mint("machine:m2", mine, ("pull",)),
                 "--src-tls-verify=false", "--dest-decompress",
                 f"docker://{reg.address}/{mine}@{digest}", f"dir:{tmp_path / 'pulled'}")
    assert out.returncode == 0, out.stderr
    assert b"hello" in b"".join(p.read_bytes() for p in (tmp_path / "pulled").iterdir())
    # no token, an expired one (past the registry's 60 s of leeway), one signed by another key
    url = f"http://{reg.address}/v2/{mine}/manifests/{digest}"
    assert httpx.head(url).status_code == 401
    now = int(time.time())
    expired = tokens.mint("machine:m2", mine, ("pull",), ttl_s=1)
    claims = jwt.decode(expired, options={"verify_signature": False})
    stale = jwt.encode({**claims, "iat": now - 400, "nbf": now - 400, "exp": now - 120},
                       tokens._key, algorithm="ES256", headers={"x5c": tokens._x5c})  # type: ignore[arg-type]
    assert httpx.head(url, headers={"Authorization": f"Bearer {stale}"}).status_code == 401
    forger = RegistryTokens(tmp_path / "forger", reg.address)
    forged = forger.mint("machine:m2", mine, ("pull",))
    assert httpx.head(url, headers={"Authorization": f"Bearer {forged}"}).status_code == 401
    assert jwt.get_unverified_header(forged)["alg"] == "ES256"
    assert claims["iss"] == ISSUER and claims["aud"] == SERVICE


def test_the_coordinator_records_only_what_the_registry_holds(registry, store: Store,
                                                              tmp_path: Path):
    reg, tokens = registry
    images = Images(store.db, tokens)
    a, b = add_machine(store, "a"), add_machine(store, "b")
    context = "c1" * 32
    (ja, ta), (jb, tb) = leased(store, a, context=context), leased(store, b, context=context)
    first = images.step(ja, ta, a, "resolve", INPUTS)
    assert (first.action, first.push, first.registry) == ("build", True, reg.address)
    assert first.token == ""  # no token before the build is done
    with pytest.raises(InvalidInput, match="does not build it"):
        images.step(jb, tb, b, "push", INPUTS)
    grant = images.step(ja, ta, a, "push", INPUTS)
    assert grant.repository == repository(build_key(context, INPUTS))
    with pytest.raises(InvalidInput, match="not in the registry"):
        images.step(ja, ta, a, "pushed", INPUTS, "sha256:" + "0" * 64)
    with pytest.raises(InvalidInput, match="digest"):
        images.step(ja, ta, a, "pushed", INPUTS, "latest")
    digest = push(reg, oci_image(tmp_path / "img", {"a": b"a"}), grant.repository, grant.token,
                  tmp_path)
    assert images.step(ja, ta, a, "pushed", INPUTS, digest).action == "recorded"
    pull = images.step(jb, tb, b, "resolve", INPUTS)
    assert (pull.action, pull.digest, pull.repository) == ("pull", digest, grant.repository)
    out = skopeo("--src-registry-token", pull.token, "--src-tls-verify=false",
                 f"docker://{reg.address}/{pull.repository}@{digest}", f"dir:{tmp_path / 'p'}")
    assert out.returncode == 0, out.stderr
    # the pull token does not push
    out = skopeo("--dest-registry-token", pull.token, "--dest-tls-verify=false",
                 oci_image(tmp_path / "evil", {"a": b"evil"}),
                 f"docker://{reg.address}/{pull.repository}:evil")
    assert out.returncode != 0


def test_garbage_collection_drops_unneeded_images_and_their_blobs(registry, store: Store,
                                                                  tmp_path: Path):
    reg, tokens = registry
    images = Images(store.db, tokens)
    a = add_machine(store, "a")
    context = "c2" * 32
    ja, ta = leased(store, a, context=context)
    waiting, _ = store.submit(JobSpec(), f"contexts/{context}.tar", context)  # will want it
    assert images.step(ja, ta, a, "resolve", INPUTS).push
    grant = images.step(ja, ta, a, "push", INPUTS)
    digest = push(reg, oci_image(tmp_path / "img", {"big": os.urandom(300_000)}), grant.repository,
                  grant.token, tmp_path)
    images.step(ja, ta, a, "pushed", INPUTS, digest)
    blobs = reg.data_dir / "data" / "docker" / "registry" / "v2" / "blobs"

    def stored() -> int:
        return sum(p.stat().st_size for p in blobs.rglob("data"))

    before, address = stored(), reg.address
    assert images.collect(dt.timedelta(0)) == 0  # its job still runs
    store.finish(ja, ta, a, succeeded=True, exit_code=0, reason=None, result=None,
                 output_key=None, limits={})
    assert images.collect(dt.timedelta(0)) == 0  # the other one still waits
    store.cancel(waiting.id)
    assert images.collect(dt.timedelta(0)) == 1
    assert not tokens.has_manifest(grant.repository, digest)
    assert images.builds(context) == []
    reg.garbage_collect()
    assert stored() < before - 300_000
    assert reg.address == address  # serving again, on the same port
    assert httpx.get(f"http://{reg.address}/v2/").status_code == 401


class PullOnly:
    """The coordinator's answers for a task told to pull `digest`."""

    machine_id = "machine-test"

    def __init__(self, step: ImageStep) -> None:
        self.step, self.asked, self.inputs = step, [], []

    def image(self, job_id: str, token: int, step: str, inputs_json: str,
              digest: str = "") -> ImageStep:
        self.asked.append(step)
        self.inputs.append(inputs_json)
        return self.step


def test_the_packages_a_spec_declares_for_its_build_are_part_of_the_build_key(tmp_path):
    """Two jobs of one context whose specs fetch other packages for the build (build.pip,
    build.apt, build.python) must not share an image; a spec that declares none keeps the
    key builds had before."""
    from campugrid.agent.images import declared
    from campugrid.protocol.spec import BuildOptions

    sent = []
    for build in (BuildOptions(), BuildOptions(pip=("six==1.17.0",)),
                  BuildOptions(pip=("six==1.16.0",)), BuildOptions(apt=("jq",)),
                  BuildOptions(pip=("six==1.17.0",), python="3.12")):
        client = PullOnly(ImageStep(True, action="build"))
        lease = Lease(job_id="j", attempt=1, fencing_token=1, spec_json="{}", lease_seconds=10,
                      context_url="", output_url="")
        obtain(client, lease, FakeBuilder(), ImageCache(tmp_path, "test"), bases=(),  # type: ignore[arg-type]
               tag="localhost/t:1", work=tmp_path, log=lambda line: None,
               stop=threading.Event(), build=lambda: None, disk_mb=1, declared=declared(build))
        sent.append(client.inputs[0])
    assert len({build_key("c" * 64, inputs) for inputs in sent}) == 5
    assert sent[0] == json.dumps(FakeBuilder().inputs(()), sort_keys=True)


def test_an_image_larger_than_a_build_here_could_make_is_built_here_instead(registry, tmp_path):
    """A dishonest builder could push anything under a build key: what a machine pulls is
    held to the job's disk budget (plus its bases, which are here already)."""
    reg, tokens = registry
    repo = repository("f" * 64)
    token = tokens.mint("machine:m1", repo, ("push", "pull"))
    digest = push(reg, oci_image(tmp_path / "big", {"w": os.urandom(3 * 1024**2)}), repo, token,
                  tmp_path)
    cache = ImageCache(tmp_path, "test")
    assert cache.download_bytes(reg.address, repo, digest, token) > 3 * 1024**2
    client = PullOnly(ImageStep(True, action="pull", registry=reg.address, repository=repo,
                                digest=digest, token=token, built_by="m1"))
    builds, lines = [], []
    lease = Lease(job_id="j", attempt=1, fencing_token=1, spec_json="{}", lease_seconds=10,
                  context_url="", output_url="")
    got = obtain(client, lease, FakeBuilder(), cache, bases=(), tag="localhost/t:1",  # type: ignore[arg-type]
                 work=tmp_path, log=lines.append, stop=threading.Event(),
                 build=lambda: builds.append(1), disk_mb=1)
    assert got == "localhost/t:1" and builds == [1] and client.asked == ["resolve"]
    assert any("more than the bases and resources.disk_mb (1 MB)" in line for line in lines), lines


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
    for max_mb, kept in ((5, False), (64, True)):
        cache = ImageCache(tmp_path, f"t-{os.urandom(3).hex()}", max_mb=max_mb)
        client = PullOnly(ImageStep(True, action="pull", registry=reg.address, repository=repo,
                                    digest=digest, token=token, built_by="m1"))
        lines: list[str] = []
        try:
            got = obtain(client, lease, FakeBuilder(), cache, bases=(), tag="localhost/t:1",  # type: ignore[arg-type]
                         work=tmp_path, log=lines.append, stop=threading.Event(),
                         build=lambda: pytest.fail("pulled, not built"), disk_mb=16)
            assert got == cache.name(digest) and cache.ops.image_size(got) is not None
            said = [line for line in lines if "it is removed when this task ends" in line]
            assert said == ([] if kept else [
                f"[campugrid] the image takes 2 x 3 MB on disk once run, more than this "
                f"machine's image cache holds ({max_mb} MB, --image-cache-mb): it is removed "
                "when this task ends"]), lines
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
    cache = ImageCache(tmp_path, f"t-{os.urandom(3).hex()}")
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
    cache = ImageCache(tmp_path, f"t-{os.urandom(3).hex()}")
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
    cache = ImageCache(tmp_path, f"t-{mark}")
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


def skopeo_inspect(registry: EmbeddedRegistry, repo: str, digest: str, token: str) -> str:
    return subprocess.run(["skopeo", "inspect", "--raw", "--tls-verify=false", "--registry-token",
                           token, f"docker://{registry.address}/{repo}@{digest}"],
                          capture_output=True, text=True, timeout=60, check=True).stdout


def test_shard_sessions_build_and_pull_under_their_own_tokens(store: Store):
    """A sharded job's machines ask with their sessions' tokens (far past 32 bits): the
    history records each under its session, as the sessions' own events are."""
    images = Images(store.db)
    job, _ = store.submit(JobSpec.from_dict({"command": ["x"], "shards": [{"payload": i}
                                                                         for i in range(4)]}),
                          f"contexts/{CONTEXT}.tar", CONTEXT)
    a, b = add_machine(store, "a"), add_machine(store, "b")
    ca, cb = store.claim(a, 30), store.claim(b, 30)
    assert ca is not None and cb is not None and ca.session is not None
    assert images.step(job.id, ca.token, a, "resolve", INPUTS).action == "build"
    assert images.step(job.id, cb.token, b, "resolve", INPUTS).action == "build"  # no registry
    key = build_key(CONTEXT, INPUTS)
    assert images.resolve(key=key, reuse="first", job_id=job.id, token=ca.token,
                          machine_id=a).action == "build"
    assert images.resolve(key=key, reuse="first", job_id=job.id, token=cb.token,
                          machine_id=b).action == "wait"
    images.record(key=key, context_sha256=CONTEXT, digest="sha256:" + "d" * 64, job_id=job.id,
                  token=ca.token, machine_id=a)
    assert images.resolve(key=key, reuse="first", job_id=job.id, token=cb.token,
                          machine_id=b).action == "pull"
    sessions = {e.attempt for e in store.events(job.id) if e.kind == "image"}
    assert sessions == {ca.session, cb.session}


def test_only_a_task_that_may_push_can_record_a_push(registry, store: Store, tmp_path: Path):
    """A machine that was not given the build cannot vote for a digest someone else pushed."""
    reg, tokens = registry
    images = Images(store.db, tokens)
    a, b = add_machine(store, "a"), add_machine(store, "b")
    context = "c3" * 32
    (ja, ta), (jb, tb) = leased(store, a, context=context), leased(store, b, context=context)
    assert images.step(ja, ta, a, "resolve", INPUTS).action == "build"
    grant = images.step(ja, ta, a, "push", INPUTS)
    digest = push(reg, oci_image(tmp_path / "img", {"a": b"b"}), grant.repository, grant.token,
                  tmp_path)
    with pytest.raises(InvalidInput, match="does not build it"):
        images.step(jb, tb, b, "pushed", INPUTS, digest)  # b waits; it built nothing
    images.step(ja, ta, a, "pushed", INPUTS, digest)
    with pytest.raises(InvalidInput, match="does not build it"):
        images.step(ja, ta, a, "pushed", INPUTS, digest)  # once: the claim is spent
    assert [b_["machine_id"] for b_ in images.builds(context)] == [a]
    with pytest.raises(InvalidInput, match="step: resolve, push or pushed"):
        images.step(ja, ta, a, "bogus", INPUTS)


class Scripted:
    """The coordinator's answers, one per step, for a task told to build and push."""

    machine_id = "machine-test"

    def __init__(self, steps: dict[str, ImageStep]) -> None:
        self.steps, self.asked, self.digests = steps, [], []

    def image(self, job_id: str, token: int, step: str, inputs_json: str,
              digest: str = "") -> ImageStep:
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
    cache = ImageCache(tmp_path, f"t-{mark}")
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
        got = obtain(client, lease, FakeBuilder(), cache, bases=(), tag=tag, work=tmp_path,  # type: ignore[arg-type]
                     log=lines.append, stop=threading.Event(), build=build, disk_mb=8,
                     later=pending.append)
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
