from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from campugrid.cli.registry import EmbeddedRegistry
from campugrid.coordinator.db import make_engine, migrate
from campugrid.coordinator.registry import RegistryTokens, ensure_signing_key
from campugrid.coordinator.store import Store
from tests.support.postgres import TempPostgres


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/store.db"
        return
    pg: TempPostgres = request.getfixturevalue("postgres")
    with pg.database() as url:
        yield url


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    engine = make_engine(db_url)
    migrate(engine)
    store = Store(engine)
    yield store
    store.close()


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmbeddedRegistry, RegistryTokens]]:
    if shutil.which("docker-registry") is None or shutil.which("skopeo") is None:
        pytest.fail("docker-registry and skopeo are missing: run infra/setup.sh")
    root = tmp_path_factory.mktemp("registry")
    _, cert = ensure_signing_key(root / "keys")
    running = EmbeddedRegistry(root / "reg", cert).start()
    try:
        yield running, RegistryTokens(root / "keys", running.address)
    finally:
        running.stop()
