"""The aggregations of :func:`freshline.Aggregations`, as a namespace so that ``sum``,
``min`` and ``max`` never shadow Python's own in a definitions module::

    from freshline import Aggregations, agg

    orders_30d = Aggregations(..., aggs=[agg.count(), agg.sum("amount"), agg.max("amount")])
"""

from freshline.pipeline.core.aggregations import (
    count,
    count_distinct,
    last,
    max,
    mean,
    min,
    stddev,
    sum,
)
from freshline.pipeline.core.declarations import Agg

__all__ = ["Agg", "count", "count_distinct", "last", "max", "mean", "min", "stddev", "sum"]
