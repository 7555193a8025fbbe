"""What a Dockerfile's RUN steps install with pip, known before the build.

RUN steps have no network, so the agent fetches a job's Python packages beforehand, as binary
wheels, outside the sandbox (agent/wheels.py). What to fetch is declared: the packages and
requirement files named on `pip install` lines (read here, in the confined Dockerfile check),
the local projects those lines install (their pyproject.toml), and the spec's `build.pip`.

This is a declaration, not a guard: whatever a RUN step installs that the declaration missed
(a script that calls pip, a spelling not read here) finds no index at build time, and the
build fails naming the package (agent/wheels.py explains it). What is refused here is what
could never work offline: a requirement by URL or from version control, a package chosen by a
shell variable, an index the operator does not allow.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from packaging.requirements import InvalidRequirement, Requirement

from campugrid.protocol.errors import InvalidInput
from campugrid.protocol.shellwords import simple_commands

# Indexes a RUN line or a requirement file may name: the agent fetches from them (https only).
DEFAULT_INDEXES = ("pypi.org", "files.pythonhosted.org", "download.pytorch.org",
                   "pypi.nvidia.com")
MAX_REQUIREMENTS = 2000
MAX_FILE_DEPTH = 8

_PIP = re.compile(r"^pip(\d+(\.\d+)?)?$")
_HASH = re.compile(r"^(sha256|sha384|sha512):[0-9a-f]{32,128}$")
_PYTHON = re.compile(r"^python(\d+(\.\d+)?)?$")
# `pip install` options followed by a value (as a separate word, or after "=").
_VALUED = {"-r", "--requirement", "-c", "--constraint", "-e", "--editable", "-t", "--target",
           "--platform", "--python-version", "--implementation", "--abi", "--root", "--prefix",
           "--src", "--upgrade-strategy", "-C", "--config-settings", "--global-option",
           "--install-option", "--no-binary", "--only-binary", "--progress-bar",
           "--root-user-action", "--report", "-i", "--index-url", "--extra-index-url", "-f",
           "--find-links", "--log", "--cache-dir", "--timeout", "--retries", "--proxy",
           "--trusted-host", "--exists-action", "--cert", "--client-cert", "--python", "-p",
           "--keyring-provider", "--use-feature", "--use-deprecated", "--log-file",
           "--index-strategy", "--extra-index", "--index"}

# uv's options that take a value as the next word (the ones `uv sync` and `uv run` share with
# its global options; a misread one only points the agent at another folder).
_UV_VALUED = {"--project", "--directory", "--extra", "--group", "--only-group", "--no-group",
              "--package", "--python", "-p", "--index", "--default-index", "--index-url",
              "--extra-index-url", "--find-links", "-f", "--index-strategy", "--cache-dir",
              "--config-file", "--color", "--python-platform", "--link-mode", "--resolution",
              "--prerelease", "--exclude-newer", "--no-install-package", "--reinstall-package",
              "--upgrade-package", "-P", "--refresh-package", "--no-build-package",
              "--no-binary-package", "--config-setting", "-C", "--keyring-provider",
              "--with", "--with-requirements", "--with-editable", "--env-file", "--script",
              "--fork-strategy"}


@dataclasses.dataclass(frozen=True)
class PipInstall:
    """One `pip install` of a RUN line (Dockerfile line `line`)."""

    line: int
    requirements: tuple[str, ...] = ()  # as packaging writes them, e.g. "numpy==2.1.*"
    files: tuple[str, ...] = ()  # -r / -c files, as the line names them (paths in the image)
    local: tuple[str, ...] = ()  # local projects it installs (".", "/app", "./pkg[extra]")
    indexes: tuple[str, ...] = ()  # index URLs it names
    pre: bool = False  # --pre: pre-releases too
    uv_projects: tuple[str, ...] = ()  # `uv sync` / `uv run`: the project folders it syncs


def allowed_indexes(text: str | None = None) -> tuple[str, ...]:
    """The index hosts a job may name (CAMPUGRID_PIP_INDEXES, space-separated)."""
    text = os.environ.get("CAMPUGRID_PIP_INDEXES") if text is None else text
    return tuple(text.split()) if text and text.strip() else DEFAULT_INDEXES


def requirement(text: str, at: str) -> str:
    """One requirement, checked and written as packaging writes it."""
    if "$" in text or "`" in text:
        raise InvalidInput(f"{at}: pip install {text}: a package chosen by a shell variable "
                           "cannot be fetched before the build; name it, or list it in the "
                           "spec's build.pip")
    try:
        req = Requirement(text)
    except InvalidRequirement as e:
        raise InvalidInput(f"{at}: {text!r} is not a requirement pip can read ({e})") from e
    if req.url:
        raise InvalidInput(f"{at}: {text}: requirements by URL cannot be fetched for an offline "
                           "build; name a version on the index, or put the wheel into the "
                           "context and install it from there")
    return str(req)


def check_index(url: str, at: str, allowed: Sequence[str] | None = None) -> str:
    allowed = tuple(allowed) if allowed is not None else allowed_indexes()
    parts = urlsplit(url)
    if parts.scheme != "https" or (parts.hostname or "") not in allowed:
        raise InvalidInput(f"{at}: index {url}: the build's packages come only from https "
                           f"indexes this platform allows ({', '.join(allowed)})")
    return url


def pip_installs(value: Sequence[str], json_form: bool, line: int) -> list[PipInstall]:
    """The `pip install` commands of one RUN instruction (its words as BuildKit parsed
    them), in order. Raises InvalidInput for what cannot be fetched before the build."""
    at = f"Dockerfile line {line}"
    return [found for words in simple_commands(value, json_form)
            if (found := _from_command(words, line, at)) is not None]


def _from_command(words: list[str], line: int, at: str) -> PipInstall | None:
    program = os.path.basename(words[0])
    rest = words[1:]
    if _PYTHON.match(program):
        while rest and rest[0].startswith("-") and rest[0] not in ("-m", "-mpip"):
            rest = rest[2:] if rest[0] in ("-W", "-X") else rest[1:]
        if rest[:1] == ["-mpip"]:
            rest = ["-m", "pip", *rest[1:]]
        if rest[:2] != ["-m", "pip"]:
            return None
        rest = rest[2:]
    elif program == "uv":
        project, rest = _uv_options(rest)
        if rest[:1] in (["sync"], ["run"]):
            project, _ = _uv_options(rest[1:], project)
            if rest[0] == "run" and "--no-sync" in rest:
                return None
            return PipInstall(line, uv_projects=(_local(project, at),))
        if rest[:1] != ["pip"]:
            return None
        rest = rest[1:]
    elif not _PIP.match(program):
        return None
    while rest and rest[0].startswith("-"):  # pip's own options before its command
        rest = rest[2:] if rest[0] in _VALUED else rest[1:]
    if program == "uv" and rest[:1] == ["sync"]:  # `uv pip sync reqs.txt`: files, by position
        files, args = [], rest[1:]
        while args:
            word, args = args[0], args[1:]
            if word.startswith("-"):
                args = args[1:] if "=" not in word and word in _VALUED else args
            else:
                files.append(_local(word, at))
        return PipInstall(line, files=tuple(files))
    if rest[:1] != ["install"]:
        return None
    return _install(rest[1:], line, at)


def _uv_options(words: list[str], project: str = ".") -> tuple[str, list[str]]:
    """uv's options before (or after) its command: the project folder that `--project` or
    `--directory` names (else `project`), and the words from the command on."""
    i = 0
    while i < len(words) and words[i].startswith("-"):
        name, eq, value = words[i].partition("=")
        if not eq and name in _UV_VALUED:
            value, i = (words[i + 1] if i + 1 < len(words) else ""), i + 1
        if name in ("--project", "--directory"):
            project = value
        i += 1
    return project, words[i:]


def _install(args: list[str], line: int, at: str) -> PipInstall:
    reqs, files, local, indexes = [], [], [], []
    pre = False
    i = 0
    while i < len(args):
        word = args[i]
        i += 1
        if word.startswith("-"):
            if word.startswith("--"):
                name, eq, value = word.partition("=")
                wants = not eq and name in _VALUED
            else:  # -r file, or -rfile: a short option and its value in one word
                name, value = word[:2], word[2:]
                wants = not value and name in _VALUED
            if wants:
                value, i = (args[i] if i < len(args) else ""), i + 1
            if name in ("-r", "--requirement", "-c", "--constraint"):
                files.append(value)
            elif name in ("-e", "--editable"):
                local.append(_local(value, at))
            elif name in ("-i", "--index-url", "--extra-index-url", "--index", "--extra-index"):
                indexes.append(check_index(value, at))
            elif name == "--pre":
                pre = True
            continue
        if _is_path(word) or "://" in word or word.startswith("git+"):
            if "@" in word.split("://")[0]:  # name @ URL: a requirement, refused as one
                reqs.append(requirement(word, at))
            else:
                local.append(_local(word, at))
        else:
            reqs.append(requirement(word, at))
    return PipInstall(line, tuple(reqs), tuple(files), tuple(local), tuple(indexes), pre)


def _is_path(word: str) -> bool:
    return word in (".", "..") or word.startswith(("./", "../", "/", "~", ".[")) \
        or word.endswith((".whl", ".tar.gz", ".zip"))


def _local(word: str, at: str) -> str:
    if "://" in word or word.startswith("git+"):
        raise InvalidInput(f"{at}: {word}: installing from version control or a URL cannot "
                           "work in an offline build; put the project into the context")
    if "$" in word or "`" in word:
        raise InvalidInput(f"{at}: {word}: a path chosen by a shell variable cannot be read "
                           "before the build")
    return word


# The agent's side: reading the declared files out of the unpacked context.

def read_requirements(path: Path, root: Path, at: str, depth: int = 0
                      ) -> tuple[list[str], list[str], list[str], bool]:
    """A requirement file in the context: its requirements (with any --hash options), the
    local projects it installs (-e), the index URLs it names, and whether it allows
    pre-releases. Nested -r / -c files are read relative to it, within the context."""
    if depth > MAX_FILE_DEPTH:
        raise InvalidInput(f"{at}: requirement files nest more than {MAX_FILE_DEPTH} deep")
    reqs: list[str] = []
    local: list[str] = []
    indexes: list[str] = []
    pre = False
    root = root.resolve()
    path = _inside(path, root, at)
    text = path.read_text(errors="replace")
    where = f"{at}: {path.relative_to(root)}"
    for raw in re.sub(r"\\\r?\n", " ", text).splitlines():
        entry = re.sub(r"(^|\s)#.*$", "", raw).strip()
        if not entry:
            continue
        words = shlex.split(entry, comments=False) if entry.startswith("-") \
            else [entry.split(" --", 1)[0].strip(), *re.findall(r"--hash[= ](\S+)", entry)]
        if not entry.startswith("-"):
            bad = [h for h in words[1:] if not _HASH.match(h)]
            if bad:
                raise InvalidInput(f"{where}: --hash={bad[0]}: a hash is sha256:<hex> (or "
                                   "sha384, sha512)")
            hashes = "".join(f" --hash={h}" for h in words[1:])
            reqs.append(requirement(words[0], where) + hashes)
            continue
        option, _, value = words[0].partition("=")
        if option[:2] in ("-r", "-c", "-e", "-i", "-f") and len(option) > 2 \
                and not option.startswith("--"):
            option, value = option[:2], option[2:]  # -rother.txt
        value = value or (words[1] if len(words) > 1 else "")
        if option in ("-r", "--requirement", "-c", "--constraint"):
            more = read_requirements(path.parent / value, root, at, depth + 1)
            reqs += more[0]
            local += more[1]
            indexes += more[2]
            pre = pre or more[3]
        elif option in ("-e", "--editable"):
            local.append(_local(value, where))
        elif option in ("-i", "--index-url", "--extra-index-url"):
            indexes.append(check_index(value, where))
        elif option == "--pre":
            pre = True
        if len(reqs) > MAX_REQUIREMENTS:
            raise InvalidInput(f"{where}: more than {MAX_REQUIREMENTS} requirements")
    return reqs, local, indexes, pre


def project_requirements(folder: Path, extras: Sequence[str], root: Path, at: str, *,
                         depends: bool = True) -> tuple[list[str], list[str]]:
    """A local project's requirements: what its build needs (its build-system.requires, or
    setuptools' defaults) and, with `depends`, what it depends on (with the extras asked
    for), from its pyproject.toml. Also a warning for dependencies it does not list
    statically."""
    root = root.resolve()
    project = _inside(folder, root, at)
    file = project / "pyproject.toml"
    data: dict[str, Any] = {}
    if file.is_file():
        try:
            data = tomllib.loads(_inside(file, root, at).read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise InvalidInput(f"{at}: {file.relative_to(root)} is not valid TOML ({e})") from e
    where = f"{at}: {file.relative_to(root)}"
    build = data.get("build-system") or {}
    needs: list[Any] = list(build.get("requires") or []) \
        if isinstance(build, dict) and "requires" in build else ["setuptools>=40.8.0", "wheel"]
    meta = data.get("project") or {}
    deps = list(meta.get("dependencies") or []) if isinstance(meta, dict) else []
    optional = (meta.get("optional-dependencies") or {}) if isinstance(meta, dict) else {}
    for extra in extras:
        deps += list(optional.get(extra) or []) if isinstance(optional, dict) else []
    warnings = []
    if not depends:
        deps = []
    elif not isinstance(meta, dict) or not meta or "dependencies" in (meta.get("dynamic") or []):
        warnings.append(f"{where}: the project's dependencies are not listed in "
                        "[project].dependencies; list any it needs in the spec's build.pip")
    reqs = [requirement(str(r), where) for r in [*needs, *deps]]
    return reqs, warnings


def locate(name: str, root: Path, *, project: bool = False) -> Path | None:
    """The context file a RUN line names by its path in the image (as COPY put it there):
    that path under the context, else with its leading folders dropped one by one. With
    `project`: the first such folder that is a Python project, else the context's top if it
    is one (`COPY . /src` then `pip install /src`)."""
    parts = [p for p in name.split("/") if p not in ("", ".")]
    candidates = [root.joinpath(*parts[start:]) for start in range(len(parts))]
    if not project:
        return next((c for c in candidates if c.exists()), None)
    markers = ("pyproject.toml", "setup.py", "setup.cfg")
    for candidate in [*candidates, root]:
        if candidate.is_dir() and any((candidate / m).is_file() for m in markers):
            return candidate
    return None


def split_extras(word: str) -> tuple[str, tuple[str, ...]]:
    """"./pkg[a,b]" -> ("./pkg", ("a", "b"))."""
    m = re.match(r"^(.*?)\[([^\]]*)\]$", word)
    if m is None:
        return word, ()
    return m[1], tuple(e.strip() for e in m[2].split(",") if e.strip())


def _inside(path: Path, root: Path, at: str) -> Path:
    real = path.resolve()
    if not real.is_relative_to(root.resolve()):
        raise InvalidInput(f"{at}: {path} lies outside the context")
    return real
