"""Sharded jobs: shards (one task each) and the sessions that run them

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('shard_sessions',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('job_id', sa.String(length=36), nullable=False),
    sa.Column('machine_id', sa.String(length=36), nullable=False),
    sa.Column('active', sa.Boolean(), nullable=False),
    sa.Column('lost', sa.Boolean(), nullable=False),
    sa.Column('lease_expires_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], ),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('shard_sessions', schema=None) as batch_op:
        batch_op.create_index('ix_shard_sessions_active', ['active', 'lease_expires_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_shard_sessions_job_id'), ['job_id'], unique=False)

    op.create_table('shards',
    sa.Column('job_id', sa.String(length=36), nullable=False),
    sa.Column('idx', sa.Integer(), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('cost', sa.Float(), nullable=False),
    sa.Column('payload_json', sa.Text(), nullable=False),
    sa.Column('tries', sa.Integer(), nullable=False),
    sa.Column('session_id', sa.BigInteger(), nullable=True),
    sa.Column('machine_id', sa.String(length=36), nullable=True),
    sa.Column('exit_code', sa.Integer(), nullable=True),
    sa.Column('result_json', sa.Text(), nullable=True),
    sa.Column('reason', sa.Text(), nullable=True),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], ),
    sa.PrimaryKeyConstraint('job_id', 'idx')
    )
    with op.batch_alter_table('shards', schema=None) as batch_op:
        batch_op.create_index('ix_shards_pick', ['job_id', 'state', 'cost', 'idx'], unique=False)

    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('shards_total', sa.Integer(), server_default='0', nullable=False))
        batch_op.add_column(sa.Column('shards_queued', sa.Integer(), server_default='0', nullable=False))
        batch_op.add_column(sa.Column('shards_done', sa.Integer(), server_default='0', nullable=False))
        batch_op.add_column(sa.Column('shards_failed', sa.Integer(), server_default='0', nullable=False))
        batch_op.add_column(sa.Column('shards_sha256', sa.String(length=64), nullable=True))



def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('shards_sha256')
        batch_op.drop_column('shards_failed')
        batch_op.drop_column('shards_done')
        batch_op.drop_column('shards_queued')
        batch_op.drop_column('shards_total')

    with op.batch_alter_table('shards', schema=None) as batch_op:
        batch_op.drop_index('ix_shards_pick')

    op.drop_table('shards')
    with op.batch_alter_table('shard_sessions', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_shard_sessions_job_id'))
        batch_op.drop_index('ix_shard_sessions_active')

    op.drop_table('shard_sessions')
