"""The learned decision in the cache, on the real Redis: serve only under the bound,
learn from explorations and flags, keep tenants and namespaces apart, stay bounded.

Prompts are placed at exact similarities to a cached one with a table of synthetic
vectors (:class:`Table`): the decision only sees similarities, and the embedding
model would only blur them. Draws are fixed (:class:`Draws`) or seeded.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Sequence
from typing import cast

import numpy as np
import pytest
import redis

from freshline.pipeline.core.keys import (
    semantic_entry_key,
    semantic_outcomes_key,
    semantic_pattern,
    semantic_probes_key,
)
from freshline.pipeline.semantic import decision, prior
from freshline.pipeline.semantic.cache import Scope, SemanticCache
from freshline.pipeline.semantic.decision import MAX_OUTCOMES, Learned
from freshline.pipeline.semantic.entry import entry_id
from freshline.pipeline.semantic.feedback import (
    MAX_PAIRED,
    PROBE_TTL_MS,
    Probe,
    Probes,
    decode_pairs,
    encode_pairs,
    pairs_key,
    same_response,
)
from freshline.pipeline.semantic.namespaces import purge_namespace, stats

DIM = 256
ZERO = {"temperature": 0}
BASE = "How do I reset my password"
ANSWER = "Open Settings, then Security, then Reset password."


class Table:
    """An embedder of registered texts: :meth:`at` places a text at an exact cosine
    similarity to :data:`BASE`, along a direction of its own."""

    name = "table"
    dim = DIM

    def __init__(self) -> None:
        self.vectors: dict[str, np.ndarray] = {}
        self.at(BASE, 1.0)

    def at(self, text: str, similarity: float) -> str:
        v = np.zeros(DIM, dtype=np.float32)
        v[0] = similarity
        v[1 + len(self.vectors)] = np.sqrt(max(0.0, 1 - similarity**2))
        self.vectors[text] = v
        return text

    def embed(self, texts: Sequence[str], /) -> np.ndarray:
        return np.stack([self.vectors[t] for t in texts])


class Draws(random.Random):
    """Exploration draws fixed at ``value``: 0 explores whenever allowed, 1 never."""

    def __init__(self, value: float) -> None:
        super().__init__(0)
        self.value = value

    def random(self) -> float:
        return self.value


EXPLORE, NEVER = Draws(0.0), Draws(0.999999)


@pytest.fixture
def learned() -> Learned:
    shipped = prior.shipped("all-MiniLM-L6-v2")
    assert shipped is not None
    return Learned(shipped, max_error=0.02)


@pytest.fixture
def table() -> Table:
    return Table()


@pytest.fixture
def cache(
    redis_client: redis.Redis, table: Table, learned: Learned, made: list[SemanticCache]
) -> SemanticCache:
    c = SemanticCache(redis_client, table, ttl_s=600, decision=learned, rng=NEVER)
    made.append(c)
    return c


@pytest.fixture
def scope() -> Scope:
    return Scope(f"t{uuid.uuid4().hex[:12]}", "support-bot", "v1", "t1")


def base_id() -> str:
    return f"{entry_id(BASE):016x}"


def test_an_entry_is_served_only_within_the_bound(
    cache: SemanticCache, table: Table, scope: Scope, learned: Learned
) -> None:
    cache.store(scope, BASE, ZERO, ANSWER)
    above = cache.lookup(scope, table.at("reset my password, how", learned.start + 0.01), ZERO)
    assert above.hit and above.response == ANSWER and above.entry_id == base_id()
    assert above.estimated_error is not None and above.estimated_error <= 0.02
    assert above.threshold == learned.start
    below = cache.lookup(scope, table.at("password help", learned.start - 0.01), ZERO)
    assert not below.hit and below.candidate_id is None  # NEVER explores
    assert below.threshold == learned.start
    # No fixed 0.93: a fresh MiniLM entry starts where the model's prior puts it.
    assert cache.threshold_for("support-bot") == learned.start < 0.93


def test_explorations_labelled_by_stores_lower_the_line(
    cache: SemanticCache, table: Table, scope: Scope, learned: Learned
) -> None:
    # Entries that differ only in a number share what is learned for a wording.
    for n in range(1, 7):
        cache.store(
            scope, table.at(f"How do I reset the password of account {n}", 1.0), ZERO, f"A{n}"
        )
    cache.rng = EXPLORE
    thresholds = []
    for n in range(1, 5):
        prompt = table.at(f"I forgot the password of account {n}", 0.81)
        miss = cache.lookup(scope, prompt, ZERO)
        assert not miss.hit and miss.candidate_id is not None
        thresholds.append(miss.threshold)
        # The caller does what it always does on a miss: ask its model, store.
        stored = cache.store(scope, prompt, ZERO, f"a{n}  ")
        assert stored.agreed is True  # the same answer, once normalised
    assert thresholds[0] == learned.start
    assert thresholds == sorted(thresholds, reverse=True) and thresholds[-1] < 0.85
    cache.rng = NEVER
    hit = cache.lookup(scope, table.at("I forgot the password of account 5", 0.81), ZERO)
    assert hit.hit and hit.response == "A5" and hit.threshold <= 0.81
    # Another wording learned nothing yet: still the prior's line.
    other = cache.lookup(scope, table.at("Account 5 password lost", 0.81), ZERO)
    assert not other.hit and other.threshold == learned.start
    # A would-be hit may be audited: a miss naming it, labelled by the store.
    cache.rng = EXPLORE
    audit = table.at("I forgot the password of account 6", 0.81)
    audited = cache.lookup(scope, audit, ZERO)
    assert not audited.hit and audited.audit and audited.candidate_id is not None
    assert cache.store(scope, audit, ZERO, "Ask your administrator.").agreed is False
    cache.close()
    [row] = stats(cache.redis, scope.tenant)
    assert (row.counts["explored"], row.counts["right"], row.counts["wrong"]) == (5, 4, 1)
    assert (row.counts["audited"], row.counts["audit_wrong"], row.audited_error) == (1, 1, 1.0)
    assert row.estimated_error is not None and 0 < row.estimated_error <= 0.02


def test_disagreeing_stores_raise_the_line(
    cache: SemanticCache, table: Table, scope: Scope, learned: Learned
) -> None:
    cache.store(scope, BASE, ZERO, ANSWER)
    served = table.at("reset password steps", learned.start + 0.02)
    assert cache.lookup(scope, served, ZERO).hit
    cache.rng = EXPLORE
    for word in ("email", "username"):
        prompt = table.at(f"How do I reset my {word}", 0.87)
        miss = cache.lookup(scope, prompt, ZERO)
        assert miss.candidate_id == base_id()
        assert cache.store(scope, prompt, ZERO, f"Open Settings, then {word}.").agreed is False
    cache.rng = NEVER
    assert not cache.lookup(scope, served, ZERO).hit  # no longer within the bound there
    assert learned.threshold(outcomes_of(cache, scope)) > learned.start + 0.02
    cache.close()
    [row] = stats(cache.redis, scope.tenant)
    assert (row.counts["right"], row.counts["wrong"]) == (0, 2)


def outcomes_of(cache: SemanticCache, scope: Scope) -> decision.Outcomes:
    return decision.decode(raw(cache.redis, semantic_outcomes_key(scope.namespace, entry_id(BASE))))


def raw(client: redis.Redis, key: str) -> bytes | None:
    return cast(bytes | None, client.get(key))


def test_a_flagged_entry_stops_being_served_for_similar_prompts(
    cache: SemanticCache, table: Table, scope: Scope
) -> None:
    cache.store(scope, BASE, ZERO, ANSWER)
    wrong = table.at("reset the admin password", 0.90)
    hit = cache.lookup(scope, wrong, ZERO)
    assert hit.hit and hit.entry_id is not None
    flagged = cache.flag_for(scope, hit.entry_id, wrong)
    assert not flagged.removed and flagged.similarity == pytest.approx(0.90)
    assert flagged.threshold is not None and flagged.threshold > 0.92
    assert not cache.lookup(scope, wrong, ZERO).hit
    assert not cache.lookup(scope, table.at("reset the root password", 0.91), ZERO).hit
    # Closer prompts still get it; the entry's own prompt always does.
    assert cache.lookup(scope, table.at("reset my password please", 0.99), ZERO).hit
    assert cache.lookup(scope, BASE, ZERO).hit
    cache.close()
    [row] = stats(cache.redis, scope.tenant)
    assert row.counts["flagged"] == 1 and row.observed_error == pytest.approx(1 / 3)


def test_a_flag_on_the_entrys_own_prompt_removes_it(
    cache: SemanticCache, scope: Scope, redis_client: redis.Redis
) -> None:
    cache.store(scope, BASE, ZERO, ANSWER)
    flagged = cache.flag_for(scope, base_id(), BASE)
    assert flagged.removed and flagged.threshold is None
    assert redis_client.get(semantic_entry_key(scope.namespace, entry_id(BASE))) is None
    assert not cache.lookup(scope, BASE, ZERO).hit
    assert cache.flag_for(scope, base_id(), BASE) == type(flagged)(False)  # gone: counted


def test_numbers_still_decide_and_nothing_else_is_labelled(
    cache: SemanticCache, table: Table, scope: Scope
) -> None:
    table.vectors["Refund order 124"] = table.vectors["Refund order 123"] = table.vectors[BASE]
    cache.store(scope, "Refund order 123", ZERO, "Refunded.")
    cache.rng = EXPLORE
    other = cache.lookup(scope, "Refund order 124", ZERO)
    assert not other.hit and other.candidate_id is None  # never a candidate, never labelled
    assert other.similarity == pytest.approx(1.0)
    cache.store(scope, BASE, ZERO, ANSWER)
    hot = {"temperature": 0.7}
    with pytest.raises(Exception, match="not deterministic"):
        cache.lookup(scope, "Refund order 123", hot)
    # A store with other parameters does not label a candidate explored under these.
    prompt = table.at("Give me back my money", 0.80)
    assert cache.lookup(scope, prompt, ZERO).candidate_id is not None
    assert cache.store(scope, prompt, {"temperature": 0, "max_tokens": 9}, "x").agreed is None


def test_tenants_and_namespaces_keep_their_labels_apart(
    redis_client: redis.Redis,
    table: Table,
    learned: Learned,
    made: list[SemanticCache],
    scope: Scope,
) -> None:
    c = SemanticCache(redis_client, table, ttl_s=600, decision=learned, rng=EXPLORE)
    made.append(c)
    other_tenant = Scope(f"t{uuid.uuid4().hex[:12]}", "support-bot", "v1", "t1")
    other_template = Scope(scope.tenant, "support-bot", "v1", "t2")
    for s in (scope, other_tenant, other_template):
        c.store(s, BASE, ZERO, ANSWER)
    prompt = table.at("I forgot my password", 0.80)
    assert c.lookup(scope, prompt, ZERO).candidate_id == base_id()
    # The same prompt stored elsewhere answers no exploration of this namespace.
    assert c.store(other_tenant, prompt, ZERO, ANSWER).agreed is None
    assert c.store(other_template, prompt, ZERO, ANSWER).agreed is None
    assert c.store(scope, prompt, ZERO, ANSWER).agreed is True
    for s, n in ((scope, 1), (other_tenant, 0), (other_template, 0)):
        labels = raw(redis_client, semantic_outcomes_key(s.namespace, entry_id(BASE)))
        assert len(decision.decode(labels)) == n
        # The template pairs too: one namespace's hash, no other's.
        assert bool(redis_client.exists(pairs_key(s.namespace))) == bool(n)


def test_explorations_are_repeatable_with_a_seed(
    redis_client: redis.Redis, table: Table, learned: Learned, made: list[SemanticCache]
) -> None:
    runs = []
    for _ in range(2):
        s = Scope(f"t{uuid.uuid4().hex[:12]}", "support-bot", "v1", "t1")
        c = SemanticCache(redis_client, table, ttl_s=600, decision=learned, rng=random.Random(7))
        made.append(c)
        c.store(s, BASE, ZERO, ANSWER)
        seen = []
        for i, sim in enumerate(np.linspace(0.6, 0.95, 15)):
            found = c.lookup(s, table.at(f"question {chr(97 + i)}", float(sim)), ZERO)
            seen.append((found.hit, found.candidate_id))
        runs.append(seen)
    assert runs[0] == runs[1]
    assert any(cid for _, cid in runs[0]) and any(hit for hit, _ in runs[0])


def test_memory_is_bounded(
    cache: SemanticCache, table: Table, scope: Scope, redis_client: redis.Redis
) -> None:
    ns = scope.namespace
    # Probes: at most max_probes per namespace, under a TTL; more answer a plain miss.
    probes = Probes(redis_client, max_probes=3)
    probe = Probe(1, 0.8, False, 2**62, "d")
    assert all(probes.put(ns, i, probe) for i in range(3))
    assert not probes.put(ns, 99, probe)
    assert probes.put(ns, 2, probe)  # one already there may be replaced
    assert redis_client.hlen(semantic_probes_key(ns)) == 3
    assert 0 < redis_client.pttl(semantic_probes_key(ns)) <= PROBE_TTL_MS
    cache.probes = probes
    cache.rng = EXPLORE
    cache.store(scope, BASE, ZERO, ANSWER)
    full = cache.lookup(scope, table.at("I forgot my password", 0.80), ZERO)
    assert not full.hit and full.candidate_id is None
    # Outcomes: the newest MAX_OUTCOMES per entry, under the entries' TTL.
    key = semantic_outcomes_key(ns, entry_id(BASE))
    for i in range(MAX_OUTCOMES + 10):
        cache.flag_for(scope, base_id(), table.at(f"wrong {chr(97 + i % 26)}{i // 26}", 0.5))
    assert len(decision.decode(raw(redis_client, key))) == MAX_OUTCOMES
    assert len(raw(redis_client, key) or b"") == 1 + 2 * MAX_OUTCOMES
    assert 0 < redis_client.pttl(key) <= 600_000
    # Every key of the namespace has a TTL, and a purge takes the new ones too.
    for k in redis_client.scan_iter(match=semantic_pattern(scope.tenant), count=500):
        assert redis_client.pttl(k) > 0, k
    purge_namespace(redis_client, ns)
    assert redis_client.get(key) is None
    assert not redis_client.exists(semantic_probes_key(ns))


def test_eviction_and_flags_take_an_entrys_outcomes(
    cache: SemanticCache, scope: Scope, table: Table, redis_client: redis.Redis
) -> None:
    cache.store(scope, BASE, ZERO, ANSWER)
    key = semantic_outcomes_key(scope.namespace, entry_id(BASE))
    cache.flag_for(scope, base_id(), table.at("wrong one", 0.5))
    assert redis_client.exists(key)
    assert cache.flag(scope, base_id())
    assert not redis_client.exists(key)


def test_answers_agree_only_when_equal_once_normalised() -> None:
    assert same_response("Yes.", "yes")
    assert same_response("Open  Settings\n then Security!", "open settings then security")
    assert same_response("\uff21\uff22\uff23", "abc")  # full-width letters, NFKC
    assert not same_response("Yes, you can.", "No, you can't.")
    assert not same_response("Refund for order 123.", "Refund for order 124.")


def test_a_flag_teaches_every_entity_with_the_same_wording(
    cache: SemanticCache, table: Table, scope: Scope
) -> None:
    for n in (1, 2):
        cache.store(scope, table.at(f"Move account {n} up to a bigger plan", 1.0), ZERO, f"U{n}")
    down = [table.at(f"Move account {n} down to a smaller plan", 0.95) for n in (1, 2, 3)]
    first = cache.lookup(scope, down[0], ZERO)
    assert first.hit and first.entry_id is not None  # the prior alone cannot tell
    cache.flag_for(scope, first.entry_id, down[0])
    # Account 2's entry has no outcomes of its own; its template pair has one.
    assert not cache.lookup(scope, down[1], ZERO).hit
    assert cache.lookup(scope, table.at("Move account 2 up to a larger plan", 0.95), ZERO).hit


def test_template_pairs_are_bounded() -> None:
    one = decision.append(decision.EMPTY, 0.9, True)
    held = {t: one for t in range(MAX_PAIRED + 5)}
    kept = decode_pairs(encode_pairs(held))
    assert list(kept) == list(range(5, MAX_PAIRED + 5))  # the newest
    assert all(len(o) == 1 and o.right[0] for o in kept.values())
    assert decode_pairs(None) == {} and decode_pairs(b"\x01") == {}
