"""Trust: apps, invites and nonces; machines by public key and approval; jobs by owner

Machines registered with a shared secret cannot be carried over (their key halves do not
exist): they are dropped and join again with `campugrid agent join`.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "apps",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("public_key", sa.String(length=64), nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("admin", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
        sa.UniqueConstraint("public_key"),
    )
    op.create_table(
        "invites",
        sa.Column("code_sha256", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("admin", sa.Boolean(), nullable=False),
        sa.Column("created_by", sa.String(length=36), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("used_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("code_sha256"),
    )
    op.create_table(
        "nonces",
        sa.Column("signer", sa.String(length=80), nullable=False),
        sa.Column("nonce", sa.String(length=64), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("signer", "nonce"),
    )
    with op.batch_alter_table("nonces", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_nonces_expires_at"), ["expires_at"], unique=False)

    # The one-column unique constraint of 0001 was unnamed: name it to drop it.
    bind = op.get_bind()
    old_unique = ("jobs_client_job_id_key" if bind.dialect.name == "postgresql"
                  else "uq_jobs_client_job_id")
    with op.batch_alter_table("jobs", schema=None, naming_convention={
            "uq": "uq_%(table_name)s_%(column_0_name)s"}) as batch_op:
        batch_op.add_column(sa.Column("owner_id", sa.String(length=36), nullable=True))
        batch_op.drop_constraint(old_unique, type_="unique")
        batch_op.create_unique_constraint("uq_jobs_owner_client_job_id",
                                          ["owner_id", "client_job_id"])
        batch_op.create_index(batch_op.f("ix_jobs_owner_id"), ["owner_id"], unique=False)

    op.execute("DELETE FROM machines")
    with op.batch_alter_table("machines", schema=None) as batch_op:
        batch_op.drop_column("secret_sha256")
        batch_op.add_column(sa.Column("public_key", sa.String(length=64), nullable=False))
        batch_op.add_column(sa.Column("fingerprint", sa.String(length=64), nullable=False))
        batch_op.add_column(sa.Column("status", sa.String(length=16), nullable=False))
        batch_op.add_column(sa.Column("address", sa.String(length=100), server_default="",
                                      nullable=False))
        batch_op.create_unique_constraint("uq_machines_public_key", ["public_key"])
        batch_op.create_index(batch_op.f("ix_machines_status"), ["status"], unique=False)


def downgrade() -> None:
    op.execute("DELETE FROM machines")
    with op.batch_alter_table("machines", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_machines_status"))
        batch_op.drop_constraint("uq_machines_public_key", type_="unique")
        batch_op.drop_column("address")
        batch_op.drop_column("status")
        batch_op.drop_column("fingerprint")
        batch_op.drop_column("public_key")
        batch_op.add_column(sa.Column("secret_sha256", sa.String(length=64), nullable=False))
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_jobs_owner_id"))
        batch_op.drop_constraint("uq_jobs_owner_client_job_id", type_="unique")
        batch_op.create_unique_constraint("uq_jobs_client_job_id", ["client_job_id"])
        batch_op.drop_column("owner_id")
    op.drop_table("nonces")
    op.drop_table("invites")
    op.drop_table("apps")
