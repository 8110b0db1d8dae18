"""Bronze change events → the current-state table of a source (KIP-213's materialized KTable).

A source's current row for a key is the ``after`` image of its event with the greatest
*order* ``(sequence, landing file, line)``; a delete leaves a tombstone, so a late event older
than the delete cannot resurrect the row. A truncate (``op = t``) at sequence ``W`` removes
every row whose sequence is smaller than ``W``, and raises the source's *watermark*: later
events older than it are ignored, since the rows they describe were truncated. Ties of equal
sequences go to the later landing file, then the later line, whichever batch they arrive in.

The state table is **merge-on-read**: a run appends one row per key it changes
(:mod:`cdc_join.join.apply`), and the current row of a key is its row of greatest order
(:func:`newest`). Nothing is rewritten in place, so a run costs in proportion to its changes;
maintenance compacts the table (:func:`compact`). Every row records the run that wrote it
(``_cdc_run``); what the last completed run left is read by version, not by run id
(:mod:`cdc_join.join.images`).

Applying is idempotent: a rerun after a crash appends only what is still missing (at most
duplicates of rows already there, which :func:`newest` folds), and it finds the same changed
keys with the same old and new images.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import (
    BooleanType,
    DoubleType,
    FloatType,
    LongType,
    StringType,
    StructField,
    StructType,
)

from cdc_join.changeset import (
    ChangeSet,
    as_read,
    frame_of,
    one_partition,
)
from cdc_join.columns import (
    DELETED,
    FILE,
    HASH,
    LINE,
    OP,
    RUN,
    SEQ,
    STATE_METADATA,
    TS_MS,
)
from cdc_join.config import SourceConfig
from cdc_join.join.hashing import row_hash_sql
from cdc_join.schemas import ddl, quote, quoted
from cdc_join.storage import Storage, commits
from cdc_join.storage.pruning import read_keyed

if TYPE_CHECKING:
    pass

_META_FIELDS = (
    StructField(SEQ, StringType(), False),
    StructField(FILE, StringType(), False),
    StructField(LINE, LongType(), False),
    StructField(OP, StringType(), True),
    StructField(DELETED, BooleanType(), False),
    StructField(HASH, LongType(), True),
    StructField(TS_MS, LongType(), True),
    StructField(RUN, LongType(), False),
)


def state_schema(row_schema: StructType) -> StructType:
    """The state table's schema: the decoded row's columns, then the metadata columns."""
    return StructType([*[f for f in row_schema.fields if f.name not in STATE_METADATA], *_META_FIELDS])


def value_fields(schema: StructType) -> list[StructField]:
    """The row's own columns (not the metadata) of a state-shaped schema."""
    return [f for f in schema.fields if f.name not in STATE_METADATA]


def order_sql(row: str | None = None) -> str:
    """SQL of the order of a state row, ``(sequence, file, line)``, as a comparable struct: of
    the row's columns, or of the fields of the struct column ``row``."""
    prefix = "" if row is None else f"{quote(row)}."
    return "named_struct(" + ", ".join(f"'{c}', {prefix}{c}" for c in (SEQ, FILE, LINE)) + ")"


def newest(rows: DataFrame, key: Sequence[str], *, on_driver: int | None = None) -> DataFrame:
    """One row per key: the one of greatest order (duplicates of one event fold into one).

    ``on_driver``: how many rows ``rows`` holds when they were read to the driver (a few are
    folded in one partition, see :func:`cdc_join.changeset.one_partition`).
    """
    packed = f"struct({', '.join(quoted(rows.columns))})"
    by_key = one_partition(rows, on_driver)
    if by_key is rows:
        # Shuffled by the key first: a key has few rows, so Spark's partial aggregate before
        # the shuffle would sort every row only to fold almost nothing.
        by_key = rows.repartition(*quoted(key))
    grouped = by_key.groupBy(*quoted(key)).agg(F.expr(f"max_by({packed}, {order_sql()}) AS __row"))
    # Key columns come from the grouping, so Spark knows the result is partitioned by the key
    # and a join or MERGE source on it needs no second shuffle. Floating-point keys keep the
    # row's own value (grouping turns -0.0 into 0.0). SQL text: one round trip to the JVM.
    types = {f.name: f.dataType for f in rows.schema.fields}
    return grouped.selectExpr(
        *[
            quote(c)
            if c in key and not isinstance(types[c], (FloatType, DoubleType))
            else f"__row.{quote(c)} AS {quote(c)}"
            for c in rows.columns
        ]
    )


def current_rows(state: DataFrame, key: Sequence[str]) -> DataFrame:
    """The live current rows of state-table rows: newest per key, tombstones dropped."""
    return newest(state, key).filter(~F.col(DELETED))


def event_rows(events: DataFrame, source: SourceConfig, run_id: int) -> DataFrame:
    """Bronze events (``_op``, ``_before``, ``_after``, ``_seq`` …) shaped like state rows.

    The key comes from ``before`` for deletes and from ``after`` otherwise; a delete keeps only
    its key. A truncate becomes a tombstone row with a null key. One projection of SQL text.
    """
    row_type = events.schema["_after"].dataType
    assert isinstance(row_type, StructType)
    deleted = "_op IN ('d', 't')"
    value_hash = row_hash_sql(row_type.fields, "_after.")
    columns = []
    for f in row_type.fields:
        name = quote(f.name)
        if f.name in source.primary_key:
            columns.append(f"CASE WHEN _op = 'd' THEN _before.{name} ELSE _after.{name} END AS {name}")
        else:
            columns.append(
                f"CASE WHEN {deleted} THEN CAST(NULL AS {ddl(f.dataType)}) ELSE _after.{name} END AS {name}"
            )
    return events.selectExpr(
        *columns,
        f"_seq AS {SEQ}",
        f"CAST(_file AS STRING) AS {FILE}",
        f"CAST(_line AS BIGINT) AS {LINE}",
        f"_op AS {OP}",
        f"{deleted} AS {DELETED}",
        f"CASE WHEN {deleted} THEN CAST(NULL AS BIGINT) ELSE {value_hash} END AS {HASH}",
        f"_ts_ms AS {TS_MS}",
        f"CAST({int(run_id)} AS BIGINT) AS {RUN}",
    )


def read_current(
    storage: Storage,
    path: str,
    key: Sequence[str],
    version: int | None = None,
    *,
    keys: ChangeSet | None = None,
    on: Sequence[tuple[str, str]] | None = None,
) -> DataFrame:
    """Newest row per key of a state table (tombstones included), optionally only for ``keys``.

    ``on`` pairs state key columns with ``keys`` columns (default: the same names). A whole
    table the storage read on the driver (a small one) gives its newest rows there too, in a
    frame that carries them (:func:`~cdc_join.changeset.arrow_of`).
    """
    if keys is None:
        stored = storage.read(path, version)
        return frame_of(as_read(newest(stored, key), stored))
    pairs = list(on or [(c, c) for c in key])
    stored, scan = read_keyed(storage, path, keys, pairs, version, keys.values(pairs[0][1]))
    return newest(stored, key, on_driver=scan.rows_on_driver)


def compact(
    storage: Storage,
    path: str,
    key: Sequence[str],
    last_run_id: int,
    tombstones_before_ms: int | None = None,
) -> int:
    """Rewrite the table keeping, per key, its newest row and its newest row of a completed run.

    The second is what an unfinished run needs as its old image; after a completed run the two
    are the same row. With ``tombstones_before_ms``, a key whose only kept row is a delete
    tombstone of an event older than that (``_cdc_ts_ms``) is dropped: the table stops growing
    with every key ever deleted, at the price that an event older than the delete arriving
    after the drop would bring the row back. Returns the rows kept.
    """
    version = storage.version(path)
    stored = storage.read(path, version)
    settled = newest(stored.filter(F.col(RUN) <= last_run_id), key)
    rows = newest(stored, key).unionByName(settled).dropDuplicates([*key, SEQ, FILE, LINE])
    if tombstones_before_ms is not None:
        expired = F.col(DELETED) & F.col(TS_MS).isNotNull() & (F.col(TS_MS) < F.lit(tombstones_before_ms))
        live_keys = rows.filter(~expired).select(*quoted(key)).distinct()
        rows = rows.join(live_keys, [*key], "left_semi")
    written = storage.overwrite(
        path, rows.orderBy(*quoted(key)), expected_version=version, note=commits.COMPACTION
    )
    return written.rows_inserted or 0
