"""What the agent keeps of a base image's files between builds (agent/debs.py): by the
image's ID, read again when a name moves to another image. The fake stands for PodmanOps,
whose image_id and image_file tests/integration/test_podman_ops.py holds both real
implementations to."""

from __future__ import annotations

import pytest

from campugrid.agent import debs


class Store:
    """Two images and a name that can be moved between them; counts the files read."""

    def __init__(self) -> None:
        self.names = {"base:1": "id-a"}
        self.files = {"id-a": b"ID=debian\n", "id-b": b"ID=ubuntu\n"}
        self.reads = 0

    def image_id(self, ref: str) -> str | None:
        return self.names.get(ref)

    def image_file(self, ref: str, path: str, max_bytes: int) -> bytes | None:
        self.reads += 1
        got = self.files[self.names.get(ref, ref)]  # a name, or an ID
        if len(got) > max_bytes:
            raise ValueError("too big")
        return got


@pytest.fixture(autouse=True)
def fresh() -> None:
    debs._read.clear()


def test_a_base_images_file_is_read_once_per_image_and_again_when_its_name_moves() -> None:
    store = Store()
    assert debs._image_file(store, "base:1", "/etc/os-release", 100) == b"ID=debian\n"  # type: ignore[arg-type]
    assert debs._image_file(store, "base:1", "/etc/os-release", 100) == b"ID=debian\n"  # type: ignore[arg-type]
    assert store.reads == 1
    store.names["base:1"] = "id-b"  # the tag now names another image
    assert debs._image_file(store, "base:1", "/etc/os-release", 100) == b"ID=ubuntu\n"  # type: ignore[arg-type]
    assert store.reads == 2
    assert debs._image_file(store, "gone:1", "/etc/os-release", 100) is None  # type: ignore[arg-type]
    with pytest.raises(ValueError):  # too big is not kept as an answer
        debs._image_file(store, "base:1", "/etc/os-release", 3)  # type: ignore[arg-type]


def test_what_is_kept_stays_under_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(debs, "READ_KEPT_BYTES", 25)
    store = Store()
    store.names.update({"other:1": "id-b"})
    debs._image_file(store, "base:1", "/etc/os-release", 100)  # type: ignore[arg-type]
    debs._image_file(store, "other:1", "/etc/os-release", 100)  # type: ignore[arg-type]
    debs._image_file(store, "base:1", "/etc/dpkg-like", 100)  # type: ignore[arg-type]
    assert sum(len(v or b"") for v in debs._read.values()) <= 25
    assert ("id-a", "/etc/dpkg-like", 100) in debs._read  # the newest stays
