"""A build claim names its hold's kind: a fencing token no longer says it by its range

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-05
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None
OLD_SESSION_BASE = 1 << 40  # how a session's token was told from an attempt's before


def upgrade() -> None:
    op.add_column("image_claims", sa.Column("hold_kind", sa.String(16), nullable=False,
                                            server_default="attempt"))
    op.execute(sa.text("UPDATE image_claims SET hold_kind = 'session', token = token - :base "
                       "WHERE token >= :base").bindparams(base=OLD_SESSION_BASE))


def downgrade() -> None:
    op.execute(sa.text("UPDATE image_claims SET token = token + :base "
                       "WHERE hold_kind = 'session'").bindparams(base=OLD_SESSION_BASE))
    with op.batch_alter_table("image_claims", schema=None) as batch_op:
        batch_op.drop_column("hold_kind")
