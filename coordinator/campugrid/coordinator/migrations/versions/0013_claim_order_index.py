"""The CPU claim's index in the claim's own order (state, gpus_needed, created_at, id)

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-03
"""
from __future__ import annotations

from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_index("ix_jobs_state_gpus_created", table_name="jobs")
    op.create_index("ix_jobs_state_gpus_created", "jobs",
                    ["state", "gpus_needed", "created_at", "id"])


def downgrade() -> None:
    op.drop_index("ix_jobs_state_gpus_created", table_name="jobs")
    op.create_index("ix_jobs_state_gpus_created", "jobs", ["state", "gpus_needed", "created_at"])
