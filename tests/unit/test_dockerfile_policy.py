"""The Dockerfile policy against a corpus of tricky spellings, each checked against BuildKit's
own reading (the `dockerfile` package wraps BuildKit's Go parser): first that BuildKit reads
the spelling as the attack it hides, then that the policy refuses it."""

import pytest

from campugrid.protocol.dockerfiles import AllowedBase, allowed_bases, check_dockerfile
from campugrid.protocol.errors import InvalidInput
from tests.support.dockerfiles import CORPUS, buildkit_reads

BASE = "localhost/campugrid/python:bookworm"
F = f"FROM {BASE}\n"
DIGEST = "sha256:" + "ab" * 32
OTHER = "sha256:" + "cd" * 32


@pytest.mark.parametrize(("text", "reads", "says"), [c[1:] for c in CORPUS], ids=[c[0] for c in CORPUS])
def test_each_tricky_spelling_is_refused_as_buildkit_reads_it(text, reads, says):
    assert reads in buildkit_reads(text), buildkit_reads(text)
    with pytest.raises(InvalidInput, match=says):
        check_dockerfile(text, allowed_bases(BASE))


def test_refusals_name_the_line():
    with pytest.raises(InvalidInput, match="line 3"):
        check_dockerfile(F + "RUN true\nADD http://x/ /y\n", allowed_bases(BASE))


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
