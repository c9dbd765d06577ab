"""Feast's ``get_historical_features`` over a precomputed feature table, timed.

Run by :mod:`bench.training` in Feast's own virtual environment (``bench/feast/
requirements.txt``), never in freshline's: ``python historical.py FEATURES SPINE WORKDIR``.
``FEATURES`` is a Parquet file of ``user_id``, ``event_timestamp`` and one column per
feature (``<feature set>__<field>``, freshline's own output at each change); ``SPINE``
one of ``user_id`` and ``event_timestamp``. Each feature set becomes a FeatureView over
that file (its fields named as the columns), with the file offline store and a local
registry in ``WORKDIR``. Prints one JSON line: rows, seconds for
``get_historical_features(...).to_df()``, the Feast version.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
import time
from importlib import metadata
from pathlib import Path


def main(features_path: str, spine_path: str, workdir: str) -> None:
    import pandas as pd
    import pyarrow.parquet as pq
    from feast import Entity, FeatureStore, FeatureView, Field, FileSource, RepoConfig, ValueType
    from feast.types import Bool, Float64, Int64, String, UnixTimestamp

    kinds = {"int64": Int64, "double": Float64, "bool": Bool, "string": String}
    schema = pq.read_schema(features_path)
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    config = RepoConfig(
        project="freshline_bench",
        registry=str(work / "registry.db"),
        provider="local",
        online_store={"type": "sqlite", "path": str(work / "online.db")},
        offline_store={"type": "file"},
        entity_key_serialization_version=3,
    )
    store = FeatureStore(config=config)
    user = Entity(name="user", join_keys=["user_id"], value_type=ValueType.INT64)
    source = FileSource(path=features_path, timestamp_field="event_timestamp")
    views: dict[str, list[Field]] = {}
    for field in schema:
        if "__" not in field.name:
            continue
        view = field.name.split("__", 1)[0]
        kind = "timestamp" if str(field.type).startswith("timestamp") else str(field.type)
        views.setdefault(view, []).append(
            Field(name=field.name, dtype=UnixTimestamp if kind == "timestamp" else kinds[kind])
        )
    feature_views = [
        FeatureView(
            name=view,
            entities=[user],
            ttl=dt.timedelta(days=3650),
            schema=fields,
            source=source,
        )
        for view, fields in views.items()
    ]
    store.apply([user, *feature_views])
    spine = pd.read_parquet(spine_path)
    refs = [f"{view}:{f.name}" for view, fields in views.items() for f in fields]
    started = time.perf_counter()
    out = store.get_historical_features(entity_df=spine, features=refs).to_df()
    took = time.perf_counter() - started
    print(
        json.dumps(
            {
                "rows": len(out),
                "seconds": took,
                "features": len(refs),
                "non_null": int(out[refs[0].split(":")[1]].notna().sum()),
                "feast": metadata.version("feast"),
            }
        )
    )


if __name__ == "__main__":
    main(*sys.argv[1:4])
