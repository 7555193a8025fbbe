from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from campugrid.coordinator.db import make_engine, migrate
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
