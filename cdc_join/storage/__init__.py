"""The storage seam (see :mod:`cdc_join.storage.base`) and backend selection."""

from cdc_join.storage.base import FileStats, MergeSpec, Storage, WriteMetrics, is_table_name

__all__ = ["FileStats", "MergeSpec", "Storage", "WriteMetrics", "get_storage", "is_table_name"]


def get_storage(spark, backend: str | None = None) -> Storage:  # type: ignore[no-untyped-def]
    from cdc_join.storage.select import get_storage as _get

    return _get(spark, backend)
