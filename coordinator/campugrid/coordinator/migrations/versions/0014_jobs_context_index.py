"""Jobs by context digest: which live jobs share a build (coordinator/images.py)

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-03
"""
from __future__ import annotations

from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_jobs_context_sha256", "jobs", ["context_sha256"])


def downgrade() -> None:
    op.drop_index("ix_jobs_context_sha256", table_name="jobs")
