"""The Dockerfile policy against a corpus of tricky spellings, each checked against BuildKit's
own reading (the `dockerfile` package wraps BuildKit's Go parser): first that BuildKit reads
the spelling as the attack it hides, then that the policy refuses it."""

import pytest

from campugrid.buildpolicy.dockerfiles import (
    AllowedBase,
    allowed_bases,
    base_registries,
    check_dockerfile,
    parse_image_ref,
    pin_bases,
)
from campugrid.protocol.errors import InvalidInput
from tests.support.dockerfiles import CORPUS, buildkit_reads

BASE = "localhost/campugrid/python:bookworm"
F = f"FROM {BASE}\n"
DIGEST = "sha256:" + "ab" * 32
OTHER = "sha256:" + "cd" * 32


@pytest.mark.parametrize(("text", "reads", "says"), [c[1:] for c in CORPUS], ids=[c[0] for c in CORPUS])
def test_each_tricky_spelling_is_refused_as_buildkit_reads_it(text, reads, says):
    assert reads in buildkit_reads(text), buildkit_reads(text)
    if says is None:  # an http(s) ADD: the check records what BuildKit fetches, the network
        urls = check_dockerfile(text, allowed_bases(BASE)).urls  # decides (tests/security)
        assert len(urls) == 1 and "127.0.0.1" in urls[0], urls
        return
    with pytest.raises(InvalidInput, match=says):
        check_dockerfile(text, allowed_bases(BASE))


def test_refusals_name_the_line():
    with pytest.raises(InvalidInput, match="line 3"):
        check_dockerfile(F + "RUN true\nCOPY http://x/ /y\n", allowed_bases(BASE))


def test_an_add_of_a_url_is_recorded_as_buildkit_reads_it():
    checked = check_dockerfile(F + "ARG U=https://example.org\nADD ${U}/a.tgz /a\n"
                               "ADD http:/\\\n/files.example.org/b /b\n", allowed_bases(BASE))
    assert checked.urls == ("https://example.org/a.tgz", "http://files.example.org/b")


@pytest.mark.parametrize("text", [
    F + "RUN echo a \\\n  # note\n  && echo b\nADD --chown=1:1 local.tgz /opt/\n",
    "# syntax=docker/dockerfile:1\nARG V=1\n" + F + "ARG V\nRUN echo $V\n",
    F + "RUN --network=none make\nCOPY --chmod=755 --link run.sh /run.sh\n",
    f"ARG B={BASE}\nFROM $B AS build\nRUN make\nFROM ${{B}}\nCOPY --from=build /out /out\nCOPY --from=0 /a /a\n",
    f"FROM {BASE} AS Base\nENV D=/srv\nFROM base\nCOPY app $D/app\n",
    F + 'COPY ["my file.txt", "/srv/"]\n',
    F + "ENV X=1 Y=2\nWORKDIR /app\nUSER 1000\nCMD [\"python3\"]\n",
    "FROM scratch\nCOPY a /a\n",
])
def test_ordinary_dockerfiles_pass(text):
    check_dockerfile(text, allowed_bases(BASE))


def test_the_check_reports_the_bases_it_builds_on():
    checked = check_dockerfile(f"FROM {BASE} AS a\nFROM a\nFROM {BASE}@{DIGEST}\n",
                               allowed_bases(BASE))
    assert checked.stages == 3
    assert [(u.line, u.allowed.name, u.digest) for u in checked.bases] == [
        (1, BASE, None), (3, BASE, DIGEST)]


def test_a_pinned_base_must_carry_its_pin():
    pinned = allowed_bases(f"{BASE}@{DIGEST}")
    assert pinned == (AllowedBase(BASE, DIGEST),)
    assert check_dockerfile(f"FROM {BASE}@{DIGEST}\n", pinned).bases[0].allowed.digest == DIGEST
    with pytest.raises(InvalidInput, match="pins"):
        check_dockerfile(f"FROM {BASE}@{OTHER}\n", pinned)
    with pytest.raises(InvalidInput, match="sha256"):
        check_dockerfile(f"FROM {BASE}@sha256:short\n", pinned)


def test_the_allowed_list_comes_from_configuration(monkeypatch):
    monkeypatch.setenv("CAMPUGRID_ALLOWED_BASES", f"a/b:1, c/d:2@{DIGEST}")
    assert allowed_bases() == (AllowedBase("a/b:1"), AllowedBase("c/d:2", DIGEST))
    check_dockerfile("FROM a/b:1\n")
    with pytest.raises(InvalidInput, match="allowed: a/b:1, c/d:2@"):
        check_dockerfile(F)
    monkeypatch.delenv("CAMPUGRID_ALLOWED_BASES")
    assert allowed_bases() == (AllowedBase(BASE),)
    with pytest.raises(ValueError, match="NAME:TAG"):
        allowed_bases("a/b:1@md5:00")


# --- FROM an image on a registry ------------------------------------------------------------


@pytest.mark.parametrize(("written", "normal"), [
    ("python:3.11-slim", "docker.io/library/python:3.11-slim"),
    ("python", "docker.io/library/python:latest"),
    ("docker.io/python:3.11", "docker.io/library/python:3.11"),
    ("index.docker.io/library/python:3.11", "docker.io/library/python:3.11"),
    ("pytorch/pytorch:2.3.1-cuda12.1-cudnn8-runtime",
     "docker.io/pytorch/pytorch:2.3.1-cuda12.1-cudnn8-runtime"),
    ("nvcr.io/nvidia/pytorch:24.01-py3", "nvcr.io/nvidia/pytorch:24.01-py3"),
    ("GHCR.io/org/img", "ghcr.io/org/img:latest"),
    ("localhost:5000/a/b:1", "localhost:5000/a/b:1"),
    (f"python@{DIGEST}", f"docker.io/library/python:latest@{DIGEST}"),
])
def test_every_spelling_of_an_image_reads_as_one_name(written, normal):
    assert str(parse_image_ref(written)) == normal


@pytest.mark.parametrize("bad", ["Python:3", "python:-x", "a//b", "python:3@sha256:12",
                                 "bad_host.io:port/x", "x/" + "y" * 3 + "..z"])
def test_what_is_not_an_image_reference_is_refused(bad):
    with pytest.raises(ValueError):
        parse_image_ref(bad)


def test_a_from_on_an_allowed_registry_is_a_remote_base_and_others_are_refused():
    checked = check_dockerfile("FROM python:3.11-slim AS b\nFROM " + BASE + "\n",
                               allowed_bases(BASE), ("docker.io",))
    remote, local = checked.bases
    assert remote.remote and remote.allowed.name == "docker.io/library/python:3.11-slim"
    assert remote.stage == "b" and not local.remote
    for text, says in (("FROM evil.example/x:1\n", "evil.example is not an allowed registry"),
                       ("FROM docker.io.evil.example/library/python:3\n", "not an allowed registry"),
                       ("FROM localhost/other:1\n", "localhost is not an allowed registry"),
                       ("FROM 0123456789ab\n", "image id"),
                       ("FROM quay.io/x/y:1\n", "quay.io is not an allowed registry")):
        with pytest.raises(InvalidInput, match=says):
            check_dockerfile(text, allowed_bases(BASE), ("docker.io",))
    with pytest.raises(InvalidInput, match="no registries"):
        check_dockerfile("FROM python:3\n", allowed_bases(BASE), base_registries("none"))


def test_the_registries_come_from_configuration(monkeypatch):
    assert base_registries() == ("docker.io", "ghcr.io", "nvcr.io", "quay.io")
    monkeypatch.setenv("CAMPUGRID_BASE_REGISTRIES", "Index.Docker.io, registry.example.org:5000")
    assert base_registries() == ("docker.io", "registry.example.org:5000")
    with pytest.raises(ValueError, match="host name"):
        base_registries("https://x")


def test_pinning_rewrites_only_the_remote_froms_whole_instructions():
    text = ("# escape=\\\nARG V=3.11\nFROM python:${V}-slim \\\n  AS build\nRUN echo hi\n"
            f"FROM {BASE}\nCOPY --from=build /x /y\r\n# a\u2028note\nFROM quay.io/a/b:1\n")
    checked = check_dockerfile(text, allowed_bases(BASE), ("docker.io", "quay.io"))
    local = {u: f"localhost/campugrid-cache/b:{u.line}" for u in checked.bases if u.remote}
    pinned = pin_bases(text, local)
    assert pinned.split("\n") == [
        "# escape=\\", "ARG V=3.11", "FROM localhost/campugrid-cache/b:3 AS build",
        "RUN echo hi", f"FROM {BASE}", "COPY --from=build /x /y\r", "# a\u2028note",
        "FROM localhost/campugrid-cache/b:9", ""]
    again = check_dockerfile(pinned, allowed_bases(f"{BASE},localhost/campugrid-cache/b:3,"
                                                   "localhost/campugrid-cache/b:9"), ())
    assert [u.remote for u in again.bases] == [False, False, False]


def test_copy_from_an_image_is_a_base_pinned_in_its_flag_alone():
    """uv's Docker guide copies its binary out of its image (`COPY --from=ghcr.io/astral-sh/
    uv:…`): that image is resolved and pulled like a FROM's, and the agent's copy of the
    Dockerfile names the pulled copy in that one flag, the rest of the line as written."""
    text = (f"FROM {BASE}\nARG UV=ghcr.io/astral-sh/uv:0.13.9\n"
            "COPY --chown=1000 --from=$UV /uv /uvx \\\n  /bin/\n"
            f"COPY --from={BASE} /etc/os-release /x\n")
    checked = check_dockerfile(text, allowed_bases(BASE), ("docker.io", "ghcr.io"))
    remote = [u for u in checked.bases if u.remote]
    assert [(u.line, u.end_line, u.copy, u.allowed.name) for u in checked.bases] == [
        (1, 1, False, BASE), (3, 4, True, "ghcr.io/astral-sh/uv:0.13.9"), (5, 5, True, BASE)]
    assert remote[0].said == "COPY --from=ghcr.io/astral-sh/uv:0.13.9"
    pinned = pin_bases(text, {remote[0]: "localhost/campugrid-cache/uv:3"}, checked.froms,
                       (("PIP_NO_INDEX", "1"),))
    assert pinned.split("\n") == [
        f"FROM {BASE}", "ARG PIP_NO_INDEX=1", "ARG UV=ghcr.io/astral-sh/uv:0.13.9",
        "COPY --chown=1000 --from=localhost/campugrid-cache/uv:3 /uv /uvx \\", "  /bin/",
        f"COPY --from={BASE} /etc/os-release /x", ""]
    again = check_dockerfile(pinned, allowed_bases(f"{BASE},localhost/campugrid-cache/uv:3"), ())
    assert [(u.remote, u.copy) for u in again.bases] == [(False, False), (False, True),
                                                         (False, True)]


def test_build_arguments_follow_every_from_and_nothing_else_moves():
    """The agent's copy of a Dockerfile points pip at the fetched wheels with ARG lines after
    each FROM (every stage's RUN steps see them), remote FROMs pinned at the same time."""
    text = (f"FROM python:3.11-slim \\\n  AS build\nRUN pip install six\nFROM {BASE}\n"
            "COPY --from=build /x /y\nFROM build AS again\nRUN true\n")
    checked = check_dockerfile(text, allowed_bases(BASE), ("docker.io",))
    assert checked.froms == ((1, 2), (4, 4), (6, 6))
    local = {u: "localhost/campugrid-cache/py:1" for u in checked.bases if u.remote}
    args = (("PIP_NO_INDEX", "1"), ("PIP_FIND_LINKS", "/dev/w"))
    got = pin_bases(text, local, checked.froms, args).split("\n")
    assert got == ["FROM localhost/campugrid-cache/py:1 AS build",
                   "ARG PIP_NO_INDEX=1", "ARG PIP_FIND_LINKS=/dev/w", "RUN pip install six",
                   f"FROM {BASE}", "ARG PIP_NO_INDEX=1", "ARG PIP_FIND_LINKS=/dev/w",
                   "COPY --from=build /x /y", "FROM build AS again",
                   "ARG PIP_NO_INDEX=1", "ARG PIP_FIND_LINKS=/dev/w", "RUN true", ""]
    assert pin_bases(text, {}, checked.froms, ()) == text  # nothing to do: unchanged


