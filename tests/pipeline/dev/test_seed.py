from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import CursorResult, Engine
from typer.testing import CliRunner

from fraud.cli import app
from fraud.seed import SeedSummary, TenantsExist, seed
from freshline.pipeline.core.settings import Settings
from tests.helpers import ANCHOR, cli, error_line


def _profile(engine: Engine, tenant: str) -> list[tuple[object, ...]]:
    with engine.connect() as conn:
        return [
            tuple(r)
            for r in conn.execute(
                sa.text(
                    """SELECT user_id, count(*), sum(amount), count(DISTINCT merchant_id),
                      min(created_at), max(host(ip))
               FROM transactions WHERE tenant_id = :t GROUP BY user_id ORDER BY user_id"""
                ),
                {"t": tenant},
            )
        ]


def test_same_seed_gives_the_same_rows(
    tenant_factory: Callable[..., SeedSummary], engine: Engine
) -> None:
    a = tenant_factory(users=40, transactions=1500, seed_value=9)
    b = tenant_factory(users=40, transactions=1500, seed_value=9)
    c = tenant_factory(users=40, transactions=1500, seed_value=10)
    assert _profile(engine, a.tenants[0]) == _profile(engine, b.tenants[0])
    assert _profile(engine, a.tenants[0]) != _profile(engine, c.tenants[0])


def test_seeded_data_has_the_shape_of_production(
    tenant_factory: Callable[..., SeedSummary], engine: Engine
) -> None:
    summary = tenant_factory(users=400, transactions=20000)
    tenant = summary.tenants[0]
    with engine.connect() as conn:

        def q(sql: str) -> CursorResult[*tuple[Any, ...]]:
            return conn.execute(sa.text(sql), {"t": tenant})

        per_user = [
            r[0]
            for r in q(
                "SELECT count(*) FROM transactions WHERE tenant_id = :t "
                "GROUP BY user_id ORDER BY 1 DESC"
            )
        ]
        assert sum(per_user) == 20000
        # Skewed: the busiest 5% of users own far more than 5% of transactions.
        top = per_user[: max(1, len(per_user) // 20)]
        assert sum(top) > 0.25 * 20000
        # Every IP falls inside a geoip range.
        outside = q(
            """SELECT count(*) FROM transactions x WHERE x.tenant_id = :t AND NOT EXISTS (
                 SELECT 1 FROM geoip g WHERE x.ip BETWEEN g.ip_from AND g.ip_to)"""
        ).scalar_one()
        assert outside == 0
        # Some devices are shared between users.
        shared = q(
            """SELECT count(*) FROM (SELECT device_id FROM user_devices WHERE tenant_id = :t
                 GROUP BY device_id HAVING count(*) > 1) s"""
        ).scalar_one()
        assert shared > 0
        # Timestamps spread over the last 120 days before the anchor.
        lo, hi = q(
            "SELECT min(created_at), max(created_at) FROM transactions WHERE tenant_id = :t"
        ).one()
        assert (ANCHOR - hi).days < 2
        assert 100 <= (ANCHOR - lo).days <= 120
        # Log-normal amounts: mean well above the median.
        mean, median = q(
            "SELECT avg(amount), percentile_cont(0.5) WITHIN GROUP (ORDER BY amount) "
            "FROM transactions WHERE tenant_id = :t"
        ).one()
        assert float(mean) > 1.3 * float(median)
        # Many merchants.
        assert (
            q(
                "SELECT count(DISTINCT merchant_id) FROM transactions WHERE tenant_id = :t"
            ).scalar_one()
            > 2000
        )


def _counts(engine: Engine, tenants: list[str]) -> dict[str, int]:
    with engine.connect() as conn:
        return {
            table: conn.execute(
                sa.text(
                    f"SELECT count(*) FROM {table} WHERE "
                    f"{'id' if table == 'freshline.tenants' else 'tenant_id'} = ANY(:t)"
                ),
                {"t": tenants},
            ).scalar_one()
            for table in ("freshline.tenants", "users", "devices", "transactions")
        }


@pytest.fixture
def seeded(tenant_factory: Callable[..., SeedSummary]) -> tuple[str, str]:
    """A freshly seeded ``<prefix>acme``: ``(prefix, tenant)``."""
    tenant = tenant_factory(users=10, transactions=100).tenants[0]
    return tenant.removesuffix("acme"), tenant


def test_seeding_a_tenant_again_is_refused_and_writes_nothing(
    engine: Engine, seeded: tuple[str, str]
) -> None:
    prefix, tenant = seeded
    new = f"{prefix}globex"  # the second tenant of the same run: it must not appear either
    before = _counts(engine, [tenant, new])
    with pytest.raises(TenantsExist) as refused:
        seed(engine, users=20, transactions=200, tenants=2, tenant_prefix=prefix)
    assert refused.value.tenants == [tenant]
    assert tenant in str(refused.value) and "--tenant-prefix" in str(refused.value)
    assert _counts(engine, [tenant, new]) == before


def test_the_cli_refuses_in_one_line_without_a_traceback(
    settings: Settings, seeded: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix, tenant = seeded
    args = ["seed", "--users", "10", "--transactions", "100", "--tenant-prefix", prefix]
    env = {"FRESHLINE_POSTGRES_URL": settings.postgres_url}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1
    assert isinstance(result.exception, TenantsExist)  # main() prints it as one line
    assert "--tenant-prefix" in str(result.exception)
    assert "Traceback" not in result.output
    # The installed command, through main(): one line on stderr, exit status 1.
    line = error_line(cli("fraud", *args, **env))
    assert tenant in line and "--tenant-prefix" in line
