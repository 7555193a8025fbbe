"""The agent's wheel fetching, against the real PyPI (reachable from these machines, as the
package registries are): wheels only, for the base's CPython, hash-listed, bounded, and a
clear failure for what has no wheel or is not in the context."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from campugrid.agent.wheels import IN_BUILD, explain, python_of, stage
from campugrid.protocol.dockerfiles import allowed_bases, check_dockerfile
from campugrid.protocol.errors import BuildFailed
from campugrid.protocol.spec import BuildOptions

pytestmark = pytest.mark.integration
FROM = "FROM localhost/campugrid/python:bookworm\n"
CORPUS = Path(__file__).resolve().parents[1] / "corpus"


def staged(tmp_path: Path, dockerfile: str, build: BuildOptions = BuildOptions(), *,
           python: str = "3.11", disk_mb: int = 256, **files: str):
    context = tmp_path / "context"
    context.mkdir()
    for name, text in files.items():
        (context / name).write_text(text)
    lines: list[str] = []
    got = stage(check_dockerfile(FROM + dockerfile).pip, build, context, tmp_path,
                python=python, disk_mb=disk_mb, log=lines.append, stop=threading.Event())
    return got, "\n".join(lines)


def test_the_declared_packages_arrive_as_wheels_for_the_bases_python(tmp_path):
    got, log = staged(tmp_path, "COPY requirements.txt /app/\n"
                      "RUN pip install -r /app/requirements.txt 'six==1.16.0'\n",
                      BuildOptions(pip=("idna==3.7",)), python="3.12",
                      **{"requirements.txt": "charset-normalizer==3.3.2\n"})
    assert got is not None
    names = sorted(p.name for p in got.folder.iterdir())
    assert names == ["charset_normalizer-3.3.2-cp312-cp312-manylinux_2_17_x86_64."
                     "manylinux2014_x86_64.whl", "idna-3.7-py3-none-any.whl",
                     "six-1.16.0-py2.py3-none-any.whl"]
    assert got.count == 3 and got.bytes == sum(p.stat().st_size for p in got.folder.iterdir())
    assert "wheel six-1.16.0-py2.py3-none-any.whl 0.0 MB sha256:" in log
    assert dict(got.run_args())["PIP_FIND_LINKS"] == IN_BUILD
    assert got.volumes() == ((got.folder, IN_BUILD),)


def test_nothing_to_fetch_when_the_build_installs_nothing_with_pip(tmp_path):
    assert staged(tmp_path, "RUN echo no pip here\n")[0] is None


def test_a_package_with_no_wheel_fails_naming_it(tmp_path):
    """docopt publishes only a source archive: building it would run its setup.py outside
    the sandbox, so it is not fetched."""
    with pytest.raises(BuildFailed, match=r"Python package docopt==0.6.2: no binary wheel for "
                                          r"CPython 3.11 .* wheels only"):
        staged(tmp_path, "RUN pip install docopt==0.6.2\n")


def test_a_requirement_file_missing_from_the_context_is_named(tmp_path):
    with pytest.raises(BuildFailed, match=r"line 2: pip install -r /app/reqs.txt: no such file "
                                          r"in the context"):
        staged(tmp_path, "RUN pip install -r /app/reqs.txt\n")


def test_the_wheels_count_against_the_jobs_disk_as_they_arrive(tmp_path):
    """NumPy's wheel is 16 MB: the fetch stops once 1 MB is written, and nothing stays."""
    with pytest.raises(BuildFailed, match=r"wheels take .*more than resources.disk_mb "
                                          r"\(1 MB\)"):
        staged(tmp_path, "RUN pip install numpy==2.1.3\n", disk_mb=1)
    assert not (tmp_path / "pip-tmp").exists()


def test_python_version_from_the_spec_then_the_image_then_the_default():
    env = ["PATH=/usr/local/bin", "PYTHON_VERSION=3.12.4"]
    assert python_of(env, BuildOptions(python="3.10")) == "3.10"
    assert python_of(env, BuildOptions()) == "3.12"
    assert python_of(["PATH=/bin"], BuildOptions()) == "3.11"


def test_a_build_that_finds_no_wheel_says_how_to_declare_it():
    failed = BuildFailed("build failed (buildah exit 1)",
                         "ERROR: No matching distribution found for idna==3.7\n")
    assert "installs idna==3.7, which was not declared" in explain(failed, object()).reason  # type: ignore[arg-type]
    uv = BuildFailed("build failed (buildah exit 1)",
                     "error: Failed to download `docopt==0.6.2`\n  cause: Network connectivity "
                     "is disabled\n")
    assert "`uv sync` needs docopt==0.6.2 from uv.lock" in explain(uv, object()).reason  # type: ignore[arg-type]
    undeclared = BuildFailed("build failed (buildah exit 1)", "cause: Because requests was not "
                             "found in the cache and you require requests, we can conclude")
    assert "installs requests, which was not declared" in explain(undeclared, object()).reason  # type: ignore[arg-type]
    other = BuildFailed("build failed (buildah exit 1)", "exit 3")
    assert explain(other, None) is other


def test_a_uv_lock_is_fetched_as_locked_and_real_uv_syncs_from_it_offline(tmp_path):
    """tests/corpus/uv-project: `uv sync --locked` lines. The lock's pins arrive, checked
    against its hashes (jmespath 1.0.1, older than the newest: nothing is resolved anew),
    with what uv needs to build the project (setuptools); the lock's wheel URLs, and nothing
    else in it, now name the copies. Real uv then syncs the project from them with no
    network, as a RUN step would."""
    context = tmp_path / "context"
    shutil.copytree(CORPUS / "uv-project", context, ignore=shutil.ignore_patterns("expect.json"))
    original = (context / "uv.lock").read_text()
    dockerfile = (context / "Dockerfile").read_text().replace("FROM python:3.11-slim\n", FROM)
    dockerfile = dockerfile.replace("ghcr.io/astral-sh/uv:0.13.9", "localhost/uv:0.13.9")
    lines: list[str] = []
    checked = check_dockerfile(dockerfile, allowed_bases(f"{FROM[5:-1]},localhost/uv:0.13.9"))
    got = stage(checked.pip, BuildOptions(), context, tmp_path,
                python="3.11", disk_mb=256, log=lines.append, stop=threading.Event())
    assert got is not None
    names = sorted(p.name for p in got.folder.iterdir())
    assert [n.split("-")[:2] for n in names] == [
        ["jmespath", "1.0.1"], ["setuptools", names[1].split("-")[1]], ["six", "1.16.0"]], names
    assert "[campugrid] fetching Python wheels that uv.lock pins for CPython 3.11" in \
        "\n".join(lines)
    pointed = (context / "uv.lock").read_text()
    changed = [(a, b) for a, b in zip(original.splitlines(), pointed.splitlines(), strict=True)
               if a != b]
    assert sorted(b.split('"')[1] for _, b in changed) == [
        f"file://{IN_BUILD}/jmespath-1.0.1-py3-none-any.whl",
        f"file://{IN_BUILD}/six-1.16.0-py2.py3-none-any.whl"]
    # uv, as the build's RUN step runs it (the copies where this test can reach them)
    (context / "uv.lock").write_text(pointed.replace(f"file://{IN_BUILD}", f"file://{got.folder}"))
    env = {**os.environ, **dict(got.run_args()), "UV_FIND_LINKS": str(got.folder),
           "UV_PYTHON": sys.executable, "UV_CACHE_DIR": str(tmp_path / "uv-cache")}
    uv = Path(sys.executable).with_name("uv")
    done = subprocess.run(["unshare", "-n", str(uv), "sync", "--locked", "--no-dev"],
                          cwd=context, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    installed = {p.name for p in (context / ".venv").glob("lib/python3*/site-packages/*")}
    assert {"jmespath-1.0.1.dist-info", "six-1.16.0.dist-info"} <= installed, installed


def test_the_wheels_pip_chose_are_used_again_for_ten_minutes_checked_by_sha256(
        tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # a cache of its own
    dockerfile = "RUN pip install 'six==1.16.0' 'idna==3.7'\n"

    def again(n: int) -> tuple[list[str], str]:
        (tmp_path / str(n)).mkdir()
        got, log = staged(tmp_path / str(n), dockerfile)
        assert got is not None and got.count == 2
        return sorted(re.findall(r"wheel (\S+) [\d.]+ MB (sha256:\w+)", log)), log

    first, log1 = again(1)
    second, log2 = again(2)
    assert "fetching Python wheels" in log1 and "[pip]" in log1
    assert "[pip]" not in log2 and "fetching Python wheels" not in log2
    assert re.search(r"2 Python wheels as pip chose them \d+ s ago for the same requirements from "
                     r"https://pypi.org/simple, kept on this machine", log2), log2
    assert second == first and len(first) == 2  # the same files, by sha256
    kept = tmp_path / "cache" / "campugrid" / "wheels"
    [record] = (kept / "sets").glob("*.json")
    os.utime(record, (time.time() - 700, time.time() - 700))  # older than ten minutes
    third, log3 = again(3)
    assert "[pip]" in log3 and third == first
    # a kept wheel that changed is not used: pip is asked, and the file replaced
    digest = first[0][1].removeprefix("sha256:")
    (kept / "files" / digest).unlink()
    (kept / "files" / digest).write_bytes(b"not the wheel")
    fourth, log4 = again(4)
    assert "[pip]" in log4 and fourth == first
    fifth, log5 = again(5)
    assert "[pip]" not in log5 and fifth == first
