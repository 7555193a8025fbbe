"""Shared images: who builds and who pulls (coordinator/images.py, on SQLite and a real
PostgreSQL), and the registry's token authentication for real: Debian's docker-registry
trusting the coordinator's tokens, driven by skopeo as agents drive it."""

from __future__ import annotations

import datetime as dt
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jwt
import pytest

from campugrid.coordinator.images import Images, build_key, repository
from campugrid.coordinator.machines import Status
from campugrid.coordinator.registry import ISSUER, SERVICE, RegistryTokens
from campugrid.coordinator.store import Store
from campugrid.coordinator.verified import quarantine
from campugrid.coordinator.views import utcnow
from campugrid.protocol.errors import InvalidInput, StaleAttempt
from campugrid.protocol.spec import JobSpec
from tests.support.holds import attempt, session
from tests.support.machines import add_machine
from tests.support.oci import oci_image, push, skopeo

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
    first = images.resolve(key=key, reuse="first", ref=attempt(ja, ta, a))
    assert (first.action, first.push) == ("build", True)
    assert images.resolve(key=key, reuse="first", ref=attempt(ja, ta, a)).action == "build"
    assert images.resolve(key=key, reuse="first", ref=attempt(jb, tb, b)).action == "wait"
    assert images.may_push(key=key, reuse="first", ref=attempt(ja, ta, a))
    assert not images.may_push(key=key, reuse="first", ref=attempt(jb, tb, b))
    images.record(key=key, context_sha256=CONTEXT, digest="sha256:" + "d" * 64, ref=attempt(ja, ta, a))
    pull = images.resolve(key=key, reuse="first", ref=attempt(jb, tb, b))
    assert (pull.action, pull.digest, pull.built_by) == ("pull", "sha256:" + "d" * 64, a)
    assert any(f"machine {a} built and pushed image sha256:{'d' * 64}" in e for e in events(store, ja))
    assert any(f"machine {b} pulls image sha256:{'d' * 64} built by machine {a}" in e for e in events(store, jb))
    assert images.builds(CONTEXT)[0]["machine_id"] == a


def test_builds_of_a_quarantined_or_revoked_machine_are_withdrawn(store: Store):
    images = Images(store.db)
    a, b, c, d = (add_machine(store, n) for n in "abcd")
    (ja, ta), (jb, tb), (jc, tc) = leased(store, a), leased(store, b), leased(store, c)
    key = build_key(CONTEXT, INPUTS)
    assert images.resolve(key=key, reuse="first", ref=attempt(ja, ta, a)).push
    images.record(key=key, context_sha256=CONTEXT, digest="sha256:" + "d" * 64, ref=attempt(ja, ta, a))
    assert images.resolve(key=key, reuse="first", ref=attempt(jb, tb, b)).action == "pull"
    with store.tx() as s:  # caught answering against a quorum
        quarantine(s, a, utcnow(), "it lied")
    again = images.resolve(key=key, reuse="first", ref=attempt(jc, tc, c))
    assert (again.action, again.push) == ("build", True)  # not a's: built anew, for the others
    images.record(key=key, context_sha256=CONTEXT, digest="sha256:" + "c" * 64, ref=attempt(jc, tc, c))
    # Reinstated, a is trusted with new work, not with what it pushed before.
    store.machines.set_status(a, Status.APPROVED)
    assert images.resolve(key=key, reuse="first", ref=attempt(jb, tb, b)).digest == "sha256:" + "c" * 64
    # The collector drops a's build at once, though jobs of its context are live; c's stays.
    assert images.unneeded(dt.timedelta(days=1)) == [(key, "sha256:" + "d" * 64)]
    store.machines.set_status(c, Status.REVOKED)
    jd, td = leased(store, d)
    assert images.resolve(key=key, reuse="first", ref=attempt(jd, td, d)).action == "build"
    assert len(images.builds(CONTEXT)) == 2  # kept for the garbage collector


def test_a_withdrawn_build_that_others_built_alike_stays_in_the_registry(store: Store):
    """Under "verified" reuse a quarantined machine's build may be the same digest as honest
    ones: that manifest is theirs too, and is not dropped from the registry."""
    images = Images(store.db)
    a, b, c = (add_machine(store, n) for n in "abc")
    key = build_key(CONTEXT, INPUTS)
    for m in (a, b):
        job, token = leased(store, m, "verified")
        images.record(key=key, context_sha256=CONTEXT, digest="sha256:" + "e" * 64,
                      ref=attempt(job, token, m))
    with store.tx() as s:
        quarantine(s, a, utcnow(), "it lied")
    assert images.unneeded(dt.timedelta(days=1)) == []
    jc, tc = leased(store, c, "verified")
    # One good vote is left: c builds (and pushes) rather than pull a's half of the quorum.
    again = images.resolve(key=key, reuse="verified", ref=attempt(jc, tc, c))
    assert (again.action, again.push) == ("build", True)


def test_jobs_that_ran_an_image_only_a_quarantined_machine_built_are_tainted(store: Store):
    images = Images(store.db)
    a, b, c, d = (add_machine(store, n) for n in "abcd")
    (ja, ta), (jb, tb) = leased(store, a), leased(store, b)
    key = build_key(CONTEXT, INPUTS)
    assert images.resolve(key=key, reuse="first", ref=attempt(ja, ta, a)).push
    images.record(key=key, context_sha256=CONTEXT, digest="sha256:" + "d" * 64,
                  ref=attempt(ja, ta, a))
    assert images.resolve(key=key, reuse="first", ref=attempt(jb, tb, b)).action == "pull"
    # A verified pull (two machines built the same digest) names no single maker.
    (jc, tc), (jd, td) = leased(store, c, "verified"), leased(store, d, "verified")
    for job, token, m in ((jc, tc, c), (jd, td, d)):
        assert images.resolve(key=key, reuse="verified", ref=attempt(job, token, m)).push
        images.record(key=key, context_sha256=CONTEXT, digest="sha256:" + "e" * 64,
                      ref=attempt(job, token, m))
    (je, te) = leased(store, b, "verified")
    assert images.resolve(key=key, reuse="verified", ref=attempt(je, te, b)).action == "pull"
    with store.tx() as s:
        quarantine(s, c, utcnow(), "it lied")  # one of two agreeing builders: nothing tainted
        quarantine(s, a, utcnow(), "it lied")
    assert "image built by machine" in (store.get(jb).tainted or "")
    assert store.get(je).tainted is None and store.get(jd).tainted is None


def test_a_lone_job_builds_without_pushing_and_keeps_no_one_waiting(store: Store):
    """Pushing costs the builder seconds (every layer, compressed): only when another task
    could use the image now, i.e. another live job of the same context or more shards."""
    images = Images(store.db)
    a, b = add_machine(store, "a"), add_machine(store, "b")
    key = build_key(CONTEXT, INPUTS)
    ja, ta = leased(store, a)
    alone = images.resolve(key=key, reuse="first", ref=attempt(ja, ta, a))
    assert (alone.action, alone.push) == ("build", False)
    assert not images.may_push(key=key, reuse="first", ref=attempt(ja, ta, a))
    jb, tb = leased(store, b)  # the same context again, while the first still runs
    later = images.resolve(key=key, reuse="first", ref=attempt(jb, tb, b))
    assert (later.action, later.push) == ("build", True)  # not made to wait for a
    sharded, _ = store.submit(JobSpec.from_dict({"command": ["x"], "shards": [
        {"payload": i} for i in range(3)]}), "contexts/x.tar", "ef" * 32)
    c = add_machine(store, "c")
    claim = store.claim(c, 30)
    assert claim is not None and claim.job.id == sharded.id
    more = images.resolve(key=build_key("ef" * 32, INPUTS), reuse="first", ref=session(sharded.id, claim.token, c))
    assert more.push  # two shards are still queued


def test_a_claim_passes_on_when_its_task_is_gone_or_its_push_failed(store: Store):
    images = Images(store.db)
    a, b, c = add_machine(store, "a"), add_machine(store, "b"), add_machine(store, "c")
    (ja, ta), (jb, tb), (jc, tc) = leased(store, a), leased(store, b), leased(store, c)
    key = build_key(CONTEXT, INPUTS)
    assert images.resolve(key=key, reuse="first", ref=attempt(ja, ta, a)).action == "build"
    store.release(attempt(ja, ta, a), "drained", failed=False)  # a's task ends without pushing
    took = images.resolve(key=key, reuse="first", ref=attempt(jb, tb, b))
    assert (took.action, took.push) == ("build", True)
    images.record(key=key, context_sha256=CONTEXT, digest="", ref=attempt(jb, tb, b))
    assert images.resolve(key=key, reuse="first", ref=attempt(jc, tc, c)).action == "build"
    assert any("could not push" in e for e in events(store, jb))


def test_machines_asking_at_once_get_one_builder(store: Store):
    images = Images(store.db)
    tasks = [(m, *leased(store, m)) for m in (add_machine(store, f"m{i}") for i in range(6))]
    key = build_key(CONTEXT, INPUTS)
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda t: images.resolve(key=key, reuse="first", ref=attempt(t[1], t[2], t[0])).action, tasks))
    assert sorted(got) == ["build"] + ["wait"] * 5


def test_verified_reuse_needs_two_machines_with_the_same_digest(store: Store):
    images = Images(store.db)
    ms = [add_machine(store, n) for n in "abcd"]
    tasks = [leased(store, m, "verified") for m in ms]
    key = build_key(CONTEXT, INPUTS)

    def ask(i: int) -> tuple[str, bool, str]:
        d = images.resolve(key=key, reuse="verified", ref=attempt(tasks[i][0], tasks[i][1], ms[i]))
        return d.action, d.push, d.digest

    def pushed(i: int, digest: str) -> None:
        images.record(key=key, context_sha256=CONTEXT, digest=digest, ref=attempt(tasks[i][0], tasks[i][1], ms[i]))

    good, bad = "sha256:" + "e" * 64, "sha256:" + "f" * 64
    assert ask(0) == ("build", True, "") and ask(1) == ("build", True, "")  # nobody waits
    pushed(0, good)
    assert ask(0) == ("build", False, "")  # its own vote is in: it builds, pushes nothing
    assert ask(2) == ("build", True, "")  # one build is not verified
    pushed(1, bad)  # a second machine disagrees: still not verified
    assert ask(2) == ("build", True, "")
    assert not images.may_push(key=key, reuse="verified", ref=attempt(tasks[0][0], tasks[0][1], ms[0]))
    pushed(2, good)
    assert ask(3) == ("pull", False, good)


def test_verified_reuse_counts_one_owners_machines_as_one_vote(store: Store):
    images = Images(store.db)
    ms = [add_machine(store, n, approve=False) for n in ("desk", "laptop", "other")]
    for m, owner in zip(ms, ("alice", "alice", "bob"), strict=True):
        store.machines.set_status(m, Status.APPROVED, owner=owner)
    tasks = [leased(store, m, "verified") for m in ms]
    key, digest = build_key(CONTEXT, INPUTS), "sha256:" + "e" * 64
    for i in (0, 1):  # alice's two machines build the same digest
        assert images.resolve(key=key, reuse="verified",
                              ref=attempt(tasks[i][0], tasks[i][1], ms[i])).push
        images.record(key=key, context_sha256=CONTEXT, digest=digest,
                      ref=attempt(tasks[i][0], tasks[i][1], ms[i]))
    third = images.resolve(key=key, reuse="verified", ref=attempt(tasks[2][0], tasks[2][1], ms[2]))
    assert third.action == "build"  # one owner's word, not two parties'


def test_never_reuse_builds_everywhere_and_records_nothing(store: Store):
    images = Images(store.db)
    a = add_machine(store, "a")
    ja, ta = leased(store, a, "never")
    d = images.resolve(key=build_key(CONTEXT, INPUTS), reuse="never", ref=attempt(ja, ta, a))
    assert (d.action, d.push) == ("build", False)
    assert not images.may_push(key=build_key(CONTEXT, INPUTS), reuse="never", ref=attempt(ja, ta, a))
    assert events(store, ja) == []


def test_only_the_machine_holding_the_task_takes_a_step(store: Store):
    images = Images(store.db)
    a, b = add_machine(store, "a"), add_machine(store, "b")
    ja, ta = leased(store, a)
    for job, token, machine in ((ja, ta, b), (ja, ta + 1, a), ("no-such-job", 1, a)):
        with pytest.raises(StaleAttempt):
            images.step(attempt(job, token, machine), "resolve", INPUTS)
    assert images.step(attempt(ja, ta, a), "resolve", INPUTS).action == "build"  # no registry: build
    with pytest.raises(InvalidInput, match="no image registry"):
        images.step(attempt(ja, ta, a), "push", INPUTS)


def test_builds_no_live_job_can_use_are_garbage_once_idle(store: Store):
    images = Images(store.db)
    a = add_machine(store, "a")
    ja, ta = leased(store, a)
    key = build_key(CONTEXT, INPUTS)
    images.resolve(key=key, reuse="first", ref=attempt(ja, ta, a))
    images.record(key=key, context_sha256=CONTEXT, digest="sha256:" + "d" * 64, ref=attempt(ja, ta, a))
    assert images.unneeded(dt.timedelta(0)) == []  # its job still runs
    store.finish(attempt(ja, ta, a), succeeded=True, exit_code=0, reason=None, result=None,
                 output_key=None, limits={})
    assert images.unneeded(dt.timedelta(hours=1)) == []  # pulled (recorded) just now
    assert images.unneeded(dt.timedelta(0)) == [(key, "sha256:" + "d" * 64)]
    store.submit(JobSpec(), f"contexts/{CONTEXT}.tar", CONTEXT)  # queued again: needed
    assert images.unneeded(dt.timedelta(0)) == []


# --- the registry, for real ----------------------------------------------------------------


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
    first = images.step(attempt(ja, ta, a), "resolve", INPUTS)
    assert (first.action, first.push, first.registry) == ("build", True, reg.address)
    assert first.token == ""  # no token before the build is done
    with pytest.raises(InvalidInput, match="does not build it"):
        images.step(attempt(jb, tb, b), "push", INPUTS)
    grant = images.step(attempt(ja, ta, a), "push", INPUTS)
    assert grant.repository == repository(build_key(context, INPUTS))
    with pytest.raises(InvalidInput, match="not in the registry"):
        images.step(attempt(ja, ta, a), "pushed", INPUTS, "sha256:" + "0" * 64)
    with pytest.raises(InvalidInput, match="digest"):
        images.step(attempt(ja, ta, a), "pushed", INPUTS, "latest")
    digest = push(reg, oci_image(tmp_path / "img", {"a": b"a"}), grant.repository, grant.token,
                  tmp_path)
    assert images.step(attempt(ja, ta, a), "pushed", INPUTS, digest).action == "recorded"
    pull = images.step(attempt(jb, tb, b), "resolve", INPUTS)
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
    assert images.step(attempt(ja, ta, a), "resolve", INPUTS).push
    grant = images.step(attempt(ja, ta, a), "push", INPUTS)
    digest = push(reg, oci_image(tmp_path / "img", {"big": os.urandom(300_000)}), grant.repository,
                  grant.token, tmp_path)
    images.step(attempt(ja, ta, a), "pushed", INPUTS, digest)
    blobs = reg.data_dir / "data" / "docker" / "registry" / "v2" / "blobs"

    def stored() -> int:
        return sum(p.stat().st_size for p in blobs.rglob("data"))

    before, address = stored(), reg.address
    assert images.collect(dt.timedelta(0)) == 0  # its job still runs
    store.finish(attempt(ja, ta, a), succeeded=True, exit_code=0, reason=None, result=None,
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


def test_shard_sessions_build_and_pull_under_their_own_tokens(store: Store):
    """A sharded job's machines ask with their sessions' holds: the history records each
    under its session, as the sessions' own events are."""
    images = Images(store.db)
    job, _ = store.submit(JobSpec.from_dict({"command": ["x"], "shards": [{"payload": i}
                                                                         for i in range(4)]}),
                          f"contexts/{CONTEXT}.tar", CONTEXT)
    a, b = add_machine(store, "a"), add_machine(store, "b")
    ca, cb = store.claim(a, 30), store.claim(b, 30)
    assert ca is not None and cb is not None and ca.session is not None
    assert images.step(session(job.id, ca.token, a), "resolve", INPUTS).action == "build"
    assert images.step(session(job.id, cb.token, b), "resolve", INPUTS).action == "build"  # no registry
    key = build_key(CONTEXT, INPUTS)
    assert images.resolve(key=key, reuse="first", ref=session(job.id, ca.token, a)).action == "build"
    assert images.resolve(key=key, reuse="first", ref=session(job.id, cb.token, b)).action == "wait"
    images.record(key=key, context_sha256=CONTEXT, digest="sha256:" + "d" * 64, ref=session(job.id, ca.token, a))
    assert images.resolve(key=key, reuse="first", ref=session(job.id, cb.token, b)).action == "pull"
    sessions = {e.attempt for e in store.events(job.id) if e.kind == "image"}
    assert sessions == {ca.session, cb.session}


def test_only_a_task_that_may_push_can_record_a_push(registry, store: Store, tmp_path: Path):
    """A machine that was not given the build cannot vote for a digest someone else pushed."""
    reg, tokens = registry
    images = Images(store.db, tokens)
    a, b = add_machine(store, "a"), add_machine(store, "b")
    context = "c3" * 32
    (ja, ta), (jb, tb) = leased(store, a, context=context), leased(store, b, context=context)
    assert images.step(attempt(ja, ta, a), "resolve", INPUTS).action == "build"
    grant = images.step(attempt(ja, ta, a), "push", INPUTS)
    digest = push(reg, oci_image(tmp_path / "img", {"a": b"b"}), grant.repository, grant.token,
                  tmp_path)
    with pytest.raises(InvalidInput, match="does not build it"):
        images.step(attempt(jb, tb, b), "pushed", INPUTS, digest)  # b waits; it built nothing
    images.step(attempt(ja, ta, a), "pushed", INPUTS, digest)
    with pytest.raises(InvalidInput, match="does not build it"):
        images.step(attempt(ja, ta, a), "pushed", INPUTS, digest)  # once: the claim is spent
    assert [b_["machine_id"] for b_ in images.builds(context)] == [a]
    with pytest.raises(InvalidInput, match="step: resolve, push or pushed"):
        images.step(attempt(ja, ta, a), "bogus", INPUTS)
