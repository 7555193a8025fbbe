"""The machine status epoch (one row)

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-03
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    table = op.create_table(
        "machine_epoch",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.bulk_insert(table, [{"id": 1, "epoch": 0}])


def downgrade() -> None:
    op.drop_table("machine_epoch")
