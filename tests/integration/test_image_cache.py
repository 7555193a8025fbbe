"""The provider's image cache (agent/images.py) on a real Podman store: bounded by count and
size, least recently used out first, never an image a task is running."""

from __future__ import annotations

import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from campugrid.agent.images import ImageCache
from campugrid.sandbox.podman_ops import CliOps

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


def cached(cache: ImageCache, ops: CliOps, n: int, image: str) -> str:
    """What a pull or a push leaves: the image under the cache's name for digest n."""
    ops.tag(image, cache.name(digest(n)))
    cache.add(digest(n), cache.name(digest(n)))
    return cache.name(digest(n))


def test_least_recently_used_goes_first_but_never_one_in_use(tmp_path: Path, image: str):
    ops = CliOps()
    cache = ImageCache(tmp_path, f"t-{secrets.token_hex(3)}", max_images=2, ops=ops)
    try:
        one = cached(cache, ops, 1, image)
        two = cached(cache, ops, 2, image)
        cache.in_use.clear()  # both tasks ended
        assert cache.lookup(digest(1)) == one  # used again: now the most recent
        cache.in_use.clear()
        three = cached(cache, ops, 3, image)  # over the count: the least recent goes
        assert ops.image_size(two) is None and cache.lookup(digest(2)) is None
        assert ops.image_size(one) is not None and ops.image_size(three) is not None
        cache.in_use = {one, three}  # both running now
        four = cached(cache, ops, 4, image)
        assert all(ops.image_size(x) is not None for x in (one, three, four))  # none evicted
        cache.in_use = {four}
        assert cache.trim() == [digest(1)]  # back within the bound: the least recent went
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
        cache.in_use.clear()
        assert cache.trim() == [digest(1)]
        stray = cache.name(digest(9))  # pulled, then the agent died before recording it
        ops.tag(image, stray)
        assert cache.sweep_unknown() == [stray] and ops.image_size(stray) is None
    finally:
        for n in (1, 9):
            ops.remove_image(cache.name(digest(n)))
