"""Remote base images resolved at submit (coordinator/bases.py)

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-03
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("bases_json", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "bases_json")
