"""Shared images: the builds machines pushed, and who is building one now

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "image_builds",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("build_key", sa.String(length=64), nullable=False),
        sa.Column("context_sha256", sa.String(length=64), nullable=False),
        sa.Column("digest", sa.String(length=80), nullable=False),
        sa.Column("machine_id", sa.String(length=36), nullable=False),
        sa.Column("job_id", sa.String(length=36), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("used_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("build_key", "machine_id", name="uq_image_builds_key_machine"),
    )
    op.create_index("ix_image_builds_context_sha256", "image_builds", ["context_sha256"])
    op.create_table(
        "image_claims",
        sa.Column("build_key", sa.String(length=64), nullable=False),
        sa.Column("job_id", sa.String(length=36), nullable=False),
        sa.Column("token", sa.BigInteger(), nullable=False),
        sa.Column("machine_id", sa.String(length=36), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("build_key"),
    )


def downgrade() -> None:
    op.drop_table("image_claims")
    op.drop_index("ix_image_builds_context_sha256", table_name="image_builds")
    op.drop_table("image_builds")
