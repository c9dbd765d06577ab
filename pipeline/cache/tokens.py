"""Freshness tokens: "a state of the database at or after this commit", checked against
entries' watermarks.

``SELECT freshline.token()`` (migration 0002) returns a *snapshot* token after commit
(the ``xmax`` and in-progress count of its snapshot, ranked by :func:`snapshot_rank` with
no query) or, inside a transaction that has written, a *transaction* token (its id,
ranked once by :meth:`Tokens.resolve` and shared in Redis; :class:`TokenPending` until
it ends). A token carries a MAC keyed by the database's own ``freshline.token_key``
(:class:`InvalidToken` otherwise); one of a state not reached is :class:`TokenAhead`.
Format: 21 bytes as 28 characters of unpadded base64url: form (1 snapshot, 2
transaction), ``a`` (int8), ``b`` (int4), then the MAC.

Why the check is sound: docs/freshness.md, "What a token names, and why the check is
sound".
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Final, cast

import redis
import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from freshline.pipeline.cache.recompute import snapshot_rank
from freshline.pipeline.core.db import autocommit, token_key
from freshline.pipeline.core.errors import ConfigError, FreshlineError
from freshline.pipeline.core.keys import token_rank_key

log = logging.getLogger(__name__)

SNAPSHOT: Final = 1
TRANSACTION: Final = 2
BODY_BYTES: Final = 13
MAC_BYTES: Final = 8
TOKEN_CHARS: Final = 28
_SHAPE = re.compile(r"[A-Za-z0-9_-]{28}")
RESOLVED_LIMIT = 4096
"""Transaction tokens whose rank a process remembers (the most recently used)."""
RANK_TTL_S = 60
"""How long the first rank found for a transaction token is shared in Redis."""


class InvalidToken(FreshlineError, ValueError):
    """Not a freshness token of this database: malformed, altered, forged or foreign."""


class ForeignToken(InvalidToken):
    """A token of the right shape that this database did not sign (forged, altered,
    another database's) or of a form it does not know: refused as not being its caller's
    to use, where a malformed one is a bad request."""


class TokenAhead(InvalidToken):
    """A token of a state this database has not reached (a copy of it ran ahead)."""


class TokenPending(FreshlineError):
    """The token's transaction has not ended, so no read can be after it yet."""

    def __init__(self, xid: int) -> None:
        self.xid = xid
        super().__init__(
            f"the token's transaction ({xid}) has not committed yet; read after it commits"
        )


@dataclass(frozen=True, slots=True)
class Token:
    """A checked token: its form, and ``a``, ``b`` as the module docstring says."""

    form: int
    a: int
    b: int

    @property
    def rank(self) -> int | None:
        """The rank an entry's watermark must reach, if known without a query."""
        return snapshot_rank(self.a, self.b) if self.form == SNAPSHOT else None


def encode(key: bytes, form: int, a: int, b: int = 0) -> str:
    """The token text of a body, signed with ``key`` (what ``freshline.token()`` makes)."""
    body = bytes([form]) + a.to_bytes(8, "big", signed=True) + b.to_bytes(4, "big", signed=True)
    mac = hmac.new(key, body, hashlib.sha256).digest()[:MAC_BYTES]
    return base64.urlsafe_b64encode(body + mac).decode()


def decode(key: bytes, text: object) -> Token:
    """The token ``text`` names; :class:`InvalidToken` unless ``key`` signed it."""
    if type(text) is not str or not _SHAPE.fullmatch(text):
        raise InvalidToken(f"not a freshness token ({TOKEN_CHARS} characters of base64url)")
    raw = base64.urlsafe_b64decode(text)
    body, mac = raw[:BODY_BYTES], raw[BODY_BYTES:]
    if not hmac.compare_digest(mac, hmac.new(key, body, hashlib.sha256).digest()[:MAC_BYTES]):
        raise ForeignToken("not a freshness token of this database")
    form = body[0]
    a = int.from_bytes(body[1:9], "big", signed=True)
    b = int.from_bytes(body[9:13], "big", signed=True)
    if a < 0 or b < 0 or form not in (SNAPSHOT, TRANSACTION) or (form == TRANSACTION and b):
        raise ForeignToken("a freshness token of an unknown form")  # a newer freshline's?
    return Token(form, a, b)


_RESOLVE = sa.text(
    """
    SELECT pg_visible_in_snapshot(x.id, cur.s) AS ended,
           pg_snapshot_xmax(cur.s)::text::bigint AS xmax,
           (SELECT count(*) FROM pg_snapshot_xip(cur.s)) AS running,
           pg_xact_status(x.id) AS status  -- raises for an id not issued yet
    FROM (SELECT CAST(CAST(:xid AS text) AS xid8) AS id) AS x,
         (SELECT pg_current_snapshot() AS s) AS cur
    """
)
_IN_THE_FUTURE = "22023"  # pg_xact_status: "transaction ID ... is in the future"


class Tokens:
    """Checks tokens against one database's key and ranks them (module docstring).

    ``engine`` is the primary's: a transaction token is ranked by a snapshot of it, and
    the rank shared through ``client`` (the feature store's Redis) when given. The key
    is read once, by :meth:`load` (a query: call it off an event loop first).
    """

    def __init__(self, engine: Engine, client: redis.Redis | None = None) -> None:
        self.engine = engine
        self.client = client
        self._key: bytes | None = None
        self._ranks: OrderedDict[int, int] = OrderedDict()
        self._parsed: OrderedDict[str, Token] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def loaded(self) -> bool:
        return self._key is not None

    def load(self) -> bytes:
        """The key, read on the first call."""
        if self._key is not None:
            return self._key
        try:
            with self.engine.connect() as conn:
                key = conn.execute(sa.select(token_key.c.key)).scalar()
        except sa.exc.ProgrammingError as exc:
            raise ConfigError(
                "freshness tokens need freshline's schema at revision 0002 (run "
                f"freshline db upgrade) and SELECT on freshline.token_key: {exc.orig}"
            ) from exc
        if key is None:
            raise ConfigError("freshline.token_key is empty: run freshline db upgrade")
        self._key = bytes(key)
        return self._key

    def parse(self, text: object) -> Token:
        """The token ``text`` names, checked; :class:`InvalidToken` otherwise. The last
        :data:`RESOLVED_LIMIT` tokens checked are remembered (a reader sends one again
        and again), so the MAC is computed once each; only checked ones are kept."""
        if type(text) is str and (token := self._parsed.get(text)) is not None:
            return token
        token = decode(self.load(), text)
        with self._lock:
            self._parsed[cast(str, text)] = token
            if len(self._parsed) > RESOLVED_LIMIT:
                self._parsed.popitem(last=False)
        return token

    def known_rank(self, text: str) -> int | None:
        """The rank of token ``text`` if it was checked before and ranks without a query."""
        token = self._parsed.get(text)
        return None if token is None else self.rank(token)

    def rank(self, token: Token) -> int | None:
        """The token's rank if known without a query: a snapshot token's, or a
        transaction token's ranked before by this process."""
        if token.form == SNAPSHOT:
            return token.rank
        with self._lock:
            rank = self._ranks.get(token.a)
            if rank is not None:
                self._ranks.move_to_end(token.a)
            return rank

    def resolve(self, token: Token) -> int | None:
        """The token's rank, for a transaction token the one shared in Redis or else
        the primary's now (then shared); ``None`` while its transaction has not ended.
        :class:`TokenAhead` for an id this database has not issued yet."""
        rank = self.rank(token)
        if rank is not None:
            return rank
        rank = self._shared(token.a)
        if rank is None:
            rank = self._ranked_now(token)
            if rank is None:
                return None
            rank = self._share(token.a, rank)
        with self._lock:
            self._ranks[token.a] = rank
            if len(self._ranks) > RESOLVED_LIMIT:
                self._ranks.popitem(last=False)
        return rank

    def _shared(self, xid: int) -> int | None:
        if self.client is None:
            return None
        try:
            found = self.client.get(token_rank_key(xid))
        except redis.ResponseError as exc:
            self._unshared(exc)
            return None
        return None if found is None else int(found)

    def _share(self, xid: int, rank: int) -> int:
        """Share ``rank`` unless another reader did first: the rank to use."""
        if self.client is None:
            return rank
        try:
            first = self.client.set(token_rank_key(xid), rank, ex=RANK_TTL_S, nx=True, get=True)
        except redis.ResponseError as exc:
            self._unshared(exc)
            return rank
        return rank if first is None else int(first)

    def _unshared(self, exc: redis.ResponseError) -> None:
        """Ranks stay per process from now on (sound, less precise): a Redis refusal, such
        as NOPERM for a login without ``rank:*`` or SET NX GET on a Redis before 7."""
        log.warning("transaction tokens' ranks are not shared through Redis: %s", exc)
        self.client = None

    def _ranked_now(self, token: Token) -> int | None:
        """The rank of the primary's snapshot now, if it sees the token's transaction ended."""
        try:
            with autocommit(self.engine) as conn:
                row = conn.execute(_RESOLVE, {"xid": token.a}).one()
        except sa.exc.DBAPIError as exc:
            if getattr(exc.orig, "sqlstate", None) == _IN_THE_FUTURE:
                raise TokenAhead(
                    "the token names a transaction this database has not started"
                ) from None
            raise
        if not row.ended:
            return None
        return snapshot_rank(int(row.xmax), int(row.running))


_TOKEN_SQL = "SELECT freshline.token()"  # noqa: S105 -- a query, not a password


def freshline_token(conn: Any) -> str:
    """A freshness token for what ``conn`` has written or seen committed.

    ``conn`` is a SQLAlchemy ``Connection`` or ``Engine``, or a DB-API connection
    (psycopg 3 or 2). Inside a transaction, call it after the writes: the token names
    the transaction, and reads with it wait for its commit. Outside one (right after
    commit), it names a snapshot that sees the commit, which readers check without a
    query; a transaction this call opens to ask is ended again.
    """
    if isinstance(conn, Engine):
        with conn.connect() as c:
            return freshline_token(c)
    if isinstance(conn, Connection):
        opened = not conn.in_transaction()
        token = conn.execute(sa.text(_TOKEN_SQL)).scalar_one()
        if opened:
            conn.rollback()
        return str(token)
    # A DB-API connection: psycopg's transaction status is 0 (IDLE) between transactions.
    status = getattr(getattr(conn, "info", None), "transaction_status", None)
    cursor = conn.cursor()
    try:
        cursor.execute(_TOKEN_SQL)
        (token,) = cursor.fetchone()
    finally:
        cursor.close()
    if status == 0 and not getattr(conn, "autocommit", False):
        conn.rollback()
    return str(token)
