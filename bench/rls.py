"""Row-level security by tenant: what it costs the feature queries.

The question (issue 14): would a Postgres policy ``tenant_id = <the caller's tenants>``
on the source tables, as a second guard behind the key scheme, cost the feature
queries under 10%?

In the run's own database the source tables get that policy, and a role of this
benchmark (subject to it, ``SELECT`` only) reads with the tenant list in a session
setting (``freshline.tenants``, given at connect). The owner bypasses the policy, so
the same :func:`freshline.pipeline.cache.recompute.compute` runs on two engines, interleaved,
alternating which goes first: a batch of 500 users and one user, per feature set.
Reported: medians and the ratio with RLS against without (1.10 is the 10% line).
The policy and the role are dropped afterwards.
"""

from __future__ import annotations

import functools
import os
import random
import uuid
from typing import Any

import numpy as np
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from bench import common
from freshline.pipeline.cache.recompute import compute
from tests.helpers import REGISTRY

BATCH = 500
TABLES = (
    "users",
    "transactions",
    "devices",
    "user_devices",
    # and txn_90d's derived partials, in freshline's schema
    *(t for path in REGISTRY.maintenances() for t in getattr(path, "tables", [])),
)
POLICY = "tenant_id = ANY (string_to_array(current_setting('freshline.tenants', true), ','))"


def run(quick: bool) -> dict[str, Any]:
    ctx = common.context(quick)
    data = ctx.dataset()
    rng = random.Random(14)
    rounds = 1 if quick else 9
    role, password = f"freshline_bench_rls_{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    # Roles are made by the superuser: the stack's owner may not.
    login = make_url(os.environ.get("FRESHLINE_STACK_POSTGRES_SUPERUSER_URL") or ctx.engine.url)
    superuser = sa.create_engine(
        ctx.engine.url.set(username=login.username, password=login.password),
        poolclass=sa.pool.NullPool,
    )
    with superuser.begin() as conn:
        conn.execute(sa.text(f"CREATE ROLE {role} LOGIN PASSWORD '{password}'"))
    with ctx.engine.begin() as conn:
        conn.execute(sa.text(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}"))
        conn.execute(sa.text(f"GRANT USAGE ON SCHEMA freshline TO {role}"))
        for table in TABLES:
            conn.execute(sa.text(f"GRANT SELECT ON {table} TO {role}"))
            conn.execute(sa.text(f"ALTER TABLE {table} ENABLE ROW LEVEL SECURITY"))
            conn.execute(sa.text(f"CREATE POLICY tenant_guard ON {table} USING ({POLICY})"))
    url = make_url(ctx.settings.postgres_url).set(username=role, password=password)
    rls = sa.create_engine(
        url, pool_size=2, connect_args={"options": f"-c freshline.tenants={data.tenant}"}
    )
    out: dict[str, Any] = {}
    try:
        with rls.connect() as conn:  # the guard holds: another tenant's rows are invisible
            seen = conn.execute(sa.text("SELECT count(DISTINCT tenant_id) FROM transactions"))
            out["tenants_visible_with_rls"] = seen.scalar_one()
        for fs in REGISTRY:
            times: dict[str, list[float]] = {
                k: [] for k in ("batch", "batch_rls", "one", "one_rls")
            }
            for r in range(rounds):
                users = [
                    (data.tenant, str(u)) for u in rng.sample(range(1, data.users + 1), BATCH + 1)
                ]
                runs = [
                    ("batch", ctx.engine, users[:BATCH]),
                    ("batch_rls", rls, users[:BATCH]),
                    ("one", ctx.engine, users[BATCH:]),
                    ("one_rls", rls, users[BATCH:]),
                ]
                if r % 2:
                    runs = [runs[1], runs[0], runs[3], runs[2]]
                found: dict[str, int] = {}
                for name, engine, refs in runs:
                    result, took = common.timed(functools.partial(compute, engine, fs, refs))
                    found[name] = len(result.values)
                    times[name].append(took * 1000)
                if found["batch"] != found["batch_rls"] or found["one"] != found["one_rls"]:
                    raise RuntimeError(f"{fs.name}: the policy hid rows of the own tenant")
            med = {k: float(np.median(v)) for k, v in times.items()}
            out[fs.name] = {
                "batch_ms": round(med["batch"], 2),
                "batch_rls_ms": round(med["batch_rls"], 2),
                "batch_ratio": common.ratio(med["batch_rls"], med["batch"]),
                "one_ms": round(med["one"], 2),
                "one_rls_ms": round(med["one_rls"], 2),
                "one_ratio": common.ratio(med["one_rls"], med["one"]),
            }
    finally:
        rls.dispose()
        with ctx.engine.begin() as conn:
            for table in TABLES:
                conn.execute(sa.text(f"DROP POLICY IF EXISTS tenant_guard ON {table}"))
                conn.execute(sa.text(f"ALTER TABLE {table} DISABLE ROW LEVEL SECURITY"))
            conn.execute(sa.text(f"REVOKE ALL ON ALL TABLES IN SCHEMA public FROM {role}"))
            for table in TABLES:
                conn.execute(sa.text(f"REVOKE ALL ON {table} FROM {role}"))
            conn.execute(sa.text(f"REVOKE USAGE ON SCHEMA freshline FROM {role}"))
        with superuser.begin() as conn:
            conn.execute(sa.text(f"DROP ROLE {role}"))
        superuser.dispose()
    return out


def markdown(res: dict[str, Any]) -> str:
    rows = [
        (
            name,
            r["batch_ms"],
            r["batch_rls_ms"],
            common.fmt(r["batch_ratio"], 3),
            r["one_ms"],
            r["one_rls_ms"],
            common.fmt(r["one_ratio"], 3),
        )
        for name, r in res.items()
        if isinstance(r, dict)
    ]
    return "\n".join(
        [
            "## rls: row-level security by tenant on the feature queries",
            "",
            f"`compute()` as the owner (no policy) and as a role under a tenant policy, "
            f"interleaved; medians in ms, batch of {BATCH} users and one user.",
            "",
            common.table(
                ["feature set", "batch", "batch, RLS", "ratio", "one", "one, RLS", "ratio"], rows
            ),
        ]
    )
