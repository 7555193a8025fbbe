"""Alembic environment: migrations run from `campugrid.coordinator.db.migrate`."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from campugrid.coordinator.models import Base

config = context.config
target_metadata = Base.metadata


def run(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=target_metadata,
                      render_as_batch=connection.dialect.name == "sqlite")
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run migrations through campugrid.coordinator.db.migrate()")
run(connection)
