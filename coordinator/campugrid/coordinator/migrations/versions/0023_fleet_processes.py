"""A connected machine is seen as long as its stream's process is alive (fleet_processes):
an idle fleet no longer writes every machine's last-seen time every 10 s

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-07
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table("fleet_processes",
                    sa.Column("id", sa.String(36), primary_key=True),
                    sa.Column("alive_at", sa.DateTime(timezone=True), nullable=False))
    op.add_column("machines", sa.Column("connected_to", sa.String(36), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("machines", schema=None) as batch_op:
        batch_op.drop_column("connected_to")
    op.drop_table("fleet_processes")
