"""Freshness tokens: ``freshline.token()`` and the key that signs its tokens.

A writer calls ``SELECT freshline.token()`` in its transaction, after its writes, or
right after commit, and hands the token to a reader, which asks the read API (or the
Python client) for features ``after`` it. What a token names and why a reader's check
is sound is :mod:`freshline.pipeline.cache.tokens`'s docstring; here is what the database holds.

- ``freshline.token_key``: one row, a random 32-byte key made here (Python's
  ``secrets``), with its HMAC-SHA256 inner and outer pads (the key, zero-padded to
  SHA-256's 64-byte block, XOR 0x36 and 0x5c), so the function computes HMAC with the
  built-in ``sha256()`` alone (no pgcrypto). Only the owner and ``freshline_api``
  (which checks tokens) may read it: a reader that trusts a token only if its MAC is
  right can never be handed a forged one, nor one from another database.
- ``freshline.token()``: ``SECURITY DEFINER`` (it reads the key for its caller) with a
  fixed ``search_path``. It names the caller's transaction when that has an id (it has
  written), else the snapshot of the statement (which sees every commit made before
  it). It runs only on the primary: a standby's snapshots do not list the primary's
  in-progress transactions, so they cannot be ranked against the entries' watermarks.

Writers are the application's own roles, which freshline does not know, so PUBLIC may
call the function (and use the schema to reach it); it gives nobody anything they
could not see already: the token of their own transaction or of a snapshot now.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import secrets

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

SCHEMA = "freshline"
KEY_BYTES = 32
BLOCK = 64  # SHA-256's block size: HMAC pads the key to it

# The token: form (1 byte: 1 a snapshot, 2 a transaction), then a = the snapshot's
# xmax or the transaction's id (int8), b = the snapshot's count of in-progress ids or
# 0 (int4), then the first 8 bytes of HMAC-SHA256 over those 13 bytes: 21 bytes, 28
# characters of unpadded base64url. pipeline/cache/tokens.py reads it.
TOKEN_FUNCTION = f"""
CREATE FUNCTION {SCHEMA}.token() RETURNS text
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  own xid8 := pg_current_xact_id_if_assigned();
  snap pg_snapshot;
  body bytea;
  pads record;
BEGIN
  IF pg_is_in_recovery() THEN
    RAISE EXCEPTION 'freshline.token() runs on the primary, not on a standby'
      USING ERRCODE = 'read_only_sql_transaction';
  END IF;
  IF own IS NOT NULL THEN
    body := '\\x02'::bytea || int8send(own::text::bigint) || int4send(0);
  ELSE
    snap := pg_current_snapshot();
    body := '\\x01'::bytea || int8send(pg_snapshot_xmax(snap)::text::bigint)
            || int4send((SELECT count(*) FROM pg_snapshot_xip(snap))::integer);
  END IF;
  SELECT inner_pad, outer_pad INTO STRICT pads FROM {SCHEMA}.token_key;
  RETURN translate(
    encode(body || substr(sha256(pads.outer_pad || sha256(pads.inner_pad || body)), 1, 8),
           'base64'),
    '+/', '-_');
END
$$
"""


def pads(key: bytes) -> tuple[bytes, bytes]:
    """HMAC-SHA256's inner and outer pads of ``key`` (at most 64 bytes)."""
    block = key.ljust(BLOCK, b"\0")
    return bytes(b ^ 0x36 for b in block), bytes(b ^ 0x5C for b in block)


def upgrade() -> None:
    op.execute(
        f"""
        CREATE TABLE {SCHEMA}.token_key (
            id          smallint PRIMARY KEY DEFAULT 1 CHECK (id = 1),
            key         bytea NOT NULL CHECK (length(key) = {KEY_BYTES}),
            inner_pad   bytea NOT NULL,
            outer_pad   bytea NOT NULL,
            created_at  timestamptz NOT NULL DEFAULT now()
        )
        """
    )
    key = secrets.token_bytes(KEY_BYTES)
    inner, outer = pads(key)
    # Hex literals, not bind parameters: the same statement in an offline (--sql) run.
    op.execute(
        f"INSERT INTO {SCHEMA}.token_key (key, inner_pad, outer_pad) VALUES "
        f"(decode('{key.hex()}', 'hex'), decode('{inner.hex()}', 'hex'), "
        f"decode('{outer.hex()}', 'hex'))"
    )
    op.execute(f"REVOKE ALL ON {SCHEMA}.token_key FROM PUBLIC")
    op.execute(f"GRANT SELECT (key) ON {SCHEMA}.token_key TO freshline_api")
    op.execute(TOKEN_FUNCTION)
    op.execute(f"GRANT EXECUTE ON FUNCTION {SCHEMA}.token() TO PUBLIC")
    op.execute(f"GRANT USAGE ON SCHEMA {SCHEMA} TO PUBLIC")


def downgrade() -> None:
    op.execute(f"REVOKE USAGE ON SCHEMA {SCHEMA} FROM PUBLIC")
    op.execute(f"DROP FUNCTION {SCHEMA}.token()")
    op.execute(f"DROP TABLE {SCHEMA}.token_key")
