"""The Alembic head must create exactly the tables the models describe."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from campugrid.coordinator.db import make_engine, migrate
from campugrid.coordinator.models import Base

pytestmark = pytest.mark.integration


def test_alembic_head_equals_the_models(db_url: str):
    engine = make_engine(db_url)
    migrate(engine)
    migrate(engine)  # running again changes nothing
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    engine.dispose()
    assert diff == []
