"""What a job needs of one machine (CPUs, memory, disk), as columns the claim filters on

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-05
"""
from __future__ import annotations

import json

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("cpus_needed", sa.Float(), server_default="0",
                                      nullable=False))
        batch_op.add_column(sa.Column("memory_needed_mb", sa.Integer(), server_default="0",
                                      nullable=False))
        batch_op.add_column(sa.Column("disk_needed_mb", sa.Integer(), server_default="0",
                                      nullable=False))
    # Jobs not ended (queued, or running and queued again if their machine is lost): their
    # needs come from their spec. Ended jobs are never claimed again.
    conn = op.get_bind()
    for job_id, spec_json in conn.execute(sa.text(
            "SELECT id, spec_json FROM jobs WHERE state NOT IN "
            "('succeeded', 'failed', 'cancelled')")).all():
        try:
            res = json.loads(spec_json).get("resources", {}) or {}
            values = {"c": float(res.get("cpus", 1.0)), "m": int(res.get("memory_mb", 1024)),
                      "d": max(int(res.get("output_mb", 4096)), int(res.get("build_mb") or 0)),
                      "i": job_id}
        except (ValueError, TypeError, AttributeError):
            continue
        conn.execute(sa.text("UPDATE jobs SET cpus_needed = :c, memory_needed_mb = :m, "
                             "disk_needed_mb = :d WHERE id = :i"), values)


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("disk_needed_mb")
        batch_op.drop_column("memory_needed_mb")
        batch_op.drop_column("cpus_needed")
