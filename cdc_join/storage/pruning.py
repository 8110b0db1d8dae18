"""Keyed reads that skip data files by their statistics: the batch form of a RocksDB prefix seek.

Every hop that needs "the rows of this table whose key is one of these" (old and new images of
changed keys, subscribers of changed right keys, right rows named by foreign keys) reads
through :func:`read_keyed`. It keeps only the data files whose min/max statistics of the first
key column can hold one of the wanted values, then semi-joins the rows with the wanted keys.
Tables clustered by that column (subscriptions by fk, state by primary key) therefore cost a
lookup in proportion to the keys, not to the table.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date, datetime
from decimal import Decimal
from typing import Any

from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import DoubleType, FloatType, StringType, StructField, StructType

from cdc_join.changeset import ChangeSet, Rows, frame_of
from cdc_join.schemas import nullable, sql_string
from cdc_join.storage.base import FileStats, Storage

#: Up to this many distinct wanted values are matched against file ranges on the driver; more
#: are range-joined in Spark. Either way only candidate paths (bounded by files) come back.
DRIVER_PRUNING_KEYS = 10_000
#: Up to this many values of a single key column are matched with an IN filter, not a join.
ISIN_KEYS = 5_000
#: Up to this many values of a single key column are looked up by the backend on the driver,
#: where it reads Delta without Spark (delta-rs). The rows found are those of the keys: for a
#: state table one per key and version kept since the last compaction; for a subscription
#: table every subscriber of a changed right key (and its superseded rows), which the lookup
#: step collects to the driver anyway.
DRIVER_READ_KEYS = 250_000


@dataclass(frozen=True)
class ScanStats:
    """Files a keyed read opened, of how many; and the rows it found when the backend read them
    on the driver (``None`` when Spark reads them)."""

    files_scanned: int
    files_total: int
    rows_on_driver: int | None = None

    def as_counts(self) -> dict[str, int]:
        return {"files_scanned": self.files_scanned, "files_total": self.files_total}

    def __add__(self, other: ScanStats) -> ScanStats:
        rows = (
            None
            if self.rows_on_driver is None or other.rows_on_driver is None
            else self.rows_on_driver + other.rows_on_driver
        )
        return ScanStats(self.files_scanned + other.files_scanned, self.files_total + other.files_total, rows)


def read_keyed(
    storage: Storage,
    path: str,
    keys: Rows,
    on: Sequence[tuple[str, str]],
    version: int | None = None,
    values: Sequence[Any] | None = None,
) -> tuple[DataFrame, ScanStats]:
    """Rows of the table at ``path`` whose columns equal a row of ``keys`` (null-safe; with
    ``values`` for a one-column key, as SQL's ``IN``: a null matches nothing).

    With ``values`` for a one-column key the backend may read the rows itself on the driver
    (:data:`DRIVER_READ_KEYS`), else Spark filters the candidate files by ``IN`` or a join.

    Args:
        storage: the storage seam.
        path: the table.
        keys: the wanted keys (may hold duplicates); a change set becomes a Spark frame only
            if Spark has to match them.
        on: pairs ``(table column, keys column)``; the first pair drives file skipping.
        version: read this version instead of the latest.
        values: the distinct values of the first keys column when the caller has them on the
            driver already (a materialized change set); saves the Spark job that collects them.

    Returns:
        The matching rows and how many files were scanned out of how many.
    """
    files = storage.files(path, version)
    selected = candidate_files(storage, path, version, files, keys, on[0], values)
    stats = ScanStats(len(selected), len(files))
    if values is not None and len(on) == 1 and len(values) <= DRIVER_READ_KEYS and selected:
        found = _read_on_driver(storage, path, version, selected, on[0][0], keys.schema[on[0][1]], values)
        if found is not None:
            return found.frame, ScanStats(stats.files_scanned, stats.files_total, found.rows)
    table = storage.read(path, version, files=selected) if selected else storage.read(path, version).limit(0)
    literals = (
        _sql_literals(values) if values is not None and len(on) == 1 and len(values) <= ISIN_KEYS else None
    )
    if literals is not None:
        # A list of values filters without a join (and without the job a broadcast costs), as
        # SQL text: one round trip to the JVM, not one per value.
        column = "`" + on[0][0].replace("`", "``") + "`"
        condition = f"{column} IN ({', '.join(literals)})" if literals else "false"
        return table.filter(F.expr(condition)), stats
    wanted = frame_of(keys).select(*[F.col(f"`{k}`").alias(f"__key{i}") for i, (_, k) in enumerate(on)])
    wanted = wanted.distinct()
    condition = [table[f"`{t}`"].eqNullSafe(wanted[f"__key{i}"]) for i, (t, _) in enumerate(on)]
    return table.join(F.broadcast(wanted), condition, "left_semi"), stats


def _read_on_driver(
    storage: Storage,
    path: str,
    version: int | None,
    files: list[str],
    column: str,
    wanted: StructField,
    values: Sequence[Any],
) -> ChangeSet | None:
    """The rows of ``files`` whose ``column`` is one of ``values``, read by the backend without
    Spark (delta-rs), as a change set (to be handed to Spark as a small frame).

    ``None`` (the caller reads with Spark) where the backend reads with Spark anyway; where the
    wanted values (``wanted``) are of another type than the column, which Spark compares after
    coercing one side; for floating-point keys (``-0.0`` and ``0.0`` are one key to Spark, two
    hash values to Arrow); and for a version older than the latest (whose schema may differ).
    """
    if version is not None and version != storage.version(path):
        return None
    schema = storage.schema(path)
    data_type = schema[column].dataType
    if data_type != wanted.dataType or isinstance(data_type, (DoubleType, FloatType)):
        return None
    table = storage.read_rows(path, column, values, version, files)
    if table is None:
        return None
    # Nullable throughout, as Spark reads parquet.
    rows_schema = nullable(schema)
    assert isinstance(rows_schema, StructType)
    return ChangeSet(storage.spark, rows_schema, table.select(schema.names))


def candidate_files(
    storage: Storage,
    path: str,
    version: int | None,
    files: list[FileStats],
    keys: Rows,
    first: tuple[str, str],
    values: Sequence[Any] | None,
) -> list[str]:
    """Paths of the files whose [min, max] of the first key column may hold a wanted value."""
    if len(files) <= 1:
        return [f.path for f in files]
    column, key_column = first
    ranged = [
        f for f in files if f.min_values.get(column) is not None and f.max_values.get(column) is not None
    ]
    unranged = {f.path for f in files} - {f.path for f in ranged}
    if not ranged:
        return sorted(unranged)
    if values is None or len(values) > DRIVER_PRUNING_KEYS:
        data_type = storage.schema(path)[column].dataType
        wanted = frame_of(keys).select(F.col(f"`{key_column}`").cast(data_type).alias("k")).distinct()
        few = wanted.limit(DRIVER_PRUNING_KEYS + 1).collect() if values is None else None
        if few is not None and len(few) <= DRIVER_PRUNING_KEYS:
            values = [r.k for r in few]
        else:
            return _range_join(storage, ranged, unranged, wanted, column, data_type)
    wanted_values = {v for v in values if v is not None}
    if any(_is_nan(v) for v in wanted_values):
        # NaN equals NaN in Spark's joins but sorts and compares with nothing: no file range
        # can be trusted to exclude it.
        return [f.path for f in files]
    ordered = sorted(wanted_values, key=_sort_key)
    return sorted(unranged | {f.path for f in ranged if _holds_any(f, column, ordered)})


def _range_join(
    storage: Storage,
    ranged: list[FileStats],
    unranged: set[str],
    wanted: DataFrame,
    column: str,
    data_type: Any,
) -> list[str]:
    """Candidate files for many wanted keys: a broadcast range join of file bounds in Spark."""
    ranges = storage.spark.createDataFrame(
        [(f.path, f.min_values[column], f.max_values[column]) for f in ranged],
        StructType(
            [StructField("path", StringType()), StructField("lo", data_type), StructField("hi", data_type)]
        ),
    )
    inside = (wanted.k >= ranges.lo) & (wanted.k <= ranges.hi)
    if isinstance(data_type, (DoubleType, FloatType)):
        inside = inside | F.isnan(wanted.k) | F.isnan(ranges.lo) | F.isnan(ranges.hi)
    hits = F.broadcast(ranges).join(wanted, inside)
    return sorted(unranged | {r.path for r in hits.select("path").distinct().collect()})


def _sql_literals(values: Sequence[Any]) -> list[str] | None:
    """SQL literals of key values (nulls never match a key); ``None`` if one has no literal form."""
    out = []
    for value in values:
        literal = _sql_literal(value)
        if literal is None:
            return None
        if literal != "NULL":
            out.append(literal)
    return out


def _sql_literal(value: Any) -> str | None:
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, int):
        return str(value) if -(2**63) <= value < 2**63 else f"{value}BD"
    if isinstance(value, float):
        return f"{value!r}D" if math.isfinite(value) else None
    if isinstance(value, Decimal):
        return f"{value}BD" if value.is_finite() else None
    if isinstance(value, str):
        return sql_string(value)  # immune to ${...} substitution and escapedStringLiterals
    if isinstance(value, datetime):
        kind = "TIMESTAMP_NTZ" if value.tzinfo is None else "TIMESTAMP"
        return f"{kind}'{value.isoformat(sep=' ')}'"
    if isinstance(value, date):
        return f"DATE'{value.isoformat()}'"
    return None


def _sort_key(value: object) -> tuple[str, object]:
    return (type(value).__name__, value)


def _is_nan(value: object) -> bool:
    return isinstance(value, float) and math.isnan(value)


def _holds_any(file: FileStats, column: str, values: list) -> bool:
    """Whether a sorted list of keys has one inside the file's range (bisect; True if unsure)."""
    lo, hi = file.min_values[column], file.max_values[column]
    if _is_nan(lo) or _is_nan(hi):
        return True
    try:
        i = bisect.bisect_left(values, lo)
        return i < len(values) and values[i] <= hi
    except TypeError:
        return True


def files_where(files: list[FileStats], column: str, *, above: Any) -> list[str]:
    """Paths of the files whose maximum of ``column`` exceeds ``above`` (no statistics: kept)."""
    return [f.path for f in files if f.max_values.get(column) is None or f.max_values[column] > above]
