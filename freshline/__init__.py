"""freshline's public API: the definitions a feature repository writes, and the entry
object a program reads, serves and deploys them with.

    import freshline

    with freshline.FeatureStore("path/to/repo") as store:
        store.client().get("txn_90d", "acme", 42)


A repository's definitions module declares its entities, tables, feature sets and
domain events with
these; ``freshline plan`` shows what they would change and ``freshline apply`` does it::

    from freshline import Entity, FeatureSet, Field, Table

    member = Entity("member", key="member_id", type="bigint", tenant="library_id")
    loans = Table("loans", entities={member: "member_id"})
    loans_30d = FeatureSet("loans_30d", entity=member, ttl="1h", sources=[loans],
                           fields=[Field("open_loans", "int")], query="SELECT ...")
    loans_90d = Aggregations("loans_90d", entity=member, table=loans, time="loaned_at",
                             window="90d", aggs=[agg.count(), agg.count_distinct("book_id")])

A trainer fits the model the API serves with ``freshline.LogisticModel`` and builds its
input rows as the predict route does with ``freshline.input_row`` (both imported on
first use: they bring numpy and Redis).
"""

from typing import TYPE_CHECKING, Any

from freshline import agg
from freshline.pipeline.core.aggregations import Aggregations, Lookup
from freshline.pipeline.core.errors import ConfigError, FreshlineError
from freshline.pipeline.core.events import Event, EventField
from freshline.pipeline.core.features import (
    AS_OF,
    IMPLICIT_TENANT,
    Entity,
    FeatureSet,
    Field,
    Table,
)
from freshline.pipeline.core.incremental import BuildState, IncrementalPath
from freshline.pipeline.core.keys import validate_id
from freshline.pipeline.core.repository import Repository, load
from freshline.pipeline.history.training import training_set
from freshline.store import FeatureStore, freshline_token

if TYPE_CHECKING:
    from freshline.pipeline.inference.models import LogisticModel, input_row

_MODELS = ("LogisticModel", "input_row")


def __getattr__(name: str) -> Any:
    """The model names, imported on first use (they bring numpy and Redis)."""
    if name in _MODELS:
        from freshline.pipeline.inference import models

        return getattr(models, name)
    raise AttributeError(f"module 'freshline' has no attribute {name!r}")


__all__ = [
    "AS_OF",
    "IMPLICIT_TENANT",
    "Aggregations",
    "BuildState",
    "ConfigError",
    "Entity",
    "Event",
    "EventField",
    "FeatureSet",
    "FeatureStore",
    "Field",
    "FreshlineError",
    "IncrementalPath",
    "LogisticModel",
    "Lookup",
    "Repository",
    "Table",
    "agg",
    "freshline_token",
    "input_row",
    "load",
    "training_set",
    "validate_id",
]
