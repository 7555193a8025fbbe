"""Reading a uv project's lock as data: which wheels it pins for the base's platform, what
cannot work offline, and the URLs pointed at the fetched copies (nothing else changed). The
acceptance corpus (tests/corpus/uv-project) runs real uv on the result inside the build."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from packaging.tags import Tag

from campugrid.agent.wheels import target_tags
from campugrid.protocol import uvlock
from campugrid.protocol.dockerfiles import check_dockerfile
from campugrid.protocol.errors import InvalidInput

CP311 = target_tags("3.11", "x86_64")  # what the agent fetches for CPython 3.11 on x86_64
FILES = "https://files.pythonhosted.org/packages/ab/cd"
H = "sha256:" + "0" * 64


def wheel(name: str, digest: str = H) -> str:
    return f'    {{ url = "{FILES}/{name}", hash = "{digest}", size = 10 }},\n'


def package(name: str, version: str, source: str, *wheels: str, sdist: bool = True) -> str:
    text = f'[[package]]\nname = "{name}"\nversion = "{version}"\nsource = {source}\n'
    if sdist:
        text += f'sdist = {{ url = "{FILES}/{name}-{version}.tar.gz", hash = "{H}" }}\n'
    if wheels:
        text += "wheels = [\n" + "".join(wheels) + "]\n"
    return text + "\n"


PYPI = '{ registry = "https://pypi.org/simple" }'
LOCK = "version = 1\nrevision = 3\nrequires-python = \">=3.11\"\n\n" + "".join([
    package("app", "0.1.0", '{ editable = "." }', sdist=False),
    package("numpy", "2.1.3", PYPI,
            wheel("numpy-2.1.3-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
                  "sha256:" + "1" * 64),
            wheel("numpy-2.1.3-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl"),
            wheel("numpy-2.1.3-cp311-cp311-win_amd64.whl"),
            wheel("numpy-2.1.3-cp311-cp311-macosx_14_0_arm64.whl")),
    package("six", "1.16.0", PYPI, wheel("six-1.16.0-py2.py3-none-any.whl")),
    package("pywin32", "306", PYPI, wheel("pywin32-306-cp311-cp311-win_amd64.whl"),
            sdist=False),
    package("docopt", "0.6.2", PYPI),  # a source archive only
    package("torch", "2.5.1", '{ registry = "https://download.pytorch.org/whl/cpu" }',
            wheel("torch-2.5.1%2Bcpu-cp311-cp311-linux_x86_64.whl"),
            wheel("torch-2.5.1-cp311-none-macosx_11_0_arm64.whl")),
    # uv's forks: one package at two versions, each for its markers
    package("idna", "3.6", PYPI, wheel("idna-3.6-py3-none-any.whl")),
    package("idna", "3.7", PYPI, wheel("idna-3.7-py3-none-any.whl")),
])


def write(root: Path, text: str = LOCK) -> Path:
    (root / "pyproject.toml").write_text('[project]\nname = "app"\nversion = "0.1.0"\n')
    (root / "uv.lock").write_text(text)
    return root / "uv.lock"


def test_the_wheels_a_lock_pins_for_the_bases_python_and_platform(tmp_path):
    got = uvlock.read(write(tmp_path), tmp_path, CP311, "uv sync")
    assert got.pins == (
        (f"numpy==2.1.3 --hash=sha256:{'1' * 64}", f"six==1.16.0 --hash={H}",
         f"idna==3.6 --hash={H}"),
        (f"idna==3.7 --hash={H}",))  # a second round: pip takes one version per call
    assert got.skipped == ("pywin32 306", "docopt 0.6.2", "torch 2.5.1")  # no linux wheel
    assert got.indexes == ("https://download.pytorch.org/whl/cpu",)
    assert got.projects == (tmp_path.resolve(),)  # the editable root: uv builds it
    assert got.urls["six-1.16.0-py2.py3-none-any.whl"] == f"{FILES}/six-1.16.0-py2.py3-none-any.whl"
    assert "numpy-2.1.3-cp311-cp311-win_amd64.whl" not in got.urls


@pytest.mark.parametrize("entry, why", [
    (package("x", "1", '{ git = "https://github.com/a/x?rev=1#abc" }', sdist=False),
     "package x 1 comes from git https://github.com/a/x"),
    (package("x", "1", '{ url = "https://example.org/x-1.whl" }', sdist=False),
     "package x 1 comes from url"),
    (package("x", "1", '{ registry = "https://evil.example/simple" }',
             wheel("x-1-py3-none-any.whl")), "https indexes this platform allows"),
    (package("x", "1", PYPI, '    { url = "http://files.example/x-1-py3-none-any.whl", '
                             f'hash = "{H}" }},\n'), "a wheel without an https URL"),
    (package("x", "1", PYPI, f'    {{ url = "{FILES}/x-1-py3-none-any.whl" }},\n'),
     "no sha256 in the lock"),
    (package("x", "1", PYPI, wheel("x.whl")), "is not a wheel's name"),
    (package("x", "1", '{ editable = "../../elsewhere" }', sdist=False),
     "lies outside the context"),
])
def test_what_cannot_be_fetched_offline_is_refused_naming_the_package(tmp_path, entry, why):
    context = tmp_path / "context"
    context.mkdir()
    path = write(context, "version = 1\n\n" + entry)
    with pytest.raises(InvalidInput, match=r"uv sync: uv\.lock") as e:
        uvlock.read(path, context, CP311, "uv sync")
    assert why in str(e.value)


@pytest.mark.parametrize("text", ["not toml [", "version = 1\n", "package = 3\n",
                                  "package = [1]\n",
                                  '[[package]]\nname = "x"\n' * 2001])
def test_a_file_that_is_no_lock_is_refused(tmp_path, text):
    with pytest.raises(InvalidInput, match=r"uv\.lock"):
        uvlock.read(write(tmp_path, text), tmp_path, CP311, "uv sync")


def test_pointed_changes_only_the_fetched_wheels_urls(tmp_path):
    got = uvlock.read(write(tmp_path), tmp_path, CP311, "uv sync")
    staged = ["six-1.16.0-py2.py3-none-any.whl", "unrelated-1-py3-none-any.whl"]
    text = uvlock.pointed(LOCK, got.urls, staged, "/dev/campugrid-wheels")
    before, after = LOCK.splitlines(), text.splitlines()
    changed = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
    assert changed == [(wheel("six-1.16.0-py2.py3-none-any.whl").rstrip("\n"),
                        '    { url = "file:///dev/campugrid-wheels/six-1.16.0-py2.py3-none-any.'
                        f'whl", hash = "{H}", size = 10 }},')]


def test_the_lock_is_the_projects_or_its_workspaces_within_the_context(tmp_path):
    context = tmp_path / "context"
    member = context / "packages" / "member"
    member.mkdir(parents=True)
    assert uvlock.find(member, context) is None
    write(context)
    assert uvlock.find(member, context) == context.resolve() / "uv.lock"
    (member / "uv.lock").symlink_to(tmp_path / "outside.lock")
    (tmp_path / "outside.lock").write_text(LOCK)
    assert uvlock.find(member, context) == context.resolve() / "uv.lock"  # not the link out
    os.remove(context / "uv.lock")
    assert uvlock.find(member, context) is None


@pytest.mark.parametrize("run, projects", [
    ("RUN uv sync --locked --no-dev", (".",)),
    ("RUN uv sync --frozen --project /app", ("/app",)),
    ("RUN uv --directory=/srv/app sync", ("/srv/app",)),
    ("RUN cd /app && uv run --extra gpu python -m app.prepare", (".",)),
    ("RUN uv run --no-sync python x.py", ()),
    ("RUN uv lock --check && uv pip install six", ()),
])
def test_the_uv_lines_that_sync_a_project(run, projects):
    got = check_dockerfile("FROM localhost/campugrid/python:bookworm\n" + run + "\n").pip
    assert tuple(p for use in got for p in use.uv_projects) == projects


def test_uv_pip_sync_names_requirement_files():
    got = check_dockerfile("FROM localhost/campugrid/python:bookworm\n"
                           "RUN uv pip sync --system -p 3.11 /app/requirements.lock dev.txt\n").pip
    assert [(use.files, use.requirements) for use in got] == [
        (("/app/requirements.lock", "dev.txt"), ())]


def test_the_tags_are_the_ones_pip_download_is_asked_for():
    assert {Tag("cp311", "cp311", "manylinux_2_28_x86_64"), Tag("cp311", "abi3",
            "manylinux2014_x86_64"), Tag("py3", "none", "any")} <= CP311
    assert Tag("cp311", "cp311", "manylinux_2_34_x86_64") not in CP311  # past glibc 2.28
    assert Tag("cp312", "cp312", "manylinux_2_17_x86_64") not in CP311
    assert Tag("cp311", "cp311", "linux_x86_64") not in CP311
    assert not target_tags("3.12", "aarch64") & {Tag("py3", "none", "win_amd64")}
