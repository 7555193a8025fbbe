"""A build's way out: the agent's egress proxy for one build, on a unix socket that the
build's relay (builders/relay.py) carries its connections to.

Its connections go, by this machine's setting (CAMPUGRID_BUILD_NETWORK):
- "platform" (the default): to the platform's egress proxy, named in the lease with this
  machine's token, so the provider's own address talks to the coordinator and nothing else;
- "local": out from this machine, under the same rules (campugrid.egress.policy);
- "none": nowhere: every build is offline, as a job's `build.network: "none"` asks for its own.
Plain-HTTP requests to the distributions' mirrors go to the platform's apt cache, and the
build's pip is pointed at the platform's PyPI cache (PYPI_ALIAS), each with the
lease's token added here: the build never sees one. Every connection is a line in the build
log, and what comes back counts against the build's disk."""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from campugrid.agent.messages import Mirror, mirror
from campugrid.egress.policy import APT_HOSTS, CA_ENV, Policy
from campugrid.egress.proxy import EgressProxy, Serving, Upstream

MODES = ("platform", "local", "none")
MODE_ENV = "CAMPUGRID_BUILD_NETWORK"
# Under /dev, which every runtime mounts afresh: Buildah leaves a mount point in the image,
# which no container of the image then sees (tests/integration/test_builders.py).
CA_MOUNT = "/dev/campugrid-build-ca.pem"
# The platform's PyPI cache as the build sees it: a name that resolves nowhere; this proxy
# alone knows where it is.
PYPI_ALIAS = "pypi.campugrid.internal"


@dataclasses.dataclass
class BuildNetwork:
    """What a build gets: `socket` for the builder (None: offline), ARGs every stage's RUN
    steps see (`run_args`), and read-only `volumes`; `why` says in the build log how it is."""

    socket: Path | None
    run_args: tuple[tuple[str, str], ...]
    volumes: tuple[tuple[Path, str], ...]
    why: str
    _serving: Serving | None = None
    _folder: Path | None = None

    def close(self) -> None:
        if self._serving is not None:
            self._serving.close()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)

    def __enter__(self) -> BuildNetwork:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_network(mirrors: Sequence[Mirror], *, wanted: str, mode: str, disk_mb: int,
                 log: Callable[[str], None], policy: Policy | None = None) -> BuildNetwork:
    """The network for one build: `wanted` is the job's build.network ("default" or "none"),
    `mode` this machine's (MODES)."""
    if wanted == "none":
        return BuildNetwork(None, (), (), "offline, as the job's build.network asks")
    if mode == "none":
        return BuildNetwork(None, (), (), f"offline: this machine builds offline ({MODE_ENV})")
    parent = mirror(mirrors, "egress")
    if mode == "platform" and parent is None:
        return BuildNetwork(None, (), (), "offline: this coordinator offers no egress proxy")
    routes: dict[str, tuple[Upstream, str]] = {}
    args: list[tuple[str, str]] = []
    apt = mirror(mirrors, "apt")
    if apt is not None:
        routes |= {h: (Upstream(f"{apt.url}/{h}", apt.token, apt.certificate),
                       "the platform's apt cache") for h in APT_HOSTS}
    pypi = mirror(mirrors, "pypi")
    if pypi is not None:
        routes[PYPI_ALIAS] = (Upstream(pypi.url, pypi.token, pypi.certificate),
                              "the platform's PyPI cache")
        index = f"http://{PYPI_ALIAS}/index/"
        # pip only: uv takes a project's files from the URLs its lock names (another default
        # index would make `uv sync --locked` refuse the lock as out of date)
        args += [("PIP_INDEX_URL", index), ("PIP_TRUSTED_HOST", PYPI_ALIAS)]
    volumes: list[tuple[Path, str]] = []
    ca = os.environ.get(CA_ENV, "").strip()
    if ca:
        volumes.append((Path(ca), CA_MOUNT))
        args += [(name, CA_MOUNT) for name in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_CERT",
                                               "CURL_CA_BUNDLE", "GIT_SSL_CAINFO")]
    folder = Path(tempfile.mkdtemp(prefix="egress-", dir=os.environ.get("XDG_RUNTIME_DIR")))
    proxy = EgressProxy(policy or Policy.from_env(),
                        parent=Upstream(parent.url, parent.token, parent.certificate)
                        if mode == "platform" and parent is not None else None,
                        routes=routes, budget=disk_mb * 1024**2,
                        log=lambda rec: log(rec.line()))
    try:
        serving = Serving(proxy, unix=folder / "egress.sock")
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    how = ("through the platform's egress proxy" if proxy.parent is not None
           else "out from this machine, by the platform's rules")
    return BuildNetwork(folder / "egress.sock", tuple(args), tuple(volumes),
                        f"package registries only, {how}", serving, folder)
