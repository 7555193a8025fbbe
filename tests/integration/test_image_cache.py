"""The provider's image cache (agent/images.py) on a real Podman store: bounded by count and
size, least recently used out first, never an image a task is running; each image counted
at what it takes on disk once used, which the provider's rootless Podman is held to here."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from campugrid.agent.images import COPIES, ImageCache
from campugrid.sandbox import store_lock
from campugrid.sandbox.podman_ops import CliOps
from tests.support.provider import DEFAULT_IMAGE, sandbox_run

pytestmark = pytest.mark.integration


@pytest.fixture
def image() -> Iterator[str]:
    """A tiny image in this user's store, to give cache names to."""
    name = f"localhost/cache-test/{secrets.token_hex(4)}:base"
    empty = subprocess.run(["tar", "-c", "--files-from", "/dev/null"], capture_output=True,
                           check=True).stdout
    subprocess.run(["podman", "import", "-", name], input=empty, capture_output=True, check=True)
    yield name
    subprocess.run(["podman", "rmi", "--force", name], capture_output=True, check=False)


def digest(n: int) -> str:
    return f"sha256:{n:064x}"


def cached(cache: ImageCache, ops: CliOps, n: int, image: str, user: str | None = "task",
           copies: int = 1) -> str:
    """What a pull leaves: the image under the cache's name for digest n, in use by `user`."""
    ops.tag(image, cache.name(digest(n)))
    cache.add(digest(n), cache.name(digest(n)), user, copies)
    return cache.name(digest(n))


def test_least_recently_used_goes_first_but_never_one_in_use(tmp_path: Path, image: str):
    ops = CliOps()
    cache = ImageCache(tmp_path, f"t-{secrets.token_hex(3)}", max_images=2, ops=ops)
    try:
        one = cached(cache, ops, 1, image, "a")
        two = cached(cache, ops, 2, image, "b")
        assert cache.release("a") == [] and cache.release("b") == []  # within the bounds
        assert cache.lookup(digest(1)) == one  # used again: now the most recent
        three = cached(cache, ops, 3, image, None)  # over the count: the least recent goes
        assert ops.image_size(two) is None and cache.lookup(digest(2)) is None
        assert ops.image_size(one) is not None and ops.image_size(three) is not None
        assert cache.lookup(digest(1), "c") == one and cache.lookup(digest(3), "d") == three
        four = cached(cache, ops, 4, image, "e")  # all three running now
        assert all(ops.image_size(x) is not None for x in (one, three, four))  # none evicted
        assert cache.in_use() == {one, three, four}
        assert cache.release("c") == [digest(1)]  # its task ended: back within the bound
        assert cache.lookup(digest(3)) == three and cache.lookup(digest(4)) == four
    finally:
        for n in range(1, 5):
            ops.remove_image(cache.name(digest(n)))


def test_the_size_bound_and_what_the_index_lost(tmp_path: Path, image: str):
    ops = CliOps()
    cache = ImageCache(tmp_path, f"t-{secrets.token_hex(3)}", max_images=10, max_mb=0, ops=ops)
    try:
        one = cached(cache, ops, 1, image)  # in use: kept although over the size bound
        assert ops.image_size(one) is not None
        with store_lock.writing():  # another agent of this user is building: left for now
            assert cache.release("task") == []
        assert ops.image_size(one) is not None and cache.lookup(digest(1)) == one
        assert cache.trim() == [digest(1)]  # a later trim, the store quiet: it goes
        assert ops.image_size(one) is None and cache.lookup(digest(1)) is None
        one = cached(cache, ops, 1, image)
        assert cache.release("task") == [digest(1)]  # its task ended: it goes at once
        assert ops.image_size(one) is None
        stray = cache.name(digest(9))  # pulled, then the agent died before recording it
        ops.tag(image, stray)
        assert cache.sweep_unknown() == [stray] and ops.image_size(stray) is None
    finally:
        for n in (1, 9):
            ops.remove_image(cache.name(digest(n)))


def test_an_image_two_tasks_use_stays_until_the_last_of_them_ends(tmp_path: Path, image: str):
    """Two tasks of one sweep run the same cached image: the first one's end must not let the
    cache remove it (`podman rmi --force` would take the other's running container with it);
    a task that used one image twice (two FROM lines) lets it go at its one end."""
    ops = CliOps()
    cache = ImageCache(tmp_path, f"t-{secrets.token_hex(3)}", max_mb=0, ops=ops)
    try:
        one = cached(cache, ops, 1, image, "first")
        assert cache.lookup(digest(1), "second") == one
        assert cache.lookup(digest(1), "second") == one  # its second FROM line
        assert cache.release("first") == [] and ops.image_size(one) is not None
        assert cache.release("second") == [digest(1)] and ops.image_size(one) is None
    finally:
        ops.remove_image(cache.name(digest(1)))


def test_an_image_counts_at_what_it_takes_on_disk_once_used(tmp_path: Path):
    """A base counts COPIES times Podman's size for it (it is copied into the builder's
    store), a job image once: a cache whose bound holds the image once, but not twice, keeps
    it as a job image but as a base only while a task uses it; a job image used as a base
    from then on counts as one."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "blob").write_bytes(os.urandom(3 * 1024**2))
    image = f"localhost/cache-test/{secrets.token_hex(4)}:data"
    subprocess.run(["tar", "-C", str(data), "-cf", str(tmp_path / "layer.tar"), "blob"], check=True)
    subprocess.run(["podman", "import", str(tmp_path / "layer.tar"), image], capture_output=True,
                   check=True)
    ops = CliOps()
    mb = (ops.image_size(image) or 0) / 1024**2
    assert mb > 2.5
    for state in ("roomy", "tight", "job"):
        (tmp_path / state).mkdir()
    roomy = ImageCache(tmp_path / "roomy", f"t-{secrets.token_hex(3)}", max_mb=int(COPIES * mb) + 1,
                       ops=ops)
    tight = ImageCache(tmp_path / "tight", f"t-{secrets.token_hex(3)}", max_mb=int(mb) + 1, ops=ops)
    job = ImageCache(tmp_path / "job", f"t-{secrets.token_hex(3)}", max_mb=int(mb) + 1, ops=ops)
    try:
        for cache in (roomy, tight):
            cached(cache, ops, 1, image, copies=COPIES)
        assert roomy.release("task") == [] and roomy.lookup(digest(1)) is not None
        assert tight.release("task") == [digest(1)]  # once would fit its bound; twice does not
        cached(job, ops, 1, image)
        assert job.release("task") == [] and job.lookup(digest(1)) is not None
        assert job.lookup(digest(1), "build", COPIES) is not None  # now a base: twice
        assert job.release("build") == [digest(1)]
    finally:
        for cache in (roomy, tight, job):
            ops.remove_image(cache.name(digest(1)))
        ops.remove_image(image)


def test_a_first_run_starts_from_the_image_as_stored_without_a_copy(provider, shared_tmp):
    """Held against the provider's own rootless Podman: a sandbox (as the agent runs it, in
    Podman's own user namespace) of an image never run before starts from its layers as
    stored, and its size stays what the cache read. Under `--userns keep-id` (until
    2026-12-07) Podman wrote an ID-mapped copy of all the image's layers at that first start,
    as large as the image and left out of its size."""
    as_provider = provider.command
    image = f"localhost/cache-test/{secrets.token_hex(4)}:ran"
    blob = shared_tmp / "blob"
    blob.write_bytes(os.urandom(8 * 1024**2))
    os.chown(blob, provider.uid, provider.gid)
    made = subprocess.run(as_provider(["buildah", "from", "--pull-never", DEFAULT_IMAGE]),
                          capture_output=True, text=True, check=True).stdout.strip()
    try:
        subprocess.run(as_provider(["buildah", "copy", made, str(blob), "/blob"]),
                       capture_output=True, check=True)
        subprocess.run(as_provider(["buildah", "commit", "-q", made, image]), capture_output=True,
                       check=True)
    finally:
        subprocess.run(as_provider(["buildah", "rm", made]), capture_output=True)

    def inspected(what: str) -> str:
        return subprocess.run(as_provider(["podman", "image", "inspect", "--format", what, image]),
                              capture_output=True, text=True, check=True).stdout.strip()

    graph = Path(subprocess.run(as_provider(["podman", "info", "--format", "{{.Store.GraphRoot}}"]),
                                capture_output=True, text=True, check=True).stdout.strip())
    out = shared_tmp / "out"
    out.mkdir()
    os.chown(out, provider.uid, provider.gid)
    try:
        size, ident = int(inspected("{{.Size}}")), inspected("{{.Id}}")
        res = sandbox_run(provider, name=f"t-copy-{secrets.token_hex(3)}", command=["true"],
                          output_dir=str(out), image=image)
        assert res["exit_code"] == 0, res["tail"]
        record = next(i for i in json.loads((graph / "overlay-images" / "images.json").read_text())
                      if i["id"] == ident)
        assert not record.get("mapped-layers"), record  # no ID-mapped copy of it
        assert int(inspected("{{.Size}}")) == size
    finally:
        subprocess.run(as_provider(["podman", "rmi", "-f", image]), capture_output=True)
