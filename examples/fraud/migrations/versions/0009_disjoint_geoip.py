"""geoip ranges are disjoint: an exclusion constraint refuses a range that overlaps another.

The country of an IP is that of the range with the greatest ``ip_from`` at or below
it, if the IP is within that range's ``ip_to`` (``features._GEO_OF``). A CDC event
of a range recomputes the users with an IP in it (the ``geoip`` table's reverse
lookup), which assumes that a range decides the country of its own IPs only. With
ranges inside others that does not hold: a range inserted within another takes the
IPs between its end and the outer range's end out of the outer range (they fall into
no range), and nothing reaches their users, so the served entries stay wrong. With
disjoint ranges an IP is in one range or none, and a change of a range changes the
countries of its own IPs only.

Postgres has no range type over ``inet``; ``inetrange`` is one (ordered as ``inet``
is, the order the lookup uses), and the constraint excludes two rows whose closed
ranges ``[ip_from, ip_to]`` share an address. A range type needs no extension and no
superuser. A database whose ranges overlap already is refused, with the first pairs
named, before any change.

Revision ID: 0009
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from freshline import ConfigError

revision = "0009"
down_revision = "0005"
branch_labels = None
depends_on = None

_SHOWN = 5
"""Overlapping pairs that a refused upgrade names."""


def _overlaps() -> list[tuple[str, str, str, str]]:
    rows = op.get_bind().execute(
        sa.text(
            "SELECT host(a.ip_from), host(a.ip_to), host(b.ip_from), host(b.ip_to) "
            "FROM geoip a JOIN geoip b ON a.ip_from < b.ip_from AND b.ip_from <= a.ip_to "
            "ORDER BY a.ip_from, b.ip_from LIMIT :n"
        ),
        {"n": _SHOWN},
    )
    return [(r[0], r[1], r[2], r[3]) for r in rows]


def upgrade() -> None:
    overlaps = _overlaps()
    if overlaps:
        pairs = "; ".join(f"{a}-{b} and {c}-{d}" for a, b, c, d in overlaps)
        raise ConfigError(
            f"geoip has overlapping ranges ({pairs}{'; ...' if len(overlaps) == _SHOWN else ''})"
            ": an IP's country must come from one range; make them disjoint and upgrade again"
        )
    op.execute("CREATE TYPE inetrange AS RANGE (subtype = inet)")
    op.execute(
        "ALTER TABLE geoip ADD CONSTRAINT geoip_ranges_disjoint "
        "EXCLUDE USING gist (inetrange(ip_from, ip_to, '[]') WITH &&)"
    )


def downgrade() -> None:
    op.execute("ALTER TABLE geoip DROP CONSTRAINT geoip_ranges_disjoint")
    op.execute("DROP TYPE inetrange")
