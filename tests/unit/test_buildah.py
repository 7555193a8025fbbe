"""The builder's store lookups: one listing per store answers every exact name; anything
else (a short name Buildah resolves) is asked of Buildah, as before."""

from __future__ import annotations

import json
import subprocess

from campugrid.builders.buildah import BuildahBuilder, _listing

IMAGE = {"id": "30b27312a878", "digest": "sha256:c3e1", "names": [
    "localhost/campugrid/python:bookworm", "localhost/campugrid-cache/a-1:7ba5"]}


def listed(images: object, returncode: int = 0) -> subprocess.CompletedProcess[str]:
    return subprocess.CompletedProcess([], returncode, json.dumps(images), "")


def test_a_listing_maps_every_name_of_every_image() -> None:
    got = _listing(listed([IMAGE, {"id": "b", "names": None}]))
    assert got == {"localhost/campugrid/python:bookworm": IMAGE,
                   "localhost/campugrid-cache/a-1:7ba5": IMAGE}


def test_a_failed_or_garbled_listing_is_no_listing() -> None:
    assert _listing(listed([], returncode=125)) is None
    assert _listing(subprocess.CompletedProcess([], 0, "not json", "")) is None
    assert _listing(listed(["not an image"])) is None


def test_an_exact_name_comes_from_the_listing_and_anything_else_from_buildah() -> None:
    asked: list[tuple[str, ...]] = []

    def call(*args: str) -> subprocess.CompletedProcess[str]:
        asked.append(args)
        return listed([IMAGE] if args[-1] == "campugrid/python:bookworm" else [])

    listing = _listing(listed([IMAGE]))
    assert BuildahBuilder._find(listing, "localhost/campugrid/python:bookworm", call) == IMAGE
    assert asked == []
    assert BuildahBuilder._find(listing, "campugrid/python:bookworm", call) == IMAGE
    assert BuildahBuilder._find(None, "localhost/other:1", call) is None
    assert asked == [("images", "--json", "campugrid/python:bookworm"),
                     ("images", "--json", "localhost/other:1")]
