"""Rate-limit counters in the database, shared by every coordinator process

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "rate_counters",
        sa.Column("key", sa.String(length=300), nullable=False),
        sa.Column("count", sa.Integer(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("key"),
    )
    op.create_index("ix_rate_counters_expires_at", "rate_counters", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_rate_counters_expires_at", table_name="rate_counters")
    op.drop_table("rate_counters")
