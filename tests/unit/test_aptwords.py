"""What a RUN line installs with apt, read before the build (protocol/aptwords.py), and the
release a base is for the agent's apt (agent/debs.py)."""

from __future__ import annotations

import pytest

from campugrid.agent.debs import Release, installed, release_of
from campugrid.protocol.aptwords import apt_installs
from campugrid.protocol.errors import BuildFailed, InvalidInput
from campugrid.protocol.spec import JobSpec


def installs(line: str, json_form: bool = False) -> list[tuple[tuple[str, ...], bool, bool]]:
    value = [line] if not json_form else line.split("\x00")
    return [(a.packages, a.recommends, a.upgrade) for a in apt_installs(value, json_form, 7)]


@pytest.mark.parametrize("line, want", [
    ("apt-get update && apt-get install -y libgl1 libglib2.0-0 && rm -rf /var/lib/apt/lists/*",
     [(("libgl1", "libglib2.0-0"), True, False)]),
    ("DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends jq",
     [(("jq",), False, False)]),
    ("apt-get -qq -o APT::Install-Recommends=false install -y jq", [(("jq",), False, False)]),
    ("apt -y install -oAPT::Install-Recommends=0 jq=1.6-2.1+deb12u3 curl/bookworm-backports",
     [(("jq=1.6-2.1+deb12u3", "curl/bookworm-backports"), False, False)]),
    ("sudo apt-get install -y \\\n    gcc \\\n    libc6-dev:amd64", [(("gcc", "libc6-dev:amd64"), True, False)]),
    ("sh -c \"apt-get update; apt-get -y dist-upgrade; apt-get install -y g++\"",
     [((), True, True), (("g++",), True, False)]),
    ("apt-get install -y ./vendor/tool.deb jq", [(("jq",), True, False)]),
    ("apt-get update", []),
    ("apt-get remove -y jq && apt-cache show jq && echo apt-get install nothing", []),
    ("apt-get -t bookworm-backports install -y jq 2>/dev/null || true", [(("jq",), True, False)]),
])
def test_install_lines_are_read_as_a_shell_would(line, want):
    assert installs(line) == want


def test_the_exec_form_is_read_too():
    assert installs("apt-get\x00install\x00-y\x00jq", json_form=True) == [(("jq",), True, False)]


@pytest.mark.parametrize("line, says", [
    ("apt-get install -y $PKGS", "shell variable"),
    ("apt-get install -y `cat pkgs`", "shell variable"),
    ("apt-get install -y LibGL1", "not a Debian package name"),
    ("apt-get install -y 'lib*'", "not a Debian package name"),
])
def test_what_cannot_be_fetched_beforehand_is_refused_naming_the_line(line, says):
    with pytest.raises(InvalidInput) as e:
        apt_installs([line], False, 7)
    assert "Dockerfile line 7" in str(e.value) and says in str(e.value)


def test_the_spec_takes_build_apt_checked():
    assert JobSpec.from_dict({"build": {"apt": ["libgl1", "jq=1.6"]}}).build.apt == (
        "libgl1", "jq=1.6")
    for bad in (["$X"], "libgl1", [1]):
        with pytest.raises(InvalidInput) as e:
            JobSpec.from_dict({"build": {"apt": bad}})
        assert "build.apt" in str(e.value)


def test_the_release_comes_from_os_release_and_names_only_the_distributions_mirrors():
    debian = release_of(b'PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\nID=debian\n'
                        b'VERSION_CODENAME=bookworm\n', "img")
    assert (debian.distro, debian.codename) == ("debian", "bookworm")
    assert debian.sources().splitlines()[0] == "deb http://deb.debian.org/debian bookworm main"
    assert "debian-security bookworm-security main" in debian.sources()
    ubuntu = release_of(b'NAME="Ubuntu"\nID=ubuntu\nID_LIKE=debian\nVERSION_CODENAME=jammy\n',
                        "img")
    assert Release("ubuntu", "jammy", "amd64").sources().splitlines() == [
        "deb http://archive.ubuntu.com/ubuntu jammy main restricted universe multiverse",
        "deb http://archive.ubuntu.com/ubuntu jammy-updates main restricted universe multiverse",
        "deb http://security.ubuntu.com/ubuntu jammy-security main restricted universe "
        "multiverse"]
    assert ubuntu.distro == "ubuntu"
    assert "ports.ubuntu.com" in Release("ubuntu", "jammy", "arm64").sources()
    mint = release_of(b'ID=linuxmint\nID_LIKE="ubuntu debian"\nUBUNTU_CODENAME=jammy\n'
                      b'VERSION_CODENAME=virginia\n', "img")
    assert mint.distro == "ubuntu"


@pytest.mark.parametrize("text", [None, b"ID=alpine\nVERSION_ID=3.20\n",
                                  b"ID=debian\n", b'ID=debian\nVERSION_CODENAME="x; rm -rf"\n'])
def test_a_base_apt_cannot_serve_fails_the_build_saying_so(text):
    with pytest.raises(BuildFailed) as e:
        release_of(text, "docker.io/library/x:1")
    assert "Debian and Ubuntu bases only" in e.value.reason


def test_apt_here_reads_only_the_installed_packages_relations_of_the_images_status():
    """The base image's dpkg status is the job's: the agent's apt reads a re-written copy,
    each installed package's relation fields in plain text, nothing else."""
    raw = (b"Package: libc6\nStatus: install ok installed\nPriority: optional\n"
           b"Architecture: amd64\nVersion: 2.36-9+deb12u4\nDepends: libgcc-s1\n"
           b"Description: GNU C Library\n long text\nConffiles:\n /etc/x 0123\n\n"
           b"Package: gone\nStatus: deinstall ok config-files\nVersion: 1.0\n\n"
           b"Package: Bad Name\nStatus: install ok installed\nVersion: 1\n\n"
           b"Package: odd\nStatus: install ok installed\nVersion: 1\nDepends: a\x00b,\n"
           b" c (>= 1)\nX-Custom: whatever\n")
    assert installed(raw).decode() == (
        "Package: libc6\nStatus: install ok installed\nPriority: optional\n"
        "Architecture: amd64\nVersion: 2.36-9+deb12u4\nDepends: libgcc-s1\n\n"
        "Package: odd\nStatus: install ok installed\nVersion: 1\n")
    assert installed(b"") == b"\n" and installed(b"\xff\xfe garbage") == b"\n"
