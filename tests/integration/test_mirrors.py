"""The platform's package caches (coordinator/mirrors.py) for real: proxpi in the app and the
embedded apt-cacher-ng, behind machine tokens, served over HTTP as the coordinator serves
them; a build's requests reach them through the agent's egress proxy (agent/buildnet.py),
which adds the token (from the real PyPI and Debian mirror), and what they fetched stays
cached."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from campugrid.agent import buildnet
from campugrid.agent.messages import Mirror
from campugrid.cli.aptcache import EmbeddedAptCache
from campugrid.cli.seaweed import free_port
from campugrid.coordinator.auth import Guard, RateLimits
from campugrid.coordinator.db import make_engine, migrate
from campugrid.coordinator.machines import MachineRecords, Status
from campugrid.coordinator.mirrors import MirrorTokens, create_mirrors
from campugrid.coordinator.store import Store
from campugrid.egress.policy import Policy
from tests.support.machines import add_machine

pytestmark = pytest.mark.integration


@dataclasses.dataclass
class Served:
    url: str
    tokens: MirrorTokens
    root: Path
    apt: EmbeddedAptCache
    store: Store
    machine: str  # an approved machine's id

    def token(self) -> str:
        return self.tokens.mint(self.machine)


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Served]:
    """The caches as the coordinator mounts them, its machines in a real store (SQLite)."""
    root = tmp_path_factory.mktemp("mirrors")
    apt = EmbeddedAptCache(root / "apt").start()
    tokens = MirrorTokens(root / "registry")
    engine = make_engine(f"sqlite:///{root}/store.db")
    migrate(engine)
    store = Store(engine)
    app = create_mirrors(tokens, pypi_dir=root / "pypi", apt_address=apt.address,
                         machine=MachineRecords(store.machines).get, guard=Guard(store.limiter))
    try:
        with serve(app) as url:
            yield Served(url, tokens, root, apt, store, add_machine(store, "m-1"))
    finally:
        apt.stop()
        store.close()


@contextlib.contextmanager
def serve(app: object) -> Iterator[str]:
    """`app` served over HTTP on loopback, as the coordinator's REST serves it; its URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,  # type: ignore[arg-type]
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "the mirrors did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_only_a_machines_token_reads_and_only_what_the_caches_are_for(served, tmp_path):
    url = served.url
    good = ("campugrid", served.token())
    other = MirrorTokens(tmp_path / "other-key").mint(served.machine)  # another coordinator's
    index = f"{url}/pypi/index/six/"
    release = f"{url}/apt/deb.debian.org/debian/dists/bookworm/InRelease"
    for target in (index, release):
        assert httpx.get(target).status_code == 401
        assert httpx.get(target, auth=("campugrid", other)).status_code == 401
        assert httpx.get(target, auth=("campugrid", "not-a-token")).status_code == 401
        assert httpx.post(target, auth=good).status_code == 405
    assert httpx.get(index, auth=good).status_code == 200
    got = httpx.get(release, auth=good)
    assert got.status_code == 200 and got.content.startswith(b"-----BEGIN PGP SIGNED MESSAGE")
    # no way around the allow-list: another host, a climb out of the path, proxpi's own
    # cache controls, a mirror that is not there
    for path in ("/apt/example.com/debian/dists/bookworm/InRelease",
                 "/apt/deb.debian.org/../example.com/x", "/pypi/cache/list", "/pypi/health",
                 "/pypi/index/../cache/list", "/pypi/index/./six/",
                 "/nothing/here"):
        # sent as written: httpx would remove the dot segments itself
        with httpx.Client(auth=good) as client:
            request = client.build_request("GET", url + path,
                                           extensions={"target": path.encode()})
            got = client.send(request)
        assert got.status_code == 404, (path, got.status_code)
    assert httpx.delete(f"{url}/pypi/cache/list", auth=good).status_code == 405


@contextlib.contextmanager
def build_client(mirrors: list[Mirror], lines: list[str]) -> Iterator[httpx.Client]:
    """An HTTP client that goes out as a build's RUN steps do: through the agent's egress
    proxy for one build (its unix socket, where the build's relay would carry it), here in
    local mode with no other host allowed."""
    with buildnet.open_network(mirrors, wanted="default", mode="local", disk_mb=64,
                               log=lines.append, policy=Policy(hosts=("none.invalid",))) as net:
        assert net.socket is not None
        transport = httpx.HTTPTransport(uds=str(net.socket))
        with httpx.Client(transport=transport, timeout=120) as client:
            yield client


def through_proxy(client: httpx.Client, url: str) -> httpx.Response:
    """A proxy request (absolute URL) as pip and apt send one to their http_proxy."""
    return client.send(client.build_request("GET", "http://proxy/",
                                            extensions={"target": url.encode()}))


def test_a_builds_pip_fetches_through_the_cache_which_keeps_the_wheel(served):
    url, root = served.url, served.root
    mirror = Mirror("pypi", f"{url}/pypi", served.token())
    lines: list[str] = []
    with buildnet.open_network([mirror], wanted="default", mode="local", disk_mb=1,
                               log=lines.append) as net:
        index = dict(net.run_args)["PIP_INDEX_URL"]
    with build_client([mirror], lines) as client:
        page = through_proxy(client, f"{index}jmespath/")
        assert page.status_code == 200, page.text
        link = next(h for h in page.text.split('"') if "jmespath-1.0.1-py3-none-any.whl" in h)
        wheel = through_proxy(client, str(httpx.URL(f"{index}jmespath/").join(link)))
        assert wheel.status_code == 200 and wheel.content[:2] == b"PK", wheel.status_code
    log = "\n".join(lines)
    assert f"GET {buildnet.PYPI_ALIAS}/index/jmespath/ via the platform's PyPI cache" in log
    assert mirror.token not in log  # the token never reaches the build log
    cached = [p.name for p in (root / "pypi").rglob("*.whl")]
    assert "jmespath-1.0.1-py3-none-any.whl" in cached, cached


def test_a_builds_apt_fetches_through_the_cache_which_keeps_the_packages(served):
    url, apt = served.url, served.apt
    token = served.token()
    lines: list[str] = []
    release = "http://deb.debian.org/debian/dists/bookworm/Release"
    with build_client([Mirror("apt", f"{url}/apt", token)], lines) as client:
        got = through_proxy(client, release)
        assert got.status_code == 200 and "Codename: bookworm" in got.text, got.status_code
        # Anything else is the policy's: here no host is allowed besides the caches.
        refused = through_proxy(client, "http://example.org/")
        assert refused.status_code == 403
    log = "\n".join(lines)
    assert "GET deb.debian.org/debian/dists/bookworm/Release via the platform's apt cache" in log
    assert "refused GET example.org/: example.org is not on this platform's list" in log
    assert token not in log
    kept = [p.name for p in apt.data_dir.rglob("Release")]
    assert kept, "apt-cacher-ng kept nothing"


def test_a_machine_revoked_or_not_approved_is_refused_at_once_and_bad_tokens_count(served):
    """The token outlives a revocation (30 minutes); the machine's status does not: its next
    request after the revocation (within MachineRecords' second) is refused, in every
    coordinator process, as gRPC calls are. Refused tokens count against the address."""
    guard = Guard(served.store.limiter, RateLimits(failures_per_address_per_min=3))
    app = create_mirrors(served.tokens, pypi_dir=None, apt_address=served.apt.address,
                         machine=MachineRecords(served.store.machines).get, guard=guard)
    release = "/apt/deb.debian.org/debian/dists/bookworm/Release"
    revoked = add_machine(served.store, "m-revoked")
    pending = add_machine(served.store, "m-pending", approve=False)
    with serve(app) as url, httpx.Client(base_url=url) as client:
        token = served.tokens.mint(revoked)
        assert client.get(release, auth=("m", token)).status_code == 200
        served.store.machines.set_status(revoked, Status.REVOKED)
        deadline = time.monotonic() + 3
        while (got := client.get(release, auth=("m", token))).status_code == 200:
            assert time.monotonic() < deadline, "a revoked machine still reads the cache"
            time.sleep(0.1)
        assert got.status_code == 403 and f"machine {revoked} is revoked" in got.text
        got = client.get(release, auth=("m", served.tokens.mint(pending)))
        assert got.status_code == 403 and "is pending" in got.text
        unknown = served.tokens.mint("00000000-0000-0000-0000-000000000000")
        assert client.get(release, auth=("m", unknown)).status_code == 403
        codes = [client.get(release, auth=("m", "forged")).status_code for _ in range(5)]
        assert codes == [401, 401, 401, 429, 429], codes
