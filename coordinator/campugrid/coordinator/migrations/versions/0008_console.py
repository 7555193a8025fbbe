"""Console users (argon2id password, encrypted TOTP secret, lockout), their sessions, and
each GPU's memory by the minute for the console's chart

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "users",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("app_id", sa.String(length=36), nullable=False),
        sa.Column("password_hash", sa.String(length=200), nullable=False),
        sa.Column("totp_secret", sa.Text(), nullable=False),
        sa.Column("totp_last_step", sa.BigInteger(), nullable=False),
        sa.Column("enrol_sha256", sa.String(length=64), nullable=True),
        sa.Column("enrol_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("enrolled_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("failed_logins", sa.Integer(), nullable=False),
        sa.Column("locked_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("acknowledged_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["app_id"], ["apps.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
        sa.UniqueConstraint("enrol_sha256"),
    )
    op.create_table(
        "console_sessions",
        sa.Column("id_sha256", sa.String(length=64), nullable=False),
        sa.Column("user_id", sa.String(length=36), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["user_id"], ["users.id"]),
        sa.PrimaryKeyConstraint("id_sha256"),
    )
    with op.batch_alter_table("console_sessions", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_console_sessions_user_id"), ["user_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_console_sessions_expires_at"), ["expires_at"],
                              unique=False)
    op.create_table(
        "gpu_samples",
        sa.Column("machine_id", sa.String(length=36), nullable=False),
        sa.Column("gpu_uuid", sa.String(length=100), nullable=False),
        sa.Column("minute", sa.BigInteger(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("shared", sa.Boolean(), nullable=False),
        sa.Column("total_mb", sa.BigInteger(), nullable=False),
        sa.Column("free_mb", sa.BigInteger(), nullable=False),
        sa.Column("reserved_mb", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("machine_id", "gpu_uuid", "minute"),
    )
    with op.batch_alter_table("gpu_samples", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_gpu_samples_minute"), ["minute"], unique=False)


def downgrade() -> None:
    op.drop_table("gpu_samples")
    op.drop_table("console_sessions")
    op.drop_table("users")
