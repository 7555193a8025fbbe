import io
import tarfile

import pytest

from campugrid.buildpolicy.tarballs import check_dockerfile, extract_context, inspect_context
from campugrid.protocol.errors import InvalidInput

DOCKERFILE = b"FROM localhost/campugrid/python:bookworm\nCOPY app.py /app.py\nCMD [\"python3\"]\n"


def make_tar(members, gz=True):
    """members: list of (name, kind, payload) with kind file|dir|symlink|hardlink|fifo|chr."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gz else "w") as tar:
        for name, kind, payload in members:
            info = tarfile.TarInfo(name)
            if kind == "file":
                info.size = len(payload)
                info.mode = 0o755 if name.endswith(".sh") else 0o644
                tar.addfile(info, io.BytesIO(payload))
                continue
            info.type = {"dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE,
                         "hardlink": tarfile.LNKTYPE, "fifo": tarfile.FIFOTYPE,
                         "chr": tarfile.CHRTYPE}[kind]
            if kind in ("symlink", "hardlink"):
                info.linkname = payload
            tar.addfile(info)
    return buf.getvalue()


def test_a_good_context_unpacks_with_modes_and_links(tmp_path):
    data = make_tar([("Dockerfile", "file", DOCKERFILE), ("src", "dir", None),
                     ("src/run.sh", "file", b"#!/bin/sh\necho hi\n"),
                     ("src/link", "symlink", "run.sh"), ("copy.sh", "hardlink", "src/run.sh"),
                     ("app.py", "file", b"print(1)")])
    info = extract_context(data, tmp_path / "ctx")
    assert info.members == 6 and "COPY app.py" in info.dockerfile
    assert (tmp_path / "ctx/src/run.sh").stat().st_mode & 0o111
    assert (tmp_path / "ctx/src/link").resolve() == (tmp_path / "ctx/src/run.sh").resolve()
    assert (tmp_path / "ctx/copy.sh").read_bytes() == b"#!/bin/sh\necho hi\n"


def test_plain_tar_is_accepted_too():
    assert inspect_context(make_tar([("./Dockerfile", "file", DOCKERFILE),
                                     ("./app.py", "file", b"")], gz=False)).members == 2


@pytest.mark.parametrize(("members", "says"), [
    ([("../evil", "file", b"x"), ("Dockerfile", "file", DOCKERFILE)], "leaves the context folder"),
    ([("/etc/passwd", "file", b"x"), ("Dockerfile", "file", DOCKERFILE)], "absolute path"),
    ([("Dockerfile", "file", DOCKERFILE), ("out", "symlink", "../../etc/shadow")], "leaves the context"),
    ([("Dockerfile", "file", DOCKERFILE), ("out", "symlink", "/etc/shadow")], "is absolute"),
    ([("Dockerfile", "file", DOCKERFILE), ("dev", "chr", None)], "device, fifo"),
    ([("Dockerfile", "file", DOCKERFILE), ("p", "fifo", None)], "device, fifo"),
    ([("app.py", "file", b"print(1)")], "no Dockerfile at the top"),
])
def test_hostile_or_broken_contexts_are_refused(members, says, tmp_path):
    data = make_tar(members)
    with pytest.raises(InvalidInput, match=says.replace("(", r"\(")):
        inspect_context(data)
    with pytest.raises(InvalidInput):
        extract_context(data, tmp_path / "ctx")
    assert not (tmp_path / "evil").exists()


def test_garbage_is_not_an_archive():
    with pytest.raises(InvalidInput, match="not a tar"):
        inspect_context(b"this is not a tarball")


@pytest.mark.parametrize(("dockerfile", "says"), [
    ("RUN echo hi", "RUN before the first FROM"),
    ("FROM localhost/campugrid/python:bookworm\nRUN --network=host curl example.org", "through the platform's egress proxy"),
    ("FROM localhost/campugrid/python:bookworm\nRUN --mount=type=secret,id=aws cat /run/secrets/aws", "secret and ssh mounts"),
    ("FROM localhost/campugrid/python:bookworm\nCOPY https://example.org/a.tgz /a.tgz", "COPY takes files from the context"),
    ("FROM localhost/campugrid/python:bookworm\nFROBNICATE now", "unknown instruction 'FROBNICATE'"),
    ("# only a comment", "no FROM instruction"),
])
def test_dockerfile_checks_say_which_line(dockerfile, says):
    with pytest.raises(InvalidInput, match=says):
        check_dockerfile(dockerfile)


def test_dockerfile_continuations_and_comments_are_understood():
    check_dockerfile("# syntax=docker/dockerfile:1\nARG V=1\nFROM localhost/campugrid/python:bookworm\nRUN echo a \\\n  # note\n  && echo b\n"
                     "ADD --chown=1:1 local.tgz /opt/\n")


@pytest.mark.parametrize("members", [
    # a link through a link: textually inside, really outside (then written through)
    [("Dockerfile", "file", DOCKERFILE), ("s", "dir", None), ("s/l", "symlink", ".."),
     ("s/l/m", "symlink", ".."), ("s/l/m/x", "file", b"pwn")],
    [("Dockerfile", "file", DOCKERFILE), ("sub", "dir", None), ("sub/b", "symlink", ".."),
     ("a", "symlink", "sub/b/..")],
    # a hard link that would copy a host file in through a link
    [("Dockerfile", "file", DOCKERFILE), ("sub", "dir", None), ("sub/b", "symlink", ".."),
     ("sub/b/n", "symlink", ".."), ("stolen", "hardlink", "sub/b/n/secret.txt")],
    # the same name twice: the second would write through the first
    [("Dockerfile", "file", DOCKERFILE), ("x", "symlink", "Dockerfile"), ("x", "file", b"y")],
])
def test_link_chains_cannot_reach_outside_the_context(members, tmp_path):
    if len({m[0] for m in members}) == len(members):  # a chain: refused already at submit
        with pytest.raises(InvalidInput, match="outside the context"):
            inspect_context(make_tar(members))
    (tmp_path / "secret.txt").write_text("provider secret")
    with pytest.raises(InvalidInput):
        extract_context(make_tar(members), tmp_path / "ctx")
    assert not (tmp_path / "x").exists() and not (tmp_path / "ctx").exists()
    assert (tmp_path / "secret.txt").read_text() == "provider secret"


@pytest.mark.parametrize("dockerfile", [
    "FROM localhost/campugrid/python:bookworm\nRUN --mount=type=SECRET,id=a cat /run/secrets/a",
    "FROM localhost/campugrid/python:bookworm\nRUN --mount=type=bind,from=y,target=/host ls /host",
    "FROM localhost/campugrid/python:bookworm\nRUN --mount=type=cache,target=/root/.cache pip install x",
    "FROM localhost/campugrid/python:bookworm\nCOPY --from=evil.example/library/alpine:3 /etc/passwd /p",
])
def test_build_steps_that_reach_outside_are_refused(dockerfile):
    with pytest.raises(InvalidInput):
        check_dockerfile(dockerfile)


def test_truncated_archives_are_refused_not_crashed():
    data = make_tar([("Dockerfile", "file", DOCKERFILE), ("big", "file", b"x" * 100000)])
    with pytest.raises(InvalidInput, match=r"not a tar|damaged"):
        inspect_context(data[: len(data) // 2])


def test_the_client_packs_what_dockerignore_leaves_and_the_dockerfile_always(tmp_path):
    from campugrid.client.api import pack_folder

    (tmp_path / "Dockerfile").write_bytes(DOCKERFILE)
    (tmp_path / ".dockerignore").write_text("# big things stay home\n\ndata/\n*.ckpt\n"
                                            "!keep.ckpt\nDockerfile\n**/__pycache__\n")
    for name in ("app.py", "data/train.csv", "old.ckpt", "keep.ckpt", "src/m.py",
                 "src/__pycache__/m.cpython-311.pyc"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    buf = io.BytesIO()
    pack_folder(tmp_path, buf)
    with tarfile.open(fileobj=io.BytesIO(buf.getvalue())) as tar:
        names = {m.name for m in tar.getmembers() if m.isfile()}
    assert names == {"Dockerfile", ".dockerignore", "app.py", "keep.ckpt", "src/m.py"}


def test_the_client_stops_packing_past_the_coordinators_limit_before_any_upload(tmp_path):
    import os

    from campugrid.client.api import pack_folder

    (tmp_path / "Dockerfile").write_bytes(DOCKERFILE)
    (tmp_path / "weights.bin").write_bytes(os.urandom(8 * 1024 * 1024))  # does not compress
    out = io.BytesIO()
    with pytest.raises(InvalidInput, match=r"larger than the coordinator takes \(2 MiB "
                                           r"compressed\); leave big files out with a "
                                           r"\.dockerignore"):
        pack_folder(tmp_path, out, limit=2 * 1024 * 1024)
    assert out.tell() < 4 * 1024 * 1024  # it stopped soon after the limit, not at the end
    (tmp_path / ".dockerignore").write_text("*.bin\n")
    assert pack_folder(tmp_path, io.BytesIO(), limit=2 * 1024 * 1024) < 4096


@pytest.mark.parametrize(("copy", "found"), [
    ("COPY app.py /app.py", True), ("COPY ./src/ /src", True), ("COPY src/run.sh /x", True),
    ("COPY src/*.sh /bin/", True), ("COPY . /app", True), ("COPY /app.py /a", True),
    ("COPY linked/inner.txt /x", True),  # through a link: the build judges
    ("COPY data/ /x", True),  # a folder the tarball has only files of
    ("COPY --from=localhost/campugrid/python:bookworm /etc/os-release /x", True),  # an image
    ("COPY src/*.py /x", True), ("COPY linked/*.sh /x", True),  # patterns: the build's call
    ("COPY requirements.txt /r.txt", False),
    ("ADD model.bin /m", False), ("COPY app.py missing.py /x/", False),
])
def test_a_copy_of_something_not_in_the_context_is_refused_at_submit_naming_the_line(copy, found):
    text = b"FROM localhost/campugrid/python:bookworm\n" + copy.encode() + b"\n"
    data = make_tar([("Dockerfile", "file", text), ("app.py", "file", b""), ("src", "dir", None),
                     ("src/run.sh", "file", b""), ("linked", "symlink", "src"),
                     ("data/a.csv", "file", b"")])
    if found:
        inspect_context(data)
    else:
        with pytest.raises(InvalidInput, match=r"Dockerfile line 2: \S+ is not in the build "
                                                r"context \(the folder submitted, less what its "
                                                r"\.dockerignore leaves out\)"):
            inspect_context(data)


@pytest.mark.parametrize(("dockerfile", "runs"), [
    ("FROM localhost/campugrid/python:bookworm\n", False),
    ("FROM localhost/campugrid/python:bookworm\nCMD [\"python3\", \"x.py\"]\n", True),
    ("FROM localhost/campugrid/python:bookworm\nENTRYPOINT [\"python3\"]\n", True),
    ("FROM localhost/campugrid/python:bookworm AS b\nCMD [\"x\"]\nFROM b\nRUN true\n", True),
    ("FROM localhost/campugrid/python:bookworm AS b\nCMD [\"x\"]\n"
     "FROM localhost/campugrid/python:bookworm\nCOPY --from=b /x /x\n", False),
])
def test_whether_an_image_says_what_to_run_follows_its_last_stage(dockerfile, runs):
    assert check_dockerfile(dockerfile).runs is runs
