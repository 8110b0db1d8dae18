"""The one seam to Delta: the protocol (``base``), its two backends (``delta_rs``, ``delta_spark``)
chosen by ``select``, what both share (file statistics, keyed reads that skip files, columns
stored untyped, the Delta jars a local session loads) and ``commits``: what a table's log says
of the commits after a version; ``delta_txn`` is delta-spark's guarded append as one Delta
transaction where the session's JVM is this process's.

May import: the base modules (``errors``, ``schemas``, ``locations``, ``changeset``); nothing
of the data flow.
"""

from cdc_join.locations import is_table_name
from cdc_join.storage.base import FileStats, MergeSpec, Storage, WriteMetrics

__all__ = ["FileStats", "MergeSpec", "Storage", "WriteMetrics", "get_storage", "is_table_name"]


def get_storage(spark, backend: str | None = None) -> Storage:  # type: ignore[no-untyped-def]
    from cdc_join.storage.select import get_storage as _get

    return _get(spark, backend)
