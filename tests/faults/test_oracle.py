"""The oracle has teeth: a case sabotaged on every count fails every check.

One control case runs the workload with two consumers and, meanwhile, breaks each rule
the oracle guards, once: a stale entry that no later write can replace (a), and one
for a user the readers read, which they are then served (e), a record nobody produced
and a record that must be dead-lettered (b), a feature key without a TTL (c), and a
consumer killed behind the scenario's back (d). If any check stayed quiet, the
suite's passes would mean nothing.
"""

from __future__ import annotations

import os
import signal

import orjson
import pytest

from freshline.consumers.kafka import Producer
from freshline.pipeline.core.codec import encode_entry
from freshline.pipeline.core.keys import feature_key
from freshline.pipeline.core.topics import qualified
from freshline.pipeline.core.types import EntityRef
from freshline.pipeline.dev.chaos import DEFAULT_SEED, SEED_ENV, Profile
from tests.faults.harness import Case, FaultEnv, Run, run_case
from tests.faults.scenarios import Scenario
from tests.helpers import REGISTRY

pytestmark = [pytest.mark.faults, pytest.mark.kafka, pytest.mark.connect, pytest.mark.slow]

CONTROL = "oracle-control"
SEED = int(os.environ.get(SEED_ENV) or DEFAULT_SEED)


def sabotage(run: Run) -> None:
    """Break rules (a) to (e) once each."""
    env, settings = run.env, run.env.settings
    run.workload.wait_for(run.at(0.3, 0.4))
    tenant, entity = sorted(run.workload.touched)[0]
    fs = REGISTRY["txn_90d"]
    # (a) A wrong entry under the highest watermark: no write can ever replace it.
    wrong = encode_entry([-1] * len(fs.fields), settings.schema_version, 0, (1 << 120) - 1)
    # (e) The same for a user the readers read: a value no moment of the case had.
    for t, e in {(tenant, entity), run.workload.watched[0]}:
        env.redis.set(
            feature_key(settings.schema_version, EntityRef(fs.name, t, e)), wrong, px=3_600_000
        )
    # (c) A feature key without a TTL.
    env.redis.set(
        feature_key(settings.schema_version, EntityRef("geo", tenant, "999999")),
        encode_entry(["XX", "Nowhere", 5], settings.schema_version, 0, 1),
    )
    # (b) A record the workload did not produce, and one that cannot be decoded.
    with Producer(settings) as producer:
        topic = qualified(settings, "transaction.updated")
        producer.produce(
            topic, orjson.dumps({"tenant": tenant, "user_id": int(entity), "transaction_id": 1})
        )
        producer.produce(topic, b"{not json")
    # (d) A consumer dies, and the scenario does not say so.
    victim = run.pick_member()
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(timeout=30)
    run.note(
        f"sabotage: stale entry for {entity}, TTL-less key, 2 foreign records, {victim.name} killed"
    )


@pytest.mark.parametrize("case", [(CONTROL, SEED)], ids=[f"{CONTROL}-seed{SEED}"])
def test_every_check_fires_on_a_sabotaged_case(
    case: Case, fault_env: FaultEnv, faults_profile: Profile
) -> None:
    control = Scenario(CONTROL, sabotage, consumers=2, description="sabotage")
    result = run_case(
        fault_env,
        control,
        case[1],
        faults_profile,
        fault_env.stack.directory / f"{CONTROL}-seed{case[1]}",
    )
    # The TTL-less key would fail check (c) of every later case on this stack.
    for key in fault_env.redis.scan_iter(match="feat:*:geo:*:999999}"):
        fault_env.redis.delete(key)
    fired = {f[:3] for f in result.failures}
    assert {"(a)", "(b)", "(c)", "(d)", "(e)"} <= fired, "\n".join(result.failures)
    assert result.readers["mismatches"] > 0, result.readers
    assert result.mismatches >= 2  # the stale entry and the foreign key
    assert any("unexpected dead letters" in f for f in result.failures), result.failures
    assert any("the workload produced" in f for f in result.failures), result.failures
