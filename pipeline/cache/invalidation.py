"""Invalidation messages: what the consumers publish after every write.

One JSON object per affected entry, the same bytes on the Kafka topic
``freshline.invalidations`` (keyed ``<tenant>:<entity>``) and the Redis channel
``freshline:invalidations``::

    {"tenant": "acme", "feature_set": "txn_90d", "entity": "42",
     "watermark": "00000000002eb1cb80661a6ac7e63f", "schema_version": 1}

The watermark is the same 30-digit hex string that heads the entry (see
:mod:`freshline.pipeline.core.codec`): it is wider than 64 bits, and hex strings of equal width
compare in the same order as the numbers.

Readers holding a copy of that entry (the in-process tier) drop it on receipt. After a
TRUNCATE of a source table, one message per feature set it feeds names tenant and
entity :data:`ALL`: readers drop every entry of that feature set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from freshline.pipeline.core.codec import watermark_hex
from freshline.pipeline.core.errors import FreshlineError

ALL = "*"
"""Tenant and entity of an invalidation that covers every entity of a feature set."""


@dataclass(frozen=True, slots=True)
class Invalidation:
    tenant: str
    feature_set: str
    entity: str
    watermark: int
    schema_version: int

    def encode(self) -> bytes:
        return orjson.dumps(
            {
                "tenant": self.tenant,
                "feature_set": self.feature_set,
                "entity": self.entity,
                "watermark": watermark_hex(self.watermark).decode(),
                "schema_version": self.schema_version,
            }
        )

    @property
    def kafka_key(self) -> bytes:
        return f"{self.tenant}:{self.entity}".encode()

    @classmethod
    def decode(cls, raw: bytes | str) -> Invalidation:
        try:
            obj: Any = orjson.loads(raw)
            return cls(
                str(obj["tenant"]),
                str(obj["feature_set"]),
                str(obj["entity"]),
                int(obj["watermark"], 16),
                int(obj["schema_version"]),
            )
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise FreshlineError(f"not an invalidation message: {raw[:80]!r}") from exc
