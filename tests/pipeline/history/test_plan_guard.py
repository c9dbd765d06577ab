"""With history on, ``plan`` refuses a feature query a training set could not evaluate at
a past moment: one that reads the clock, calls a user function that is not IMMUTABLE, or
reads a table history does not capture."""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from freshline.pipeline.core.repository import load
from freshline.pipeline.deploy.plan import plan

DEFINITIONS = '''
from freshline import Entity, FeatureSet, Field, Table

user = Entity("user", key="user_id", type="bigint", tenant="tenant_id")
transactions = Table("transactions", entities={user: "user_id"})


def counting(name, condition, extra=""):
    return FeatureSet(
        name,
        entity=user,
        ttl="1h",
        sources=[transactions],
        fields=[Field("n", "int")],
        query=f"""
SELECT k.tenant_id, k.user_id, count(x.id) AS n
FROM k CROSS JOIN t
LEFT JOIN transactions x ON x.tenant_id = k.tenant_id AND x.user_id = k.user_id
     AND {condition} {extra}
GROUP BY k.tenant_id, k.user_id
""",
    )


clean = counting("clean", "x.created_at <= t.as_of AND h52_immutable(x.amount) > 0")
# a SQL function Postgres inlines: its now() shows in the plan
hidden = counting("hidden", "x.created_at > h52_today()")
clocked = counting("clocked", "x.created_at > now() - interval '1 day'")
volatile = counting("volatile", "h52_volatile(x.amount) > 0")
uncaptured = counting(
    "uncaptured", "EXISTS (SELECT 1 FROM devices d WHERE d.id = x.device_id)"
)
'''


TODAY = (
    "CREATE OR REPLACE FUNCTION public.h52_today() RETURNS timestamptz "
    "LANGUAGE sql STABLE AS $$SELECT now() - interval '1 day'$$"
)


def repo_dir(tmp_path: Path, history: bool) -> Path:
    tmp_path.mkdir()
    (tmp_path / "freshline.toml").write_text(
        '[project]\nname = "guarded"\nschema_version = 1\ndefinitions = "features.py"\n'
        + ("\n[history]\nenabled = true\n" if history else "")
    )
    (tmp_path / "features.py").write_text(DEFINITIONS)
    return tmp_path


def test_plan_refuses_queries_that_would_leak_with_history_on(
    engine: Engine, tmp_path: Path
) -> None:
    with engine.begin() as conn:
        for kind in ("immutable", "volatile"):
            conn.execute(
                sa.text(
                    f"CREATE OR REPLACE FUNCTION public.h52_{kind}(x numeric) RETURNS numeric "
                    f"LANGUAGE plpgsql {kind.upper()} AS 'BEGIN RETURN x; END'"
                )
            )
        conn.execute(sa.text(TODAY))
    try:
        on = plan(load(repo_dir(tmp_path / "on", True)), engine, 1, "freshline").problems
        off = plan(load(repo_dir(tmp_path / "off", False)), engine, 1, "freshline").problems
    finally:
        with engine.begin() as conn:
            for kind in ("immutable", "volatile"):
                conn.execute(sa.text(f"DROP FUNCTION public.h52_{kind}(numeric)"))
            conn.execute(sa.text("DROP FUNCTION public.h52_today()"))
    assert off == []
    assert len(on) == 4, on
    assert "feature set 'hidden': with history on, the query may not read the clock" in on[0]
    assert (
        "feature set 'clocked': with history on, the query may not read the clock (now()" in on[1]
    )
    assert "feature set 'volatile'" in on[2] and "public.h52_volatile is not" in on[2]
    assert "feature set 'uncaptured'" in on[3] and "it reads public.devices" in on[3]
