"""The platform's package caches (coordinator/mirrors.py) for real: proxpi in the app and the
embedded apt-cacher-ng, behind machine tokens, served over HTTP as the coordinator serves
them; the agent's pip and apt fetch through them (from the real PyPI and Debian mirror) and
what they fetched stays cached."""

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

from campugrid.agent.messages import Mirror
from campugrid.agent.wheels import stage as stage_wheels
from campugrid.cli.aptcache import EmbeddedAptCache
from campugrid.cli.seaweed import free_port
from campugrid.coordinator.auth import Guard, RateLimits
from campugrid.coordinator.db import make_engine, migrate
from campugrid.coordinator.machines import MachineRecords, Status
from campugrid.coordinator.mirrors import MirrorTokens, create_mirrors
from campugrid.coordinator.store import Store
from campugrid.protocol.dockerfiles import check_dockerfile
from campugrid.protocol.spec import BuildOptions
from tests.integration.test_debs import stage as stage_debs
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


def jmespath_through(mirror: Mirror, tmp_path: Path) -> list[str]:
    """The agent's wheel fetch for `pip install jmespath==1.0.1`, given this mirror; its log."""
    lines: list[str] = []
    context = tmp_path / "context"
    context.mkdir()
    got = stage_wheels(check_dockerfile("FROM localhost/campugrid/python:bookworm\n"
                                        "RUN pip install jmespath==1.0.1\n").pip,
                       BuildOptions(), context, tmp_path, python="3.11", disk_mb=64,
                       log=lines.append, stop=threading.Event(), mirror=mirror)
    assert got is not None and got.count == 1, lines
    return lines


def test_the_agents_pip_fetches_through_the_cache_which_keeps_the_wheel(served, tmp_path):
    url, root = served.url, served.root
    mirror = Mirror("pypi", f"{url}/pypi", served.token())
    lines = jmespath_through(mirror, tmp_path)
    log = "\n".join(lines)
    assert f"from the platform's cache at {url}/pypi" in log
    assert mirror.token not in log  # the token never reaches the build log
    cached = [p.name for p in (root / "pypi").rglob("*.whl")]
    assert "jmespath-1.0.1-py3-none-any.whl" in cached, cached


def test_the_agents_apt_fetches_through_the_cache_which_keeps_the_packages(
        served, provider, shared_tmp):
    url, apt = served.url, served.apt
    token = served.token()
    # tree: a package the agent's own cache does not hold (the fetch must go to the mirror)
    for kept in (provider.home / ".cache/campugrid/apt").glob("*/archives/tree_*.deb"):
        kept.unlink()
    got = stage_debs(provider, shared_tmp, "RUN apt-get update && apt-get install -y tree\n",
                     mirror={"kind": "apt", "url": f"{url}/apt", "token": token})
    assert got.get("staged") is not None, got
    log = "\n".join(got["log"])
    assert f"through the platform's cache at {url}/apt" in log
    assert f"{url}/apt/deb.debian.org/debian bookworm InRelease" in log.replace("Get:1 ", "")
    assert token not in log
    assert "[campugrid] deb tree " in log and "(fetched)" in log
    kept = {p.name.split("_")[0] for p in (apt.data_dir / "cache").rglob("*.deb")}
    assert "tree" in kept, kept


def test_a_cache_out_of_reach_costs_a_log_line_not_the_build(provider, shared_tmp, tmp_path):
    """A coordinator serving REST on its own loopback only hands remote machines caches
    they cannot reach: they fetch from the index and the distribution's mirrors directly."""
    dead = "http://127.0.0.1:9"
    lines = jmespath_through(Mirror("pypi", f"{dead}/pypi", "token"), tmp_path)
    assert any("instead" in line and "pypi.org" in line for line in lines), lines
    debs = stage_debs(provider, shared_tmp, "RUN apt-get update && apt-get install -y jq\n",
                      mirror={"kind": "apt", "url": f"{dead}/apt", "token": "token"})
    assert debs.get("staged") is not None, debs
    assert any("fetching from the distribution's mirrors instead" in line
               for line in debs["log"]), debs["log"]


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
