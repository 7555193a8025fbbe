"""What a Dockerfile's RUN steps install with apt, known before the build.

RUN steps have no network, so the agent fetches a job's Debian packages beforehand, outside
the sandbox, into a local repository that the build's apt sees as its only source
(agent/debs.py). What to fetch is declared: the packages named on `apt-get install` and
`apt install` lines (read here, in the confined Dockerfile check) and the spec's `build.apt`;
a line that upgrades (`apt-get upgrade`, `dist-upgrade`) has the base's upgrades fetched too.

As with pip (pipwords.py) this is a declaration, not a guard: a package the declaration
missed is not in the local repository, and the build fails naming it. Refused here is what
could never be fetched beforehand: a package chosen by a shell variable, a word that is not a
package name.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence

from campugrid.protocol.errors import InvalidInput
from campugrid.protocol.shellwords import simple_commands

MAX_PACKAGES = 500
# name[:arch][=version | /release], as apt-get install takes them (Debian policy 5.6.1, 5.6.12)
_PACKAGE = re.compile(r"^[a-z0-9][a-z0-9+.-]+(:[a-z0-9-]+)?(=[A-Za-z0-9.+:~_-]+|/[a-z0-9.-]+)?$")
_APT = {"apt-get", "apt"}
# apt-get options followed by a value (as a separate word)
_VALUED = {"-o", "--option", "-c", "--config-file", "-t", "--target-release",
           "--default-release", "-a", "--host-architecture", "-P", "--build-profiles"}
_INSTALLS = {"install", "reinstall"}
_UPGRADES = {"upgrade", "dist-upgrade", "full-upgrade"}


@dataclasses.dataclass(frozen=True)
class AptInstall:
    """One `apt-get install` (or upgrade) of a RUN line (Dockerfile line `line`), in the
    Dockerfile's stage `stage` (0 for the first FROM)."""

    line: int
    packages: tuple[str, ...] = ()  # as the line names them: "libgl1", "jq=1.6-2.1"
    recommends: bool = True  # False with --no-install-recommends (apt's default is True)
    upgrade: bool = False  # the line upgrades the base's packages
    local: tuple[str, ...] = ()  # .deb files in the image it installs (not fetched)
    stage: int = 0


def package(word: str, at: str) -> str:
    """One package as apt-get install takes it, checked."""
    if "$" in word or "`" in word:
        raise InvalidInput(f"{at}: apt-get install {word}: a package chosen by a shell variable "
                           "cannot be fetched before the build; name it, or list it in the "
                           "spec's build.apt")
    if not _PACKAGE.match(word):
        raise InvalidInput(f"{at}: {word!r} is not a Debian package name (lower-case letters, "
                           "digits, '+', '-', '.', optionally :arch and =version or /release)")
    return word


def apt_installs(value: Sequence[str], json_form: bool, line: int) -> list[AptInstall]:
    """The apt installs and upgrades of one RUN instruction, in order. Raises InvalidInput
    for what cannot be fetched before the build."""
    at = f"Dockerfile line {line}"
    found = []
    for words in simple_commands(value, json_form):
        if os.path.basename(words[0]) not in _APT:
            continue
        options, args = _options(words[1:])
        if args[:1] and args[0] in _UPGRADES:
            found.append(AptInstall(line, upgrade=True))
        elif args[:1] and args[0] in _INSTALLS:
            names = args[1:]
            local = tuple(w for w in names if w.startswith(("/", "./", "../")) or
                          w.endswith(".deb"))
            packages = tuple(package(w, at) for w in names if w not in local)
            if len(packages) > MAX_PACKAGES:
                raise InvalidInput(f"{at}: more than {MAX_PACKAGES} packages on one line")
            recommends = "--no-install-recommends" not in options and not any(
                o.replace(" ", "").lower() in ("apt::install-recommends=false",
                                               "apt::install-recommends=0") for o in options)
            found.append(AptInstall(line, packages, recommends, local=local))
    return found


def _options(words: list[str]) -> tuple[list[str], list[str]]:
    """apt-get's options, with "-o X=Y" as "X=Y", and the other words (command, packages)."""
    options: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if not word.startswith("-") or word == "-":
            rest.append(word)
        elif word in _VALUED:
            value, i = (words[i] if i < len(words) else ""), i + 1
            options.append(value if word in ("-o", "--option") else word)
        elif word.startswith("--option="):
            options.append(word.partition("=")[2])
        elif word.startswith("-o") and len(word) > 2:
            options.append(word[2:])
        else:
            options.append(word)
    return options, rest
