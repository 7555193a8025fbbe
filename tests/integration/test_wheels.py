"""The agent's wheel fetching, against the real PyPI (reachable from these machines, as the
package registries are): wheels only, for the base's CPython, hash-listed, bounded, and a
clear failure for what has no wheel or is not in the context."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from campugrid.agent.wheels import IN_BUILD, explain, python_of, stage
from campugrid.protocol.dockerfiles import check_dockerfile
from campugrid.protocol.errors import BuildFailed
from campugrid.protocol.spec import BuildOptions

pytestmark = pytest.mark.integration
FROM = "FROM localhost/campugrid/python:bookworm\n"


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
    other = BuildFailed("build failed (buildah exit 1)", "exit 3")
    assert explain(other, None) is other
