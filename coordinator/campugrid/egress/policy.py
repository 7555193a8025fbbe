"""Where a build may connect: hosts on the operator's list, on ports 80 and 443, at public
addresses only. The proxy resolves each name itself and connects to an address it checked, so
an allowed name that resolves to loopback, a private range or a metadata address is refused
as the address itself would be; a name the operator pins (`name:port=address:port`) goes
there whatever it is, on the operator's word (a local artifact server, a test's stand-in), and an
allowed name may resolve into the operator's gateway networks (CAMPUGRID_EGRESS_GATEWAYS)."""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import socket
from collections.abc import Mapping

HOSTS_ENV = "CAMPUGRID_EGRESS_HOSTS"
PINS_ENV = "CAMPUGRID_EGRESS_PINS"
# Networks the operator's own gateway answers from for allowed names, private or not (a
# network whose DNS sends every registry to one filtering gateway), e.g. "203.0.113.80/32".
GATEWAYS_ENV = "CAMPUGRID_EGRESS_GATEWAYS"
# Certificates a build trusts besides its image's own (a machine whose TLS is intercepted, a
# stand-in with a certificate of its own): a PEM bundle, given to Buildah and to RUN steps.
CA_ENV = "CAMPUGRID_BUILD_CA_FILE"
# The distributions' own mirrors: what the platform's apt cache serves (coordinator/mirrors.py)
# and the agent's proxy sends it (agent/buildnet.py).
APT_HOSTS = ("deb.debian.org", "security.debian.org", "archive.ubuntu.com",
             "security.ubuntu.com", "ports.ubuntu.com")
# Package registries researchers' Dockerfiles use. `*.name` is any name under it.
DEFAULT_HOSTS = (
    "pypi.org", "files.pythonhosted.org",  # PyPI and its file host
    "download.pytorch.org", "pypi.nvidia.com", "developer.download.nvidia.com",
    *APT_HOSTS,
    "conda.anaconda.org", "repo.anaconda.com", "micro.mamba.pm",
    "github.com", "codeload.github.com", "raw.githubusercontent.com",
    "objects.githubusercontent.com", "release-assets.githubusercontent.com",
)
PORTS = (80, 443)
_NAME = re.compile(r"^(?:\*\.)?(?:[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?\.)*"
                   r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")


class Refused(Exception):
    """A connection the proxy does not make; str() says why, for the build log. `status`:
    the HTTP answer (403, or 407 for a missing or bad token)."""

    def __init__(self, why: str, status: int = 403) -> None:
        super().__init__(why)
        self.status = status


@dataclasses.dataclass(frozen=True)
class Policy:
    hosts: tuple[str, ...] = DEFAULT_HOSTS
    pins: Mapping[tuple[str, int], tuple[str, int]] = dataclasses.field(default_factory=dict)
    gateways: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Policy:
        env = os.environ if env is None else env
        hosts = tuple(w.lower() for w in re.split(r"[,\s]+", env.get(HOSTS_ENV, "")) if w)
        for h in hosts:
            if not _NAME.match(h):
                raise ValueError(f"{HOSTS_ENV}: {h!r} is not a host name (or *.name)")
        try:
            gateways = tuple(ipaddress.ip_network(w) for w in
                             re.split(r"[,\s]+", env.get(GATEWAYS_ENV, "")) if w)
        except ValueError as e:
            raise ValueError(f"{GATEWAYS_ENV}: {e}") from None
        return cls(hosts or DEFAULT_HOSTS, parse_pins(env.get(PINS_ENV, "")), gateways)

    def allows(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        return any(host == h or (h.startswith("*.") and host.endswith(h[1:]))
                   for h in self.hosts)

    def target(self, host: str, port: int) -> str:
        """The host, lowercased, if the policy lets a build ask for it at all (before any
        address is known); raises Refused."""
        name = host.lower().rstrip(".")
        if (name, port) in self.pins:
            return name
        if _literal(name) is not None:
            raise Refused("an address, not a name: builds reach registries by name")
        if port not in PORTS:
            raise Refused(f"port {port}: builds connect on ports 80 and 443 only")
        if not self.allows(name):
            raise Refused(f"{name} is not on this platform's list of package registries "
                          f"({HOSTS_ENV})")
        return name

    def addresses(self, host: str, port: int) -> list[tuple[str, int]]:
        """Where to connect for an allowed `host`: the pin, or its public addresses as this
        machine resolves them; raises Refused when there are none."""
        name = self.target(host, port)
        if (name, port) in self.pins:
            return [self.pins[name, port]]
        try:
            infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
        except OSError as e:
            raise Refused(f"{name} does not resolve ({e.strerror or e})") from e
        found = list(dict.fromkeys(str(i[4][0]) for i in infos))
        public = [a for a in found if not not_public(a)
                  or any(ipaddress.ip_address(a) in net for net in self.gateways)]
        if not public:
            raise Refused(f"{name} resolves to {', '.join(found)}: "
                          f"{not_public(found[0])}, which builds never reach")
        return [(a, port) for a in public]


def not_public(address: str) -> str:
    """Why a build must not reach this address ('' if it may): loopback, private ranges,
    link-local (cloud metadata at 169.254.169.254), CGNAT, multicast, reserved."""
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    for test, why in ((ip.is_loopback, "loopback"), (ip.is_link_local, "link-local (metadata)"),
                      (ip.is_multicast, "multicast"), (ip.is_unspecified, "unspecified"),
                      (ip in _CGNAT, "carrier-grade NAT"), (ip.is_private, "a private range"),
                      (ip.is_reserved, "reserved"), (not ip.is_global, "not global")):
        if test:
            return f"{ip} is {why}"
    return ""


_CGNAT = ipaddress.ip_network("100.64.0.0/10")


def _literal(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def parse_pins(text: str) -> dict[tuple[str, int], tuple[str, int]]:
    """`name:port=address:port ...` (spaces or commas between)."""
    pins = {}
    for word in (w for w in re.split(r"[,\s]+", text) if w):
        left, eq, right = word.partition("=")
        try:
            name, port = split_host_port(left)
            address, to = split_host_port(right)
            if not eq or not _NAME.match(name) or _literal(address) is None:
                raise ValueError
        except ValueError:
            raise ValueError(f"{PINS_ENV}: {word!r}: write name:port=address:port") from None
        pins[name, port] = (address, to)
    return pins


def split_host_port(text: str) -> tuple[str, int]:
    """`host:port` (IPv6 in brackets); ValueError for anything else."""
    host, colon, port = text.rpartition(":")
    if not colon or "]" in port:
        raise ValueError(f"{text!r} has no port")
    if not port.isdigit() or not 0 < int(port) < 65536 or not host:
        raise ValueError(f"{text!r}: not host:port")
    return host.strip("[]").lower(), int(port)
