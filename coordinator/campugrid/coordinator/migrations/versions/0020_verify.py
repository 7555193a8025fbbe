"""Verified jobs: replicas (and copies of shards), the output digests they are compared by,
taint, each machine's record against quorums, which machine made each checkpoint, and
checkpoints checked by recomputation

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-05
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("replicas", sa.Integer(), nullable=False, server_default="0"))
        batch_op.add_column(sa.Column("replica_of", sa.String(36), nullable=True))
        batch_op.add_column(sa.Column("output_digest", sa.String(80), nullable=True))
        batch_op.add_column(sa.Column("tainted", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("apart", sa.String(36), nullable=True))
        batch_op.add_column(sa.Column("check_of", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("check_from", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("resume_id", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("compare_of", sa.String(36), nullable=True))
        batch_op.add_column(sa.Column("compare_pair", sa.String(80), nullable=True))
        batch_op.create_index("ix_jobs_compare_of", ["compare_of"], unique=False)
        batch_op.create_index("ix_jobs_replica_of", ["replica_of"], unique=False)
        batch_op.create_index("ix_jobs_check_of", ["check_of"], unique=False)
    with op.batch_alter_table("machines", schema=None) as batch_op:
        batch_op.add_column(sa.Column("agreed", sa.Integer(), nullable=False, server_default="0"))
        batch_op.add_column(sa.Column("disagreed", sa.Integer(), nullable=False,
                                      server_default="0"))
        batch_op.add_column(sa.Column("streak", sa.Integer(), nullable=False, server_default="0"))
        batch_op.add_column(sa.Column("last_agreed_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("quarantine", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("owner", sa.String(200), nullable=False, server_default=""))
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.add_column(sa.Column("machine_id", sa.String(36), nullable=True))
        batch_op.add_column(sa.Column("resumed_from", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("content_digest", sa.String(80), nullable=True))
        batch_op.add_column(sa.Column("verdict", sa.String(16), nullable=True))
        batch_op.add_column(sa.Column("parent_id", sa.Integer(), nullable=True))
    with op.batch_alter_table("shards", schema=None) as batch_op:
        batch_op.add_column(sa.Column("copy_of", sa.Integer(), nullable=True))
    op.create_table(
        "image_pulls",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(36), nullable=False),
        sa.Column("digest", sa.String(80), nullable=False),
        sa.Column("builder", sa.String(36), nullable=True),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_image_pulls_builder", "image_pulls", ["builder"], unique=False)
    op.create_table(
        "replica_machines",
        sa.Column("job_id", sa.String(36), nullable=False),
        sa.Column("machine_id", sa.String(36), nullable=False),
        sa.Column("replica_id", sa.String(36), nullable=False),
        sa.PrimaryKeyConstraint("job_id", "machine_id"),
    )


def downgrade() -> None:
    op.drop_table("replica_machines")
    op.drop_index("ix_image_pulls_builder", table_name="image_pulls")
    op.drop_table("image_pulls")
    with op.batch_alter_table("shards", schema=None) as batch_op:
        batch_op.drop_column("copy_of")
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.drop_column("parent_id")
        batch_op.drop_column("verdict")
        batch_op.drop_column("content_digest")
        batch_op.drop_column("resumed_from")
        batch_op.drop_column("machine_id")
    with op.batch_alter_table("machines", schema=None) as batch_op:
        for name in ("owner", "quarantine", "last_agreed_at", "streak", "disagreed", "agreed"):
            batch_op.drop_column(name)
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index("ix_jobs_compare_of")
        batch_op.drop_index("ix_jobs_check_of")
        batch_op.drop_index("ix_jobs_replica_of")
        for name in ("compare_pair", "compare_of", "resume_id", "check_from", "check_of",
                     "apart", "tainted", "output_digest", "replica_of", "replicas"):
            batch_op.drop_column(name)
