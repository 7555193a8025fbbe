"""What a Dockerfile's pip lines declare (read in the confined check), and the requirement
files and projects they name (read by the agent from the unpacked context)."""

from __future__ import annotations

from pathlib import Path

import pytest

from campugrid.protocol.dockerfiles import check_dockerfile
from campugrid.protocol.errors import InvalidInput
from campugrid.protocol.pipwords import (
    PipInstall,
    allowed_indexes,
    locate,
    project_requirements,
    read_requirements,
    split_extras,
)

FROM = "FROM localhost/campugrid/python:bookworm\n"


def installs(run: str) -> list[PipInstall]:
    return list(check_dockerfile(FROM + run).pip)


@pytest.mark.parametrize("run, want", [
    ("RUN pip install numpy==2.1.* 'scipy>=1.13'", ("numpy==2.1.*", "scipy>=1.13")),
    ("RUN pip3 install --no-cache-dir -U six", ("six",)),
    ("RUN python3 -m pip install requests", ("requests",)),
    ("RUN python -u -mpip install requests", ("requests",)),
    ("RUN /usr/local/bin/pip3.11 install requests", ("requests",)),
    ("RUN uv pip install --system requests", ("requests",)),
    ("RUN PIP_X=1 sudo -H pip install six", ("six",)),
    ('RUN ["pip", "install", "six"]', ("six",)),
    ('RUN ["sh", "-c", "pip install six && echo done"]', ("six",)),
    ("RUN apt-get update && pip install six | tee /log; pip install idna", ("six", "idna")),
    ("RUN pip install \\\n    six \\\n    idna", ("six", "idna")),
    # unquoted: the shell reads > as a redirection, so pip gets only the name
    ("RUN pip install scipy>=1.13 2>&1", ("scipy",)),
    ("RUN pip --no-cache-dir install six", ("six",)),
    ("RUN pip download six && pip list && echo pip install nothing", ()),
    ("RUN python3 -c 'import pip' && pipx install black", ()),
])
def test_the_packages_a_line_installs(run, want):
    assert tuple(r for i in installs(run) for r in i.requirements) == want


def test_files_projects_and_indexes_of_a_line():
    got = installs("RUN pip install -r /app/req.txt -c c.txt --requirement=dev.txt -rx.txt "
                   "-e .[dev] ./pkg /srv/tool --pre "
                   "--extra-index-url https://download.pytorch.org/whl/cpu torch\n")
    assert got == [PipInstall(line=2, requirements=("torch",),
                              files=("/app/req.txt", "c.txt", "dev.txt", "x.txt"),
                              local=(".[dev]", "./pkg", "/srv/tool"),
                              indexes=("https://download.pytorch.org/whl/cpu",), pre=True)]


@pytest.mark.parametrize("run, why", [
    ("RUN pip install $PKG", "shell variable"),
    ("RUN pip install \"numpy==${V}\"", "shell variable"),
    ("RUN pip install 'foo @ https://example.org/foo.whl'", "by URL"),
    ("RUN pip install git+https://github.com/a/b", "version control"),
    ("RUN pip install -e git+https://github.com/a/b#egg=b", "version control"),
    ("RUN pip install -i http://10.0.0.1/simple six", "https indexes this platform allows"),
    ("RUN pip install --index-url=https://evil.example/simple six", "allows"),
    ("RUN pip install 'six=='", "not a requirement"),
])
def test_what_cannot_work_offline_is_refused_naming_the_line(run, why):
    with pytest.raises(InvalidInput, match="Dockerfile line 2") as e:
        installs(run)
    assert why in str(e.value)


def test_allowed_indexes_come_from_configuration(monkeypatch):
    assert "pypi.org" in allowed_indexes()
    monkeypatch.setenv("CAMPUGRID_PIP_INDEXES", "pypi.internal.example")
    assert allowed_indexes() == ("pypi.internal.example",)
    with pytest.raises(InvalidInput):
        installs("RUN pip install -i https://pypi.org/simple six")


def test_requirement_files_nest_keep_hashes_and_stay_in_the_context(tmp_path: Path):
    (tmp_path / "reqs").mkdir()
    (tmp_path / "reqs" / "base.txt").write_text(
        f"# pinned\nnumpy==2.1.3 \\\n    --hash=sha256:{'a' * 64} --hash=sha256:{'b' * 64}\n"
        "requests>=2 ; python_version >= '3.8'  # a comment\n\n--pre\n-c ../constraints.txt\n")
    (tmp_path / "constraints.txt").write_text("idna<4\n--index-url https://pypi.org/simple\n")
    (tmp_path / "requirements.txt").write_text("-r reqs/base.txt\n-e ./lib[fast]\nsix\n")
    reqs, local, indexes, pre = read_requirements(tmp_path / "requirements.txt", tmp_path, "at")
    assert reqs == [f"numpy==2.1.3 --hash=sha256:{'a' * 64} --hash=sha256:{'b' * 64}",
                    'requests>=2; python_version >= "3.8"', "idna<4", "six"]
    assert local == ["./lib[fast]"] and indexes == ["https://pypi.org/simple"] and pre
    (tmp_path / "escape.txt").write_text("-r ../../etc/passwd\n")
    with pytest.raises(InvalidInput, match="outside the context"):
        read_requirements(tmp_path / "escape.txt", tmp_path, "at")
    (tmp_path / "loop.txt").write_text("-r loop.txt\n")
    with pytest.raises(InvalidInput, match="nest more than"):
        read_requirements(tmp_path / "loop.txt", tmp_path, "at")
    (tmp_path / "hash.txt").write_text("six --hash=--index-url=https://evil.example\n")
    with pytest.raises(InvalidInput, match="a hash is sha256"):
        read_requirements(tmp_path / "hash.txt", tmp_path, "at")
    (tmp_path / "url.txt").write_text("foo @ https://example.org/foo.whl\n")
    with pytest.raises(InvalidInput, match=r"url\.txt.*by URL"):
        read_requirements(tmp_path / "url.txt", tmp_path, "at")


def test_a_projects_requirements_are_its_build_needs_and_dependencies(tmp_path: Path):
    (tmp_path / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["hatchling>=1.20"]\n'
        '[project]\nname = "x"\ndependencies = ["numpy>=2"]\n'
        '[project.optional-dependencies]\ndev = ["pytest"]\nother = ["black"]\n')
    assert project_requirements(tmp_path, ("dev",), tmp_path, "at") == (
        ["hatchling>=1.20", "numpy>=2", "pytest"], [])
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\ndynamic = ["dependencies"]\n')
    reqs, warnings = project_requirements(tmp_path, (), tmp_path, "at")
    assert reqs == ["setuptools>=40.8.0", "wheel"] and "build.pip" in warnings[0]
    (tmp_path / "pyproject.toml").write_text("[project\n")
    with pytest.raises(InvalidInput, match="not valid TOML"):
        project_requirements(tmp_path, (), tmp_path, "at")


def test_a_file_is_found_by_its_path_in_the_image(tmp_path: Path):
    (tmp_path / "deps").mkdir()
    (tmp_path / "deps" / "r.txt").write_text("six\n")
    (tmp_path / "requirements.txt").write_text("six\n")
    assert locate("/app/requirements.txt", tmp_path) == tmp_path / "requirements.txt"
    assert locate("requirements.txt", tmp_path) == tmp_path / "requirements.txt"
    assert locate("/srv/deps/r.txt", tmp_path) == tmp_path / "deps" / "r.txt"
    assert locate("/app/none.txt", tmp_path) is None
    assert split_extras("./lib[a, b]") == ("./lib", ("a", "b"))
    assert split_extras(".") == (".", ())
