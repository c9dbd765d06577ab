"""The routes' side of the served log (:mod:`freshline.pipeline.observe.served`).

:func:`begin` decides whether a request is logged (its feature sets' ``log_sample``, or
the caller's ``Freshline-Log: 1``, by a hash of its request id) and, if so, starts
noting what its reads serve; :func:`finish` queues the record once the response is sent.
A logged request's response carries its id in ``X-Request-Id``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

from starlette.requests import Request

from freshline.pipeline.core.features import Registry
from freshline.pipeline.observe import served
from freshline.pipeline.observe.served import Served, ServedLog

if TYPE_CHECKING:
    from freshline.pipeline.api.reader import Answer, Lookup

KEY: Final = "freshline.served"
"""Where a logged request keeps its id and moment in the ASGI scope."""


def begin(
    request: Request,
    log: ServedLog | None,
    registry: Registry,
    feature_sets: Sequence[str],
    tenant: str,
    route: str,
) -> bool:
    """Whether this request (``tenant``'s, on ``route``) is logged; if so, its reads are
    noted from here on."""
    if log is None or not log.enabled:
        return False
    rate = max(log.sample, *(registry[fs].log_sample for fs in feature_sets))
    asked = request.headers.get(served.LOG_HEADER) == "1"
    if rate <= 0.0 and not asked:
        return False
    rid = served.request_id(request.headers.get(served.REQUEST_ID_HEADER))
    if not (asked or served.sampled(rid, rate)):
        return False
    request.scope[KEY] = (rid, time.time_ns() // 1000, served.watch(), log, tenant, route)
    return True


def request_id(request: Request) -> str | None:
    """The id of a logged request (``None``: not logged)."""
    found = request.scope.get(KEY)
    return None if found is None else str(found[0])


def finish(
    request: Request,
    lookup: Lookup,
    answers: Sequence[Answer] | None,
    model: Mapping[str, Any] | None = None,
) -> None:
    """Queue the record of a logged request's reads: ``answers`` in the lookup's order
    (``None``: every pair a hit from Redis), and for a prediction ``model``, the
    prediction route's answer."""
    found = request.scope.get(KEY)
    if found is None:
        return
    rid, at_us, seen, log, tenant, route = found
    served.stop()
    refs = list(lookup)
    sources = ["hit"] * len(refs) if answers is None else [a["source"] for a in answers]
    record = Served(
        rid,
        tenant,
        route,
        at_us,
        [
            (ref.feature_set, ref.entity, source, seen.get((ref.feature_set, ref.entity)))
            for ref, source in zip(refs, sources, strict=True)
        ],
    )
    if answers is not None:  # values served that no noted entry holds (kept as answered)
        record.values = {
            (a["feature_set"], a["entity"]): a["values"]
            for a in answers
            if a["values"] is not None and (a["feature_set"], a["entity"]) not in seen
        }
    if model is not None:
        record.model = model["model"]
        record.model_version = model["model_version"]
        record.predictions = {p["entity"]: p["value"] for p in model["predictions"]}
    log.put(record)
