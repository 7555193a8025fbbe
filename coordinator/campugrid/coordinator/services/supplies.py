"""What a machine is given with a lease to fetch its task's inputs with: the platform's
package caches and egress proxy (each with a token for this machine), and where to pull each
of the job's base images from (mirrors first, each with a pull token)."""

from __future__ import annotations

import dataclasses

from campugrid.buildpolicy.dockerfiles import parse_image_ref
from campugrid.coordinator.bases import BaseResolver
from campugrid.coordinator.config import Settings
from campugrid.coordinator.mirrors import PREFIX as MIRRORS_PREFIX
from campugrid.coordinator.mirrors import MirrorTokens


@dataclasses.dataclass(frozen=True)
class MirrorGrant:
    kind: str  # "pypi", "apt" or "egress"
    url: str
    token: str
    certificate: str  # the PEM to trust, where it serves TLS with our own certificate


@dataclasses.dataclass(frozen=True)
class BaseSource:
    address: str
    insecure: bool
    token: str


@dataclasses.dataclass(frozen=True)
class BaseGrant:
    ref: str
    digest: str
    sources: tuple[BaseSource, ...]


class Supplies:
    """`rest_url`: where this coordinator's package caches are served (REST, under
    /v1/mirrors); `rest_pem`: its certificate when REST speaks TLS; `egress_url`: its egress
    proxy for builds, if it runs one."""

    def __init__(self, settings: Settings, bases: BaseResolver, *, rest_url: str = "",
                 rest_pem: str = "", egress_url: str = "") -> None:
        self.kinds = [kind for kind, on in (("pypi", settings.pip_mirror_dir),
                                            ("apt", settings.apt_cache)) if on and rest_url]
        self.url = rest_url.rstrip("/") + MIRRORS_PREFIX
        self.egress_url = egress_url
        self.tokens = MirrorTokens(settings.registry_dir) if self.kinds or egress_url else None
        self.pem = rest_pem
        self.resolver = bases

    def mirrors(self, machine: str) -> list[MirrorGrant]:
        """The package caches and the egress proxy, with a token for this machine
        (coordinator/mirrors.py)."""
        if self.tokens is None:
            return []
        token = self.tokens.mint(machine)
        pem = self.pem if self.url.startswith("https:") else ""
        egress = [MirrorGrant("egress", self.egress_url, token,
                              self.pem if self.egress_url.startswith("https:") else "")
                  ] if self.egress_url else []
        return [*(MirrorGrant(kind, f"{self.url}/{kind}", token, pem) for kind in self.kinds),
                *egress]

    def bases(self, bases: dict[str, str], machine: str) -> list[BaseGrant]:
        """The job's remote bases, each with where to pull it from (mirrors first)."""
        out = []
        for ref, digest in bases.items():
            parsed = parse_image_ref(ref)
            out.append(BaseGrant(ref, digest, tuple(
                BaseSource(s.address, s.insecure,
                           self.resolver.token(s, parsed.repository, f"machine:{machine}"))
                for s in self.resolver.sources(parsed.registry))))
        return out
