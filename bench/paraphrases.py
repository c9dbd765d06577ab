"""A stream of paraphrases and near misses made from labelled pairs, for comparing the
semantic cache's decisions (``bench/semantic.py`` runs it).

From the pairs
--------------
Each paraphrase pair names a question: its intent (the ``kind``) and its entity (the
numbers in it, and the capitalised name both prompts share, if any). Replacing the
entity in every prompt of an intent gives the intent's **templates**, and filling a
template with a question's entity gives one of its **phrasings**: "Where is my refund
for order {0}?" and "Has the refund for order {0} been processed yet?" for order 3630
are two phrasings of one question, whose right answer is ``refund_status|3630``.

Near misses of a question come from the different pairs: another intent that a pair
puts against this one (``refund_status vs damaged_item``), filled with the same
entity, and the same intent with an entity a pair confuses with this one ("Ahmed
Khan" and "Aisha Khan"). A near miss with other numbers is never a candidate (the
numbers check), so these are the ones that test the decision.

The stream
----------
Every question is cached once, with its first phrasing and its right answer. The
**warm-up** then asks each question's other phrasings but the last, and about one
near miss for every three paraphrases, in a seeded random order; the **measured**
stream asks each question's last phrasing and the remaining near misses. Each lookup
is a caller's: a hit is served (right or wrong against the prompt's own answer), a
miss stores the prompt's right answer, as a caller storing its model's response
would; a wrong hit is flagged with its prompt, as the observed error (flags over hits)
assumes a caller does (the learned decision also runs with a caller that never flags).
The same stream runs against each decision, in a namespace of its own.
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import redis

from freshline.pipeline.semantic import prior
from freshline.pipeline.semantic.cache import Scope, SemanticCache
from freshline.pipeline.semantic.decision import Learned
from freshline.pipeline.semantic.embed import Embedder
from freshline.pipeline.semantic.namespaces import purge_namespace
from freshline.pipeline.semantic.prior import group_of
from freshline.pipeline.semantic.tune import Pair

ZERO = {"temperature": 0}
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_NAME = re.compile(r"(?<=\s)[A-Z][a-z]+(?: [A-Z][a-z]+)*")


@dataclass(frozen=True, slots=True)
class Question:
    intent: str
    name: str
    numbers: tuple[str, ...]

    @property
    def answer(self) -> str:
        return f"{self.intent}|{self.name}|{','.join(self.numbers)}"


@dataclass
class Stream:
    """The questions, each with its phrasings, and the prompts of the two phases: each
    ``(prompt, question it asks, whether it is a paraphrase of a cached question)``."""

    first: dict[Question, str] = field(default_factory=dict)
    warmup: list[tuple[str, Question, bool]] = field(default_factory=list)
    measured: list[tuple[str, Question, bool]] = field(default_factory=list)

    def prompts(self) -> list[str]:
        return sorted({*self.first.values(), *(p for p, _, _ in self.warmup + self.measured)})


def _entity(a: str, b: str) -> tuple[str, tuple[str, ...]]:
    names = [n for n in _NAME.findall(a) if n in b]
    return (max(names, key=len) if names else ""), tuple(_NUMBER.findall(a))


def _template(text: str, name: str, numbers: tuple[str, ...]) -> str | None:
    """``text`` with its entity as ``{name}``, ``{0}``, ``{1}``; None if it is not there."""
    out = text.replace("{", "{{").replace("}", "}}")
    if name:
        if name not in out:
            return None
        out = out.replace(name, "{name}")
    found = _NUMBER.findall(out)
    if tuple(found) != numbers:
        return None
    parts = _NUMBER.split(out)
    return "".join(p + (f"{{{i}}}" if i < len(numbers) else "") for i, p in enumerate(parts))


def _fill(template: str, q: Question) -> str | None:
    slots = len(re.findall(r"\{\d\}", template))
    if slots != len(q.numbers) or ("{name}" in template) != bool(q.name):
        return None
    return template.format(*q.numbers, name=q.name)


def build(pairs: list[Pair], seed: int = 29) -> Stream:
    """The stream of ``pairs`` (module docstring)."""
    templates: dict[str, set[str]] = {}
    questions: dict[str, set[Question]] = {}
    for p in pairs:
        if p.label != "paraphrase":
            continue
        intent = group_of(p)
        name, numbers = _entity(p.a, p.b)
        questions.setdefault(intent, set()).add(Question(intent, name, numbers))
        for text in (p.a, p.b):
            t = _template(text, name, numbers)
            if t is not None:
                templates.setdefault(intent, set()).add(t)
    against: dict[str, set[str]] = {}
    confused: dict[str, set[str]] = {}
    for p in pairs:
        if p.label != "different" or not p.kind:
            continue
        intent = group_of(p)
        sides = re.split(r" vs |/", p.kind)
        if len(sides) == 2:
            against.setdefault(intent, set()).add(sides[1].strip())
        elif "name differs" in p.kind:
            a, b = _entity(p.a, p.a)[0], _entity(p.b, p.b)[0]
            if a and b and a != b:
                confused.setdefault(a, set()).add(b)
                confused.setdefault(b, set()).add(a)
    rng = random.Random(seed)
    stream = Stream()
    warm: list[tuple[str, Question, bool]] = []
    last: list[tuple[str, Question, bool]] = []
    for intent in sorted(questions):
        for q in sorted(questions[intent], key=lambda q: (q.name, q.numbers)):
            phrasings = sorted(
                {f for t in templates.get(intent, ()) if (f := _fill(t, q)) is not None}
            )
            if len(phrasings) < 2:
                continue
            rng.shuffle(phrasings)
            stream.first[q] = phrasings[0]
            warm += [(p, q, True) for p in phrasings[1:-1]]
            last.append((phrasings[-1], q, True))
            near: list[tuple[str, Question, bool]] = []
            for other in sorted(against.get(intent, ())):
                twin = Question(other, q.name, q.numbers)
                near += [
                    (f, twin, False)
                    for t in sorted(templates.get(other, ()))
                    if (f := _fill(t, twin)) is not None
                ]
            for name in sorted(confused.get(q.name, ())):
                twin = Question(intent, name, q.numbers)
                near += [
                    (f, twin, False)
                    for t in sorted(templates.get(intent, ()))
                    if (f := _fill(t, twin)) is not None
                ]
            rng.shuffle(near)
            for n in near[: max(1, len(phrasings) // 3)]:
                (warm if rng.random() < 0.5 else last).append(n)
    rng.shuffle(warm)
    rng.shuffle(last)
    stream.warmup, stream.measured = warm, last
    return stream


@dataclass
class Tally:
    lookups: int = 0
    paraphrases: int = 0
    paraphrase_hits: int = 0
    hits: int = 0
    wrong: int = 0
    explored: int = 0

    def __add__(self, other: Tally) -> Tally:
        mine, theirs = dataclasses.astuple(self), dataclasses.astuple(other)
        return Tally(*(a + b for a, b in zip(mine, theirs, strict=True)))

    def figures(self) -> dict[str, Any]:
        return {
            "lookups": self.lookups,
            "paraphrases": self.paraphrases,
            "paraphrase_hit_rate": _rate(self.paraphrase_hits, self.paraphrases),
            "hits": self.hits,
            "wrong_hits": self.wrong,
            "error_rate": _rate(self.wrong, self.hits),
            "exploration_rate": _rate(self.explored, self.lookups),
        }


def _rate(n: int, d: int) -> float | None:
    return round(n / d, 4) if d else None


def play(
    cache: SemanticCache,
    scope: Scope,
    stream: Stream,
    vectors: Callable[[str], np.ndarray],
    *,
    flags: bool = True,
) -> dict[str, Tally]:
    """Cache each question's first phrasing, then run both phases as a caller would;
    with ``flags``, the caller flags each wrong hit with its prompt
    (``POST /v1/llm/cache/flag``), as the observed error (flags over hits) assumes."""
    for q, prompt in stream.first.items():
        cache.store_vector(scope, prompt, ZERO, q.answer, vectors(prompt))
    out: dict[str, Tally] = {}
    for phase, prompts in (("warmup", stream.warmup), ("measured", stream.measured)):
        tally = Tally()
        for prompt, q, paraphrase in prompts:
            found = cache.lookup_vector(scope, prompt, ZERO, vectors(prompt))
            tally.lookups += 1
            tally.paraphrases += paraphrase
            tally.explored += found.candidate_id is not None
            if found.hit:
                tally.hits += 1
                tally.paraphrase_hits += paraphrase
                tally.wrong += found.response != q.answer
                if flags and found.response != q.answer and found.entry_id is not None:
                    cache.flag_for(scope, found.entry_id, prompt)
            else:
                cache.store_vector(scope, prompt, ZERO, q.answer, vectors(prompt))
        out[phase] = tally
    return out


SEEDS = (29, 30, 31)
"""The learned decision's exploration seeds: one run each, summed."""


def compare(
    client: redis.Redis,
    model: Embedder,
    pairs: list[Pair],
    tenant: str,
    tag: str,
    *,
    max_error: float = 0.02,
    threshold: float = 0.93,
    seeds: tuple[int, ...] = SEEDS,
) -> dict[str, Any]:
    """The stream of ``pairs`` against the fixed ``threshold`` and the learned decision
    (the shipped prior, ``max_error``; one run per exploration seed, summed), each in
    a namespace of its own, purged after; the learned decision twice, with a caller
    that flags wrong hits and with one that never does."""
    stream = build(pairs)
    texts = stream.prompts()
    table = dict(zip(texts, model.embed(texts), strict=True))
    shipped = prior.for_model(model.name)
    runs: dict[str, dict[str, Tally]] = {}
    for name, decision, runs_seeds, flags in (
        ("static", None, (0,), True),
        ("learned", Learned(shipped, max_error), seeds, True),
        ("learned, no flags", Learned(shipped, max_error), seeds, False),
    ):
        total = {"warmup": Tally(), "measured": Tally()}
        for seed in runs_seeds:
            cache = SemanticCache(
                client,
                model,
                ttl_s=3600,
                threshold=threshold,
                decision=decision,
                rng=random.Random(seed),
            )
            scope = Scope(tenant, "bench-stream", f"{name[:7]}{flags:d}{seed}-{tag}", "t1")
            try:
                played = play(cache, scope, stream, table.__getitem__, flags=flags)
            finally:
                cache.close()
                purge_namespace(client, scope.namespace)
            total = {phase: total[phase] + played[phase] for phase in total}
        runs[name] = total
    measured = {name: t["measured"].figures() for name, t in runs.items()}
    hit = {name: m["paraphrase_hit_rate"] for name, m in measured.items()}
    return {
        "questions": len(stream.first),
        "lookups": {"warmup": len(stream.warmup), "measured": len(stream.measured)},
        "paraphrases_measured": sum(1 for _, _, p in stream.measured if p),
        "threshold": threshold,
        "max_error": max_error,
        "start": Learned(shipped, max_error).start,
        "seeds": list(seeds),
        "runs": {
            name: {phase: tally.figures() for phase, tally in t.items()} for name, t in runs.items()
        },
        "hit_ratio": round(hit["learned"] / hit["static"], 2) if hit["static"] else None,
        "hit_ratio_no_flags": (
            round(hit["learned, no flags"] / hit["static"], 2) if hit["static"] else None
        ),
    }
