"""The harness's undoing of a deploy between cases (:func:`tests.faults.injectors.reset_deploy`).

The cases of a chaos run share one Redis, and every tenant's entries in it: the next
case must not be served entries of a version that stopped being written. On the real
Redis and Postgres with a private pointer, versions of their own and an in-memory lock,
as in ``tests/pipeline/deploy``.
"""

from __future__ import annotations

from freshline.pipeline.cache.store import EntryStore
from freshline.pipeline.cache.versions import state
from freshline.pipeline.core.keys import feature_pattern, source_key
from freshline.pipeline.deploy.pointer import flip, retire, start
from freshline.pipeline.deploy.purge import purge
from tests.faults.injectors import reset_deploy
from tests.helpers import REGISTRY
from tests.pipeline.deploy.test_deploy import Deploy, fill, module_tenant, world
from tests.pipeline.deploy.test_markers import assert_not_deployable

__all__ = ["module_tenant", "world"]  # the fixtures of tests/pipeline/deploy's deploy world


def test_a_version_a_forced_purge_left_stale_is_emptied_before_it_is_active_again(
    world: Deploy,
) -> None:
    """deploy-under-load's end: B active, A purged with --force. A consumer's batch in
    flight wrote A after the purge's scan; nothing writes A after that, so the marker
    keeps A from being deployed. The reset makes A active again: not with that entry."""
    r, s, p, lock = world.redis, world.settings, world.pointer, world.lock
    start(r, s, world.b, lock, pointer=p)
    flip(r, s, world.b, lock, pointer=p, registry=REGISTRY)
    retire(r, s, world.a, lock, pointer=p, registry=REGISTRY)  # what `purge --force` does first
    assert purge(r, s, world.a, pointer=p).done
    fill(
        EntryStore(r, world.a, registry=REGISTRY), world.engine, world.tenant, 3
    )  # landed after the scan
    r.set(source_key(world.a), "landed too")
    fill(EntryStore(r, world.b, registry=REGISTRY), world.engine, world.tenant, 3)
    assert_not_deployable(world, world.a)

    assert reset_deploy(r, s, pointer=p) == {world.a: 3, world.b: 3}

    assert state(r, s, pointer=p).active_raw == ""
    assert state(r, s, pointer=p).active == world.a
    assert world.count(feature_pattern(world.a)) == 0
    assert world.count(feature_pattern(world.b)) == 0
    assert not r.exists(p.retired_key(world.a), p.retired_key(world.b), source_key(world.a))
    assert reset_deploy(r, s, pointer=p) is None


def test_the_settings_version_written_all_along_keeps_its_entries(world: Deploy) -> None:
    """A deploy of B started and left: A stayed active and written, B goes."""
    r, s, p = world.redis, world.settings, world.pointer
    start(r, s, world.b, world.lock, pointer=p)
    fill(EntryStore(r, world.a, registry=REGISTRY), world.engine, world.tenant, 3)
    fill(EntryStore(r, world.b, registry=REGISTRY), world.engine, world.tenant, 3)

    assert reset_deploy(r, s, pointer=p) == {world.b: 3}

    assert world.count(feature_pattern(world.a)) == 3
    assert world.count(feature_pattern(world.b)) == 0
    for key in r.scan_iter(match=feature_pattern(world.a), count=1000):
        r.unlink(key)
