from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from campugrid.cli.platform import PROVIDER_USER_ENV, ProviderUser
from campugrid.cli.seaweed import EmbeddedS3
from campugrid.coordinator.objects import S3Store
from campugrid.protocol.errors import CampugridError
from tests.support.postgres import TempPostgres
from tests.support.standins import this_network

# Agents the tests start (Platform.start_agent passes this on; so does `campugrid up`) ask for
# work every 0.2 s, not every second: a job starts up to 0.8 s sooner, some hundred times a
# run. The product's default stays 1.0 s (bench/idle.py measures an idle agent at that).
os.environ.setdefault("CAMPUGRID_AGENT_POLL_SECONDS", "0.2")
# What this machine's network needs for builds to reach the real registries (an intercepting
# TLS authority, one gateway address for every registry): tests/support/standins.py.
for _name, _value in this_network().items():
    os.environ.setdefault(_name, _value)

# infra/test runs two pytest-xdist workers (`--dist loadscope`, scheduled as below), each
# lending the machine as its own provider user: the first as `campugrid`, the second as the user
# infra/setup.sh makes for it (CAMPUGRID_SECOND_AGENT_USER), with its own Podman store, cgroups,
# output slots and processes. The first worker runs "the host's tests" in order, one scope: the
# security suite first (it snapshots the provider's processes, cgroups and the disk), and then
# the others, several of which count the provider's processes or images.
SECOND_USER = os.environ.get("CAMPUGRID_SECOND_AGENT_USER", "campugrid2")


def _second_user() -> str | None:
    """The second worker's provider user, where it can be one (as root, once set up)."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam(SECOND_USER)
    except KeyError:
        return None
    return SECOND_USER


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """(On the controller.) Which user each worker lends the machine as: the second user on
    every worker but the first, where the scheduler below places the tests (loadscope,
    infra/test's). Workers see `dist` as "no", so the controller decides."""
    if (node.gateway.id != "gw0" and _second_user()
            and node.config.getvalue("dist") == "loadscope"):
        node.workerinput["campugrid_agent_user"] = SECOND_USER


def pytest_configure(config: pytest.Config) -> None:
    user = getattr(config, "workerinput", {}).get("campugrid_agent_user")
    if user:
        os.environ[PROVIDER_USER_ENV] = user


# These modules use none of the provider's Podman (the coordinator, its store, the CLI, the
# static checks, unit tests; root's own Podman for the image cache): each is a scope of its own,
# on either worker.
BESIDE_THE_HOST = (
    "tests/unit/", "tests/test_static.py", "tests/security/test_trust.py",
    "tests/security/test_console.py",
    *(f"tests/integration/test_{name}.py" for name in (
        "agent_service", "bases", "claim_plan", "cli_coordinator", "egress", "images", "inputs",
        "leader", "machine_cache", "metrics", "migrations", "objects", "placement", "ratelimits",
        "seaweed_security", "services", "shards_store", "store", "users", "verified_store",
        "checked_checkpoints", "failover", "relay", "fleet", "streaming",
        # what starts processes but needs no Podman (tests/unit starts none)
        "backends", "cli", "cli_spec_process", "confined_children", "coordinator_api_contract",
        "gpu_processes",
        "framework_hooks", "hook_processes", "install_unit", "owner", "packaging", "shard_runner")))


# These modules run agents and jobs but look at nothing of the provider's beyond their own
# platform: with a second user, each is a scope of its own too, run as its worker's user.
ANY_PROVIDER = tuple(f"tests/acceptance/test_{name}.py" for name in (
    "console", "coordinators", "handback", "images", "resilience", "shards", "submit_boundary",
    "trust_flow", "verified"))
# The security suite runs first on the first worker, before the second has finished the modules
# beside it and starts the ones above (whose images would count against its disk check); the
# host's heaviest builds run last, when the other worker is done: beside its CPU-bound tests
# (mypy, password hashing, the frameworks) the corpus took 370 s instead of 290 s.
HOST_FIRST = ("tests/security/",)
HOST_LAST = ("tests/acceptance/test_bases.py",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # stable: the rest in file order
    items.sort(key=lambda item: 2 if item.nodeid.startswith(HOST_LAST)
               else 0 if item.nodeid.startswith(HOST_FIRST) else 1)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """loadscope's scheduler with every host test in one scope (xdist_group markers would do,
    but pytest 9.2 ignores the node ids xdist 3.8 rewrites for them)."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    apart = BESIDE_THE_HOST + (ANY_PROVIDER if _second_user() else ())

    class HostInOrder(LoadScopeScheduling):
        def schedule(self) -> None:
            if self.collection is None:  # the first call: with fewer scopes than workers, the
                # last worker in this dict is shut down; never the first (the host's user)
                self.assigned_work = dict(sorted(self.assigned_work.items(),
                                                 key=lambda kv: kv[0].gateway.id != "gw0"))
            super().schedule()

        def _split_scope(self, nodeid: str) -> str:
            return nodeid.split("::")[0] if nodeid.startswith(apart) else "host"

        def _assign_work_unit(self, node: Any) -> None:
            """The host's scope to the first worker (its user is `campugrid`); to the other,
            the modules beside it first and then those of ANY_PROVIDER."""
            queue = list(self.workqueue)
            if node.gateway.id == "gw0":
                pick = "host" if "host" in queue else queue[0]
            else:
                pick = min(queue, key=lambda s: 2 if s == "host" else s.startswith(ANY_PROVIDER))
            self.workqueue.move_to_end(pick, last=False)
            super()._assign_work_unit(node)

    return HostInOrder(config, log)


def _shared_tmp(prefix: str) -> Path:
    """A temporary folder the provider user can traverse (pytest's tmp_path is 0700 root)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    os.chmod(path, 0o711)
    return path


@pytest.fixture(scope="session")
def provider() -> ProviderUser:
    user = ProviderUser.resolve()
    user.prepare()
    return user


def _agents_images(user: ProviderUser) -> set[str]:
    listed = subprocess.run(user.command(["podman", "images", "--format",
                                          "{{.Repository}}:{{.Tag}}"]),
                            capture_output=True, text=True, timeout=120, check=False, cwd="/")
    return {i for i in listed.stdout.split()
            if i.startswith(("localhost/campugrid-cache/", "localhost/campugrid-job/"))}


@pytest.fixture(scope="session", autouse=True)
def _agents_images_go_at_the_end() -> Iterator[None]:
    """Each test's agents have a scope of their own, and so do their image caches: what they
    added to this worker's provider store goes when the session ends (gigabytes a run); what
    was there before (a real agent's) stays."""
    before: set[str] | None = None
    if os.geteuid() == 0:
        with contextlib.suppress(CampugridError, OSError, subprocess.TimeoutExpired):
            user = ProviderUser.resolve()
            before = _agents_images(user)
    yield
    if before is None:
        return
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        left = sorted(_agents_images(user) - before)
        for i in range(0, len(left), 50):  # not --force: an image a container uses stays
            subprocess.run(user.command(["podman", "rmi", "--ignore", *left[i:i + 50]]),
                           capture_output=True, timeout=600, check=False, cwd="/")


@pytest.fixture(scope="session")
def s3_server() -> Iterator[EmbeddedS3]:
    root = _shared_tmp("campugrid-s3-")
    server = EmbeddedS3(root / "s3", "test", secrets.token_urlsafe(24)).start()
    yield server
    server.stop()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(autouse=True)
def _drop_new_buckets(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each bucket is a SeaweedFS collection with volumes of its own, and the session's server
    has room for a couple of hundred: a test's buckets go when it ends (wider fixtures' stay)."""
    if "s3_server" not in request.fixturenames:
        yield
        return
    from minio import Minio

    server: EmbeddedS3 = request.getfixturevalue("s3_server")
    client = Minio(server.endpoint, server.access_key, server.secret_key, secure=False)
    before = {b.name for b in client.list_buckets()}
    yield
    for bucket in {b.name for b in client.list_buckets()} - before:
        for obj in client.list_objects(bucket, recursive=True):
            client.remove_object(bucket, obj.object_name)
        client.remove_bucket(bucket)


@pytest.fixture
def s3(s3_server: EmbeddedS3) -> S3Store:
    """A fresh bucket per test on the session's SeaweedFS."""
    store = S3Store(s3_server.endpoint, s3_server.access_key, s3_server.secret_key,
                    f"t-{secrets.token_hex(6)}")
    store.ensure_bucket()
    return store


@pytest.fixture(scope="session")
def postgres() -> Iterator[TempPostgres]:
    root = _shared_tmp("campugrid-pg-")
    pg = TempPostgres(root).start()
    yield pg
    pg.stop()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def database(postgres: TempPostgres) -> Iterator[str]:
    """A fresh PostgreSQL database of its own (its URL), dropped afterwards."""
    with postgres.database() as url:
        yield url


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    path = _shared_tmp("campugrid-test-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Marks a test whose body failed (`item.failed`), for fixtures that keep evidence then
    (the console's browser screenshots)."""
    report = yield
    if report.when == "call" and report.failed:
        item.failed = True  # type: ignore[attr-defined]
    return report
