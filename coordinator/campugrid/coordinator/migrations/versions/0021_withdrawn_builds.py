"""A quarantined machine's image builds are withdrawn for good: reinstating it does not hand
them out again

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-05
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("image_builds", sa.Column("withdrawn_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("image_builds", schema=None) as batch_op:
        batch_op.drop_column("withdrawn_at")
