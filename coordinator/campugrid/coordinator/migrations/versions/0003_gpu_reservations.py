"""GPU reservations, GPU snapshots of machines, jobs' GPU needs

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""
from __future__ import annotations

import json

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "gpu_reservations",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(length=36), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("machine_id", sa.String(length=36), nullable=False),
        sa.Column("gpu_uuid", sa.String(length=100), nullable=False),
        sa.Column("memory_mb", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("gpu_reservations", schema=None) as batch_op:
        batch_op.create_index("ix_gpu_reservations_machine", ["machine_id", "gpu_uuid"], unique=False)
        batch_op.create_index(batch_op.f("ix_gpu_reservations_job_id"), ["job_id"], unique=False)
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("gpus_needed", sa.Integer(), server_default="0", nullable=False))
        batch_op.create_index("ix_jobs_state_gpus_created", ["state", "gpus_needed", "created_at"],
                              unique=False)
    with op.batch_alter_table("machines", schema=None) as batch_op:
        batch_op.add_column(sa.Column("gpus_json", sa.Text(), server_default="[]", nullable=False))
    # Jobs stored before this revision: their GPU needs come from their spec.
    conn = op.get_bind()
    for job_id, spec_json in conn.execute(sa.text("SELECT id, spec_json FROM jobs")).all():
        try:
            gpus = int(json.loads(spec_json).get("resources", {}).get("gpus", 0) or 0)
        except (ValueError, TypeError, AttributeError):
            gpus = 0
        if gpus:
            conn.execute(sa.text("UPDATE jobs SET gpus_needed = :g WHERE id = :i"),
                         {"g": gpus, "i": job_id})


def downgrade() -> None:
    with op.batch_alter_table("machines", schema=None) as batch_op:
        batch_op.drop_column("gpus_json")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index("ix_jobs_state_gpus_created")
        batch_op.drop_column("gpus_needed")
    with op.batch_alter_table("gpu_reservations", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_gpu_reservations_job_id"))
        batch_op.drop_index("ix_gpu_reservations_machine")
    op.drop_table("gpu_reservations")
