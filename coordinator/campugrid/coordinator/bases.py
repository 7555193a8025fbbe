"""Base images from registries: a FROM that names an image on an allowed registry is
resolved to a manifest digest when the job is submitted, so that every machine builds on the
same bytes and the job's record says which. Agents then pull that digest (agent/bases.py),
from the registry's mirrors first.

    CAMPUGRID_BASE_REGISTRIES   which registries a FROM may name (buildpolicy/dockerfiles.py)
    CAMPUGRID_REGISTRY_MIRRORS  "docker.io=http://127.0.0.1:5001 ghcr.io=https://m.example"

A mirror is any OCI registry serving the same repositories (a pull-through cache such as
`docker-registry` with `proxy.remoteurl`, which `campugrid up` starts for Docker Hub, or one
an operator fills); plain HTTP only on a loopback address. Mirrors are asked with a pull
token of the coordinator's for the one repository (the embedded one trusts nothing else; a
mirror without authentication ignores it); the registries themselves anonymously.
Resolution asks each mirror, then the registry, with skopeo, and names the digest of the
manifest bytes it got (for a multi-platform image, its index: each machine then pulls its
own platform's image from it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Sequence

from campugrid.buildpolicy.dockerfiles import BaseUse, parse_image_ref
from campugrid.coordinator.registry import RegistryTokens, is_loopback
from campugrid.protocol.errors import InvalidInput

MIRRORS_ENV = "CAMPUGRID_REGISTRY_MIRRORS"
RESOLVE_TIMEOUT_S = 60
REMEMBER_S = 60.0  # a sweep submitted together resolves a tag once, and to one digest


@dataclasses.dataclass(frozen=True)
class Source:
    """Where an image of a registry can be pulled from: host[:port], whether over HTTP, and
    whether it is a mirror (asked with the coordinator's tokens)."""

    address: str
    insecure: bool = False
    mirror: bool = False


def parse_mirrors(text: str) -> tuple[tuple[str, Source], ...]:
    """`registry=URL` pairs, comma- or space-separated, in the order they are tried."""
    out = []
    for word in (w for w in re.split(r"[,\s]+", text) if w):
        registry, eq, url = word.partition("=")
        scheme, sep, address = url.partition("://")
        address = address.rstrip("/")
        if not eq or not sep or scheme not in ("http", "https") or not address or "/" in address:
            raise ValueError(f"{MIRRORS_ENV}: {word!r}: give REGISTRY=https://HOST[:PORT]")
        if scheme == "http" and not is_loopback(address):
            raise ValueError(f"{MIRRORS_ENV}: {word!r}: plain http only on a loopback address")
        out.append((registry.lower(), Source(address, insecure=scheme == "http", mirror=True)))
    return tuple(out)


class BaseResolver:
    """Tags to digests, through the mirrors, then the registry."""

    def __init__(self, mirrors: Sequence[tuple[str, Source]] = (),
                 tokens: RegistryTokens | None = None, skopeo: str = "skopeo") -> None:
        self.mirrors, self.tokens = tuple(mirrors), tokens
        self.skopeo = shutil.which(skopeo)
        self._known: dict[str, tuple[float, str]] = {}
        self._lock = threading.Lock()

    def sources(self, registry: str) -> list[Source]:
        return [s for r, s in self.mirrors if r == registry] + [Source(registry)]

    def token(self, source: Source, repository: str, subject: str) -> str:
        """What `subject` shows `source` to pull `repository`: a token for a mirror, else
        nothing (registries are asked anonymously)."""
        if not source.mirror or self.tokens is None:
            return ""
        return self.tokens.mint(subject, repository, ("pull",))

    def resolve_all(self, bases: Sequence[BaseUse]) -> dict[str, str]:
        """Each remote base's name:tag -> the manifest digest it is now (or its pinned one,
        once a registry has it); InvalidInput naming the line if one cannot be resolved."""
        return {u.allowed.name: self.resolve(u) for u in bases if u.remote}

    def resolve(self, use: BaseUse) -> str:
        key = f"{use.allowed.name}@{use.digest or ''}"
        with self._lock:
            known = self._known.get(key)
            if known is not None and time.monotonic() - known[0] < REMEMBER_S:
                return known[1]
        ref = parse_image_ref(use.allowed.name)
        errors = []
        for source in self.sources(ref.registry):
            try:
                digest = self._ask(source, ref.repository, use.digest or ref.tag,
                                   self.token(source, ref.repository, "coordinator"))
            except _Unanswered as e:
                errors.append(f"{source.address}: {e}")
                continue
            with self._lock:
                now = time.monotonic()
                if len(self._known) > 1000:  # only the last minute's are worth keeping
                    self._known = {k: v for k, v in self._known.items()
                                   if now - v[0] < REMEMBER_S}
                self._known[key] = (now, digest)
            return digest
        raise InvalidInput(f"Dockerfile line {use.line}: {use.said}: cannot be "
                           f"resolved to a digest ({'; '.join(errors)})"[:2000])

    def _ask(self, source: Source, repository: str, tag_or_digest: str, token: str) -> str:
        if self.skopeo is None:
            raise _Unanswered("skopeo is not installed here (infra/setup.sh installs it)")
        at = "@" if tag_or_digest.startswith("sha256:") else ":"
        try:
            done = subprocess.run(
                [self.skopeo, "inspect", "--raw",
                 *(["--registry-token", token] if token else ["--no-creds"]),
                 *(["--tls-verify=false"] if source.insecure else []),
                 f"docker://{source.address}/{repository}{at}{tag_or_digest}"],
                capture_output=True, timeout=RESOLVE_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired as e:
            raise _Unanswered(f"no answer in {RESOLVE_TIMEOUT_S} s") from e
        if done.returncode != 0:
            lines = done.stderr.decode("utf-8", "replace").strip().splitlines()
            raise _Unanswered((lines[-1] if lines else "failed")[-300:])
        try:
            manifest = json.loads(done.stdout)
        except ValueError as e:
            raise _Unanswered("the answer is not a manifest") from e
        if not isinstance(manifest, dict) or manifest.get("schemaVersion") != 2:
            raise _Unanswered("not an OCI or Docker schema 2 manifest")
        digest = f"sha256:{hashlib.sha256(done.stdout).hexdigest()}"
        if at == "@" and digest != tag_or_digest:
            raise _Unanswered(f"answered {digest} for {tag_or_digest}")
        return digest


class _Unanswered(Exception):
    pass
