"""A provider's shared folder, as a hostile job spec would aim at it: the agent opens files
only inside the listed folder, by real path, and only the very file the job named by sha256.
Real files, real links, the agent's own code."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from campugrid.agent.shares import Shares, parse
from campugrid.protocol.errors import CampugridError, InvalidInput


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def share(tmp_path: Path) -> tuple[Shares, Path]:
    folder = tmp_path / "shared"
    (folder / "train").mkdir(parents=True)
    (folder / "train" / "a.csv").write_bytes(b"1,2\n")
    (tmp_path / "secret.txt").write_bytes(b"host secret")
    (folder / "out-link").symlink_to(tmp_path / "secret.txt")  # a link out of the folder
    (folder / "in-link").symlink_to(folder / "train" / "a.csv")  # a link that stays inside
    (folder / "dir-link").symlink_to(tmp_path)  # a folder link out
    return Shares(parse([f"data={folder}"])), tmp_path


def listed(shares: Shares, timeout: float = 10) -> dict:
    deadline = time.monotonic() + timeout
    while "data" not in shares.listing():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return shares.listing()


def test_the_listing_names_paths_inside_the_folder_and_no_links(share):
    shares, root = share
    files = listed(shares)["data"]
    assert [(f.path, f.size, f.sha256) for f in files] == [("train/a.csv", 4, sha(b"1,2\n"))]
    assert all(str(root) not in f.path for f in files)


def test_the_named_file_is_placed_read_for_the_job(share, tmp_path):
    shares, _ = share
    target = tmp_path / "job" / "data" / "d" / "train" / "a.csv"
    how = shares.place("data", "train/a.csv", sha(b"1,2\n"), target)
    assert how in ("in place", "copied") and target.read_bytes() == b"1,2\n"


@pytest.mark.parametrize(("path", "says"), [
    ("../secret.txt", "is not a path inside a share"),
    ("/etc/passwd", "is not a path inside a share"),
    ("train/../../secret.txt", "is not a path inside a share"),
    ("out-link", "goes through a symlink"),
    ("in-link", "goes through a symlink"),  # even a link that stays inside: real paths only
    ("dir-link/secret.txt", "goes through a symlink"),
    ("train", "not a regular file"),
    ("nope.csv", "is not in the share"),
])
def test_paths_that_leave_the_folder_or_go_through_links_are_refused(share, tmp_path, path, says):
    shares, _ = share
    target = tmp_path / "job" / "x"
    with pytest.raises(InvalidInput, match=says):
        shares.place("data", path, sha(b"host secret"), target)
    assert not target.exists()


def test_a_file_changed_after_submit_is_refused(share, tmp_path):
    shares, root = share
    wanted = sha(b"1,2\n")
    (root / "shared" / "train" / "a.csv").write_bytes(b"9,9\n")  # after the job named it
    target = tmp_path / "job" / "a.csv"
    with pytest.raises(InvalidInput, match="is not the file the job names"):
        shares.place("data", "train/a.csv", wanted, target)
    assert not target.exists()


def test_only_a_listed_share_and_only_real_folders(tmp_path):
    with pytest.raises(InvalidInput, match="does not share 'other'"):
        Shares({}).place("other", "a", "0" * 64, tmp_path / "x")
    for bad in ("noequals", "Bad Name=/tmp", f"d={tmp_path / 'missing'}", "d=relative/path"):
        with pytest.raises(CampugridError):
            parse([bad])
    os.mkdir(tmp_path / "f")
    with pytest.raises(CampugridError, match="named twice"):
        parse([f"d={tmp_path / 'f'}", f"d={tmp_path / 'f'}"])
