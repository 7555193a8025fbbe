"""What a job's Dockerfile may ask of a provider's builder, decided on the parsed file.

The file is read by BuildKit's own parser (the `dockerfile` package wraps its Go code), so
continuation lines, the `escape` directive and flags are split as a builder splits them, not
as a regular expression guesses. The words that decide where bytes come from — FROM's image,
`--from`, ADD/COPY sources — must be *plain* after the few variable forms we expand: no
quotes, no escape characters, no `$` left. A plain word reads the same to every Dockerfile
lexer (BuildKit's, Buildah's imagebuilder), so what we check is what the builder acts on.
Heredocs are refused: Buildah 1.28 reads their body lines as instructions.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Collection, Iterable, Sequence

import dockerfile

from campugrid.protocol.errors import InvalidInput

DEFAULT_BASES = ("localhost/campugrid/python:bookworm",)
BASES_ENV = "CAMPUGRID_ALLOWED_BASES"
# Registries a FROM may name an image on (resolved to a digest at submit, pulled by the
# agent outside the sandbox); "none" turns them all off.
DEFAULT_REGISTRIES = ("docker.io", "ghcr.io", "nvcr.io", "quay.io")
REGISTRIES_ENV = "CAMPUGRID_BASE_REGISTRIES"

_INSTRUCTIONS = {
    "FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME",
    "USER", "WORKDIR", "ARG", "STOPSIGNAL", "HEALTHCHECK", "SHELL", "MAINTAINER",
}
_SPECIAL = re.compile(r"""['"\\`$\s]""")  # what any lexer may read differently
_SPECIAL_IN_JSON = re.compile(r"""['"\\`$]""")  # JSON form: spaces are part of the word
_STAGE_NAME = re.compile(r"^[a-z][a-z0-9._-]*$")
_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
# $NAME, ${NAME}, ${NAME:-word}, ${NAME-word}, ${NAME:+word}, ${NAME+word}: nothing else.
_VAR = re.compile(r"\$(?:(?P<bare>" + _NAME + r")|\{(?P<name>" + _NAME +
                  r")(?:(?P<op>:?[-+])(?P<word>[^${}'\"\\`\s]*))?\})")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_URLISH = re.compile(r"^[a-z][a-z0-9+.-]*://|^git@", re.IGNORECASE)
_WEB = re.compile(r"^https?://", re.IGNORECASE)  # what ADD may fetch (through the egress proxy)
_COPY_FLAGS = ("--chown", "--chmod", "--link")
# distribution/reference's grammar: a registry host[:port], lowercase path components, a tag.
_LABEL = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?"
_DOMAIN = re.compile(rf"^{_LABEL}(?:\.{_LABEL})*(?::[0-9]+)?$")
_COMPONENT = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_IMAGE_ID = re.compile(r"^[0-9a-f]{12,64}$")  # a builder may take it for a local image's id


@dataclasses.dataclass(frozen=True)
class ImageRef:
    """An image on a registry, spelled one way: `python:3.11` and `docker.io/library/python:3.11`
    and `index.docker.io/library/python:3.11` are the same ImageRef."""

    registry: str
    repository: str
    tag: str
    digest: str | None = None

    @property
    def name(self) -> str:
        return f"{self.registry}/{self.repository}"

    def __str__(self) -> str:
        return f"{self.name}:{self.tag}" + (f"@{self.digest}" if self.digest else "")


def parse_image_ref(text: str) -> ImageRef:
    """Normalize an image reference as Docker does; ValueError for anything else."""
    rest, _, digest = text.partition("@")
    if digest and not _DIGEST.match(digest):
        raise ValueError("a pinned digest is sha256:<64 hex digits>")
    slash = rest.rfind("/")
    name, colon, tag = rest.rpartition(":") if rest.rfind(":") > slash else (rest, "", "")
    if colon and not _TAG.match(tag):
        raise ValueError(f"tag {tag!r}: letters, digits, '_', '.' and '-', at most 128")
    first, sep, path = name.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        registry = first.lower()
        if not _DOMAIN.match(registry):
            raise ValueError(f"registry {first!r} is not a host name")
    else:
        registry, path = "docker.io", name
    if registry == "index.docker.io":
        registry = "docker.io"
    if registry == "docker.io" and "/" not in path:
        path = f"library/{path}"
    if not path or not all(_COMPONENT.match(c) for c in path.split("/")):
        raise ValueError(f"repository {path!r}: lowercase letters, digits and separators")
    return ImageRef(registry, path, tag or "latest", digest or None)


def base_registries(text: str | None = None) -> tuple[str, ...]:
    """The registries a FROM may pull from: comma- or space-separated, from
    CAMPUGRID_BASE_REGISTRIES; "none" for none."""
    text = os.environ.get(REGISTRIES_ENV, "") if text is None else text
    words = [w.lower() for w in re.split(r"[,\s]+", text) if w] or list(DEFAULT_REGISTRIES)
    if words == ["none"]:
        return ()
    for w in words:
        if not _DOMAIN.match(w):
            raise ValueError(f"base registry {w!r}: give a host name, optionally with :port")
    return tuple("docker.io" if w == "index.docker.io" else w for w in words)


@dataclasses.dataclass(frozen=True)
class AllowedBase:
    """A base image a build may start from: its name, and the digest it must have if pinned."""

    name: str
    digest: str | None = None

    @classmethod
    def parse(cls, text: str) -> AllowedBase:
        name, _, digest = text.strip().partition("@")
        if not name or _SPECIAL.search(name) or (digest and not _DIGEST.match(digest)):
            raise ValueError(f"allowed base {text!r}: give NAME:TAG or NAME:TAG@sha256:<64 hex>")
        return cls(name, digest or None)

    def __str__(self) -> str:
        return f"{self.name}@{self.digest}" if self.digest else self.name


def allowed_bases(text: str | None = None) -> tuple[AllowedBase, ...]:
    """The configured bases: comma- or space-separated, from CAMPUGRID_ALLOWED_BASES."""
    text = os.environ.get(BASES_ENV, "") if text is None else text
    words = [w for w in re.split(r"[,\s]+", text) if w] or list(DEFAULT_BASES)
    return tuple(AllowedBase.parse(w) for w in words)


@dataclasses.dataclass(frozen=True)
class BaseUse:
    """One FROM that starts from an image (not an earlier stage), or one COPY --from that
    copies out of one (`copy`): what the builder must find. `remote`: an image on an allowed
    registry (`allowed.name` its normalized name and tag), which the coordinator resolves to
    a digest and the agent pulls; else one of the provider's allowed bases."""

    line: int
    allowed: AllowedBase
    digest: str | None  # the digest the line pins, if it does
    remote: bool = False
    end_line: int = 0  # the instruction's last line (it may continue over several)
    stage: str | None = None  # its AS name
    copy: bool = False  # `COPY --from=<image>` (uv's Docker guide copies its binary so)

    @property
    def said(self) -> str:
        """How the Dockerfile names it: `FROM image` or `COPY --from=image`."""
        return f"COPY --from={self.allowed.name}" if self.copy else f"FROM {self.allowed.name}"


@dataclasses.dataclass(frozen=True)
class CheckedDockerfile:
    stages: int
    bases: tuple[BaseUse, ...]
    froms: tuple[tuple[int, int], ...] = ()  # every FROM's first and last line
    urls: tuple[str, ...] = ()  # what its ADD lines fetch (through the egress proxy)
    # (line, path) of what its COPY and ADD lines take from the context, as written there
    sources: tuple[tuple[int, str], ...] = ()
    # Whether the image says what to run (CMD or ENTRYPOINT in its last stage, or in the
    # earlier stage that one builds on): else only its base's default, or nothing.
    runs: bool = True


@dataclasses.dataclass
class _Stage:
    index: int
    name: str | None
    vars: dict[str, str | None]  # None: declared, but with no value we can know
    base: int | None = None  # index in the check's bases of the image it builds on
    runs: bool = False  # it has a CMD or ENTRYPOINT (or the earlier stage it builds on has)


def check_dockerfile(text: str, allowed: Sequence[AllowedBase] | None = None,
                     registries: Sequence[str] | None = None) -> CheckedDockerfile:
    """Refuse, naming the line, anything a provider must not build; say what it builds on:
    allowed bases, or images on the allowed `registries`."""
    allowed = tuple(allowed) if allowed is not None else allowed_bases()
    registries = tuple(registries) if registries is not None else base_registries()
    try:
        commands = dockerfile.parse_string(text)
    except dockerfile.GoParseError as e:
        if "no instructions" in str(e):
            raise InvalidInput("Dockerfile: no FROM instruction (the file has no instructions)") from e
        raise InvalidInput(f"Dockerfile: {e}") from e
    global_args: dict[str, str | None] = {}
    stages: list[_Stage] = []
    bases: list[BaseUse] = []
    urls: list[str] = []
    sources: list[tuple[int, str]] = []
    froms: list[tuple[int, int]] = []
    names = {str(c.value[2]).lower() for c in commands
             if c.cmd.upper() == "FROM" and len(c.value) == 3 and c.value[1].upper() == "AS"}
    for cmd in commands:
        inst, line = cmd.cmd.upper(), cmd.start_line
        at = f"Dockerfile line {line}"
        if cmd.heredocs or any(v.startswith("<<") for v in cmd.value if not cmd.json):
            raise InvalidInput(f"{at}: heredocs (<<EOF) are not available: providers' Buildah "
                               "reads their lines as instructions; put the script into the "
                               "context and COPY it")
        if inst == "ONBUILD":
            raise InvalidInput(f"{at}: ONBUILD is not available (job images are never bases)")
        if inst not in _INSTRUCTIONS:
            raise InvalidInput(f"{at}: unknown instruction {cmd.cmd!r}")
        if inst == "FROM":
            froms.append((line, max(cmd.end_line, line)))
            stage, use = _from(cmd, stages, global_args, allowed, registries, at)
            if use is not None:
                stage.base = len(bases)
                bases.append(use)
            stages.append(stage)
            continue
        if not stages:
            if inst != "ARG":
                raise InvalidInput(f"{at}: {inst} before the first FROM")
            _declare(cmd, global_args, global_args, at)
            continue
        stage = stages[-1]
        if inst == "ARG":
            _declare(cmd, stage.vars, global_args, at)
        elif inst == "ENV":
            _env(cmd, stage.vars)
        elif inst == "RUN":
            _run_flags(cmd.flags, at)
        elif inst in ("ADD", "COPY"):
            copied = _copy(cmd, inst, stage, stages, names, allowed, registries, at, urls,
                           sources)
            if copied is not None:
                bases.append(copied)
        elif inst in ("CMD", "ENTRYPOINT"):
            stage.runs = True
    if not stages:
        raise InvalidInput("Dockerfile: no FROM instruction")
    return CheckedDockerfile(stages=len(stages), bases=tuple(bases), froms=tuple(froms),
                             urls=tuple(urls), sources=tuple(sources), runs=stages[-1].runs)


def _from(cmd: dockerfile.Command, stages: list[_Stage], global_args: dict[str, str | None],
          allowed: Sequence[AllowedBase], registries: Sequence[str],
          at: str) -> tuple[_Stage, BaseUse | None]:
    for flag in cmd.flags:
        if not flag.lower().startswith("--platform="):
            raise InvalidInput(f"{at}: FROM {flag} is not available")
    words = list(cmd.value)
    name: str | None = None
    if len(words) == 3 and words[1].upper() == "AS":
        name = words[2].lower()
        if not _STAGE_NAME.match(name):
            raise InvalidInput(f"{at}: stage name {words[2]!r}: use letters, digits, '.', '_' "
                               "and '-', starting with a letter")
        words = words[:1]
    if len(words) != 1:
        raise InvalidInput(f"{at}: FROM takes one image (and optionally AS name)")
    ref = _plain(words[0], global_args, at, "FROM")
    index = len(stages)
    for earlier in stages:
        if earlier.name is not None and earlier.name == ref.lower():
            return _Stage(index, name, dict(earlier.vars), earlier.base,  # ENV too
                          earlier.runs), None
    if ref == "scratch":
        return _Stage(index, name, {}), None
    use = _image(ref, allowed, registries, at, "FROM")
    return _Stage(index, name, {}), dataclasses.replace(
        use, line=cmd.start_line, end_line=cmd.end_line, stage=name)


def _image(ref: str, allowed: Sequence[AllowedBase], registries: Sequence[str], at: str,
           what: str) -> BaseUse:
    """The image `ref` names (`what`: the instruction naming it): one of the provider's
    allowed bases, or an image on an allowed registry."""
    image, _, digest = ref.partition("@")
    if digest and not _DIGEST.match(digest):
        raise InvalidInput(f"{at}: {what} {ref}: a pinned digest is sha256:<64 hex digits>")
    for base in allowed:
        if base.name == image:
            if base.digest and digest and digest != base.digest:
                raise InvalidInput(f"{at}: {what} {ref}: this provider pins {base.name} to "
                                   f"{base.digest}")
            return BaseUse(0, base, digest or None)
    names = ", ".join(str(b) for b in allowed)
    if _IMAGE_ID.match(image):
        raise InvalidInput(f"{at}: {what} {ref}: not an allowed base image (that is an image "
                           f"id: name the image instead; allowed: {names}, or an image on an "
                           "allowed registry)")
    try:
        remote = parse_image_ref(ref)
    except ValueError as e:
        raise InvalidInput(f"{at}: {what} {ref}: {e}") from e
    if remote.registry not in registries:
        where = f"images on {', '.join(registries)}" if registries else "no registries"
        raise InvalidInput(f"{at}: {what} {ref}: not an allowed base image ({remote.registry} "
                           f"is not an allowed registry; allowed: {names}, {where}, or an "
                           "earlier stage of this file)")
    return BaseUse(0, AllowedBase(f"{remote.name}:{remote.tag}"), remote.digest, remote=True)


def pin_bases(text: str, local: dict[BaseUse, str], froms: Sequence[tuple[int, int]] = (),
              run_args: Sequence[tuple[str, str]] = ()) -> str:
    """The Dockerfile with each FROM of `local` (BaseUses check_dockerfile found in this
    text) starting from that local image instead: its whole instruction's lines replaced
    (its AS name kept); after every FROM of `froms` (check_dockerfile's), an `ARG NAME=value`
    line for each of `run_args` (what every RUN step of the stage then sees, and the image
    does not keep); every other line as it was. Lines
    only, no parsing: the agent parses a job's Dockerfile only in a confined child."""
    lines = text.split("\n")  # as BuildKit counts them (not str.splitlines' other breaks)
    pinned = {use.line: use for use in local}
    args = {start: [f"ARG {name}={value}" for name, value in run_args] for start, _ in froms}
    spans = {start: end for start, end in froms if args[start]}
    spans |= {use.line: max(use.end_line, use.line) for use in local}
    for start in sorted(spans, reverse=True):
        use = pinned.get(start)
        if use is not None and use.copy:  # only its --from flag changes
            flag = f"--from={local[use]}".replace("\\", "\\\\")
            for n in range(start - 1, spans[start]):  # flags come first: the first is it
                lines[n], found = re.subn(r"(?i)--from=\S+", flag, lines[n], count=1)
                if found:
                    break
            continue
        head = lines[start - 1:spans[start]] if use is None else \
            [f"FROM {local[use]}" + (f" AS {use.stage}" if use.stage else "")]
        lines[start - 1:spans[start]] = head + args.get(start, [])
    return "\n".join(lines)


def _declare(cmd: dockerfile.Command, into: dict[str, str | None],
             global_args: dict[str, str | None], at: str) -> None:
    for word in cmd.value:
        name, eq, default = word.partition("=")
        if not re.fullmatch(_NAME, name):
            raise InvalidInput(f"{at}: ARG {word!r}: not a variable name")
        if eq:
            into[name] = _expand(default, into)
        else:
            into[name] = global_args.get(name)  # no build arguments are passed: no value


def _env(cmd: dockerfile.Command, into: dict[str, str | None]) -> None:
    values = list(cmd.value)
    for name, value in zip(values[::2], values[1::2], strict=False):
        into[name] = _expand(value, into)


def _run_flags(flags: Iterable[str], at: str) -> None:
    for flag in flags:
        low = flag.lower()
        if low in ("--network=none", "--network=default"):
            continue
        if low.startswith("--network"):
            raise InvalidInput(f"{at}: RUN {flag}: RUN steps reach package registries "
                               "through the platform's egress proxy, and nothing else")
        if low.startswith("--mount"):
            raise InvalidInput(f"{at}: RUN --mount is not available on providers (bind, cache, "
                               "secret and ssh mounts all reach outside the build)")
        raise InvalidInput(f"{at}: RUN {flag} is not available")


def _copy(cmd: dockerfile.Command, inst: str, stage: _Stage, stages: list[_Stage],
          names: Collection[str], allowed: Sequence[AllowedBase], registries: Sequence[str],
          at: str, urls: list[str], sources: list[tuple[int, str]]) -> BaseUse | None:
    """Checks an ADD or COPY; the image it copies from, where `--from` names one. What it
    takes from the context goes into `sources`."""
    use = None
    outside = False  # --from: its sources are in a stage or an image, not the context
    for flag in cmd.flags:
        key, _, value = flag.partition("=")
        key = key.lower()
        if key == "--from":
            outside = True
            ref = _plain(value, stage.vars, at, f"{inst} --from")
            if not _earlier_stage(ref, stage, stages, names, at, inst):
                if inst != "COPY":
                    raise InvalidInput(f"{at}: ADD --from is not available")
                use = dataclasses.replace(_image(ref, allowed, registries, at, "COPY --from"),
                                          line=cmd.start_line, end_line=cmd.end_line, copy=True)
        elif key not in _COPY_FLAGS:
            raise InvalidInput(f"{at}: {inst} {flag} is not available")
    words = list(cmd.value)[:-1]
    if not words:
        raise InvalidInput(f"{at}: {inst} needs a source and a destination")
    for src in words:
        word = _plain(src, stage.vars, at, inst, json_form=cmd.json)
        if inst == "ADD" and _WEB.match(word):
            urls.append(word)  # fetched by Buildah through the egress proxy, as RUN steps are
        elif _URLISH.match(word) or "://" in word:
            raise InvalidInput(f"{at}: {inst} {word}: " + (
                "ADD fetches http:// and https:// URLs only" if inst == "ADD" else
                "COPY takes files from the context (ADD fetches an https:// URL)"))
        elif not outside:
            sources.append((cmd.start_line, word))
    return use


def _earlier_stage(ref: str, stage: _Stage, stages: list[_Stage], names: Collection[str],
                   at: str, inst: str) -> bool:
    """Whether `--from` names an earlier stage of this file, by name or index (else an
    image); refused where it names this stage or a later one."""
    if any(s.name == ref.lower() for s in stages[:stage.index]) or \
            (ref.isdigit() and int(ref) < stage.index):
        return True
    if ref.isdigit() or ref.lower() in names:
        raise InvalidInput(f"{at}: {inst} --from={ref}: names this stage or a later one; "
                           "--from copies from an earlier stage of this Dockerfile or an image")
    return False


def _plain(word: str, scope: dict[str, str | None], at: str, what: str,
           json_form: bool = False) -> str:
    special = _SPECIAL_IN_JSON if json_form else _SPECIAL
    expanded = _expand(word, scope, special)
    if expanded is None or special.search(expanded):
        raise InvalidInput(
            f"{at}: {what} {word!r}: write it as a plain word (no quotes or escapes; "
            "variables only as $NAME, ${NAME} or ${NAME:-default}, declared with a value "
            "earlier in this file)")
    return expanded


def _expand(word: str, scope: dict[str, str | None],
            special: re.Pattern[str] = _SPECIAL) -> str | None:
    """`word` with the simple variable forms replaced; None where a value cannot be known
    here or the word uses anything else (quotes, escapes, other `$` forms)."""
    failed = False

    def value(m: re.Match[str]) -> str:
        nonlocal failed
        name = m.group("bare") or m.group("name")
        if name not in scope or scope[name] is None:
            failed = True
            return ""
        current = scope[name] or ""
        op, alt = m.group("op"), m.group("word") or ""
        if op in (":-", "-"):
            return current if current else alt
        if op in (":+", "+"):
            return alt if current else ""
        return current

    out = _VAR.sub(value, word)
    if failed or special.search(out):
        return None
    return out
