"""Bronze change events → the current-state table of a source (KIP-213's materialized KTable).

A source's current row for a key is the ``after`` image of its event with the greatest
*order* ``(sequence, landing file, line)``; a delete leaves a tombstone, so a late event older
than the delete cannot resurrect the row. A truncate (``op = t``) at sequence ``W`` removes
every row whose sequence is smaller than ``W``, and raises the source's *watermark*: later
events older than it are ignored, since the rows they describe were truncated. Ties of equal
sequences go to the later landing file, then the later line, whichever batch they arrive in.

The state table is **merge-on-read**: a run appends one row per key it changes, and the
current row of a key is its row of greatest order (:func:`newest`). Nothing is rewritten in
place, so a run costs in proportion to its changes; maintenance compacts the table
(:func:`compact`). Every row records the run that wrote it (``_cdc_run``), which is how a run
tells the rows of the last completed run (its *old* images) from those a killed attempt of
itself already wrote.

:func:`apply` is idempotent: a rerun after a crash appends only what is still missing (at most
duplicates of rows already there, which :func:`newest` folds), and it returns the same changed
keys with the same old and new images.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import BooleanType, LongType, StringType, StructField, StructType

from cdc_join.changeset import ChangeSet, empty, from_arrow, materialize, rows_of_struct
from cdc_join.config import SourceConfig
from cdc_join.hashing import row_hash
from cdc_join.schemas import conform, quote, quoted
from cdc_join.storage import Storage
from cdc_join.storage.pruning import files_where, read_keyed
from cdc_join.tables import DELETED, FILE, HASH, LINE, OP, RUN, SEQ, STATE_METADATA, TS_MS, table_properties

OLD = "_old"
NEW = "_new"
_APPEND = "_append"
_COUNT = "__events"

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


def order(row: str | None = None) -> Column:
    """The order of a state row, ``(sequence, file, line)``, as a comparable struct."""
    prefix = "" if row is None else f"{row}."
    return F.struct(*[F.col(f"{prefix}{c}").alias(c) for c in (SEQ, FILE, LINE)])


def newest(rows: DataFrame, key: Sequence[str]) -> DataFrame:
    """One row per key: the one of greatest order (duplicates of one event fold into one)."""
    packed = F.struct(*[F.col(c) for c in quoted(rows.columns)])
    return rows.groupBy(*quoted(key)).agg(F.max_by(packed, order()).alias("__row")).select("__row.*")


def current_rows(state: DataFrame, key: Sequence[str]) -> DataFrame:
    """The live current rows of state-table rows: newest per key, tombstones dropped."""
    return newest(state, key).filter(~F.col(DELETED))


def event_rows(events: DataFrame, source: SourceConfig, run_id: int) -> DataFrame:
    """Bronze events (``_op``, ``_before``, ``_after``, ``_seq``, …) shaped like state rows.

    The key comes from ``before`` for deletes and from ``after`` otherwise; a delete keeps only
    its key. A truncate becomes a row with a null key (see :func:`_reduce`).
    """
    row_type = events.schema["_after"].dataType
    assert isinstance(row_type, StructType)
    is_delete = F.col("_op") == "d"
    columns: list[Column] = []
    for f in row_type.fields:
        after = F.col(f"_after.{quote(f.name)}")
        if f.name in source.primary_key:
            value = F.when(is_delete, F.col(f"_before.{quote(f.name)}")).otherwise(after)
        else:
            value = F.when(is_delete, F.lit(None).cast(f.dataType)).otherwise(after)
        columns.append(value.alias(f.name))
    deleted = is_delete | (F.col("_op") == "t")
    return events.select(
        *columns,
        F.col("_seq").alias(SEQ),
        F.col("_file").cast("string").alias(FILE),
        F.col("_line").cast("long").alias(LINE),
        F.col("_op").alias(OP),
        deleted.alias(DELETED),
        F.when(~deleted, row_hash(row_type.fields)).otherwise(F.lit(None).cast("long")).alias(HASH),
        F.col("_ts_ms").alias(TS_MS),
        F.lit(run_id).cast("long").alias(RUN),
    )


@dataclass(frozen=True)
class Previous:
    """What the last completed run left of a source: state version, watermark, run id."""

    version: int | None = None
    watermark: str | None = None
    run_id: int = 0


@dataclass(frozen=True)
class Applied:
    """What applying a bronze increment did to one state table.

    ``changes`` holds one row per key whose current row changed since the last completed run:
    the key columns, ``_old`` (the row then, or null) and ``_new`` (the row now), both full
    state rows, tombstones included.
    """

    changes: ChangeSet
    events: int
    appended: int
    truncated: int
    watermark: str | None
    version: int

    def as_counts(self) -> dict[str, int]:
        """The run report's counts for this source."""
        return {
            "events": self.events,
            "keys_changed": self.changes.rows,
            "appended": self.appended,
            "truncated": self.truncated,
        }


def apply(
    storage: Storage,
    path: str,
    source: SourceConfig,
    events: DataFrame | None,
    previous: Previous,
    run_id: int,
) -> Applied:
    """Apply bronze change events (any order, duplicates allowed) to the state table at ``path``.

    Creates the table, or widens it, to hold the events' row type first. ``events`` is ``None``
    when bronze has nothing new: then nothing is read unless a killed attempt of this run left
    rows behind.
    """
    if events is not None:
        row_type = events.schema["_after"].dataType
        assert isinstance(row_type, StructType)
        if not storage.create(path, state_schema(row_type), cdf=False, properties=table_properties("state")):
            storage.evolve(path, state_schema(row_type))
    schema = storage.schema(path)
    key = list(source.primary_key)
    unchanged = previous.version is not None and storage.version(path) == previous.version
    if events is None and unchanged:
        return Applied(
            empty(storage.spark, changes_schema(schema, key)), 0, 0, 0, previous.watermark, previous.version
        )
    if events is None:
        candidates, truncate_seq, event_count = empty(storage.spark, schema), None, 0
    else:
        candidates, truncate_seq, event_count = _reduce(
            conform(event_rows(events, source, run_id), schema), key
        )
    known = [w for w in (previous.watermark, truncate_seq) if w is not None]
    watermark = max(known) if known else None
    truncating = watermark is not None and watermark != previous.watermark
    keys = _keys_to_check(storage, path, key, candidates, previous, watermark if truncating else None)
    if keys.rows == 0:
        nothing = empty(storage.spark, changes_schema(schema, key))
        return Applied(nothing, event_count, 0, 0, watermark, storage.version(path))
    images = materialize(_images(storage, path, key, keys, candidates, previous, watermark, run_id))
    appended = rows_of_struct(images.table, NEW, where=_APPEND)
    if appended.num_rows:
        version = storage.append(path, from_arrow(storage.spark, schema, appended).frame).version
    else:
        version = storage.version(path)
    changed = images.filtered(pc.invert(_same_order(images.table)))
    truncated = sum(1 for op in appended.column(OP).to_pylist() if op == "t") if appended.num_rows else 0
    return Applied(changed, event_count, appended.num_rows, truncated, watermark, version)


def changes_schema(schema: StructType, key: Sequence[str]) -> StructType:
    """Columns of :attr:`Applied.changes`: the key, then the old and the new row."""
    return StructType([*[schema[c] for c in key], StructField(OLD, schema), StructField(NEW, schema)])


def _reduce(rows: DataFrame, key: list[str]) -> tuple[ChangeSet, str | None, int]:
    """The newest event per key, the greatest truncate sequence, and the number of events.

    One Spark job. Truncates have no key: their rows all land in the one group of null keys.
    """
    packed = F.struct(*[F.col(c) for c in quoted(rows.columns)])
    reduced = materialize(
        rows.groupBy(*quoted(key))
        .agg(F.max_by(packed, order()).alias("__row"), F.count(F.lit(1)).alias(_COUNT))
        .select("__row.*", _COUNT)
    )
    table = reduced.table
    is_truncate = pc.equal(table.column(OP), "t")
    truncates = table.filter(is_truncate)
    truncate_seq = max(truncates.column(SEQ).to_pylist(), default=None)
    events = int(pc.sum(table.column(_COUNT)).as_py() or 0)
    kept = table.filter(pc.invert(pc.fill_null(is_truncate, False))).drop_columns([_COUNT])
    return from_arrow(rows.sparkSession, rows.schema, kept), truncate_seq, events


def _keys_to_check(
    storage: Storage,
    path: str,
    key: list[str],
    candidates: ChangeSet,
    previous: Previous,
    truncate_at: str | None,
) -> ChangeSet:
    """Keys whose current row may change: those of the new events, plus the keys a killed
    attempt of this run already wrote (rows of a later run than the last completed one), plus,
    for a new truncate, every live key older than it (one full read, once per truncate)."""
    parts = [candidates.distinct(key)]
    if previous.version is not None and storage.version(path) > previous.version:
        leftover = files_where(storage.files(path), RUN, above=previous.run_id)
        if leftover:
            rows = storage.read(path, files=leftover).filter(F.col(RUN) > previous.run_id)
            parts.append(materialize(rows.select(*quoted(key)).distinct()))
    if truncate_at is not None:
        live = current_rows(storage.read(path), key).filter(F.col(SEQ) < F.lit(truncate_at))
        parts.append(materialize(live.select(*quoted(key))))
    return ChangeSet.concat(parts, key)


def _images(
    storage: Storage,
    path: str,
    key: list[str],
    keys: ChangeSet,
    candidates: ChangeSet,
    previous: Previous,
    watermark: str | None,
    run_id: int,
) -> DataFrame:
    """Per key to check: the row of the last completed run, and the row after this run.

    ``_new`` is the newest of the row now in the table and the key's newest event (if not
    older than the watermark), turned into a truncate tombstone when it is older than the
    watermark; ``_append`` says whether it must be written.
    """
    stored, _ = read_keyed(storage, path, keys.frame, [(c, c) for c in key], values=keys.values(key[0]))
    columns = quoted(stored.columns)
    old = newest(stored.filter(F.col(RUN) <= previous.run_id), key).select(
        *quoted(key), F.struct(*columns).alias(OLD)
    )
    now = newest(stored, key).select(*quoted(key), F.struct(*columns).alias("__now"))
    events = candidates.frame
    if watermark is not None:
        events = events.filter(F.col(SEQ) >= F.lit(watermark))
    incoming = events.select(*quoted(key), F.struct(*columns).alias("__event"))
    joined = keys.frame.join(old, key, "left").join(now, key, "left").join(incoming, key, "left")
    newer = F.col("__event").isNotNull() & (F.col("__now").isNull() | (order("__event") > order("__now")))
    latest = F.when(newer, F.col("__event")).otherwise(F.col("__now"))
    result = joined.withColumn(NEW, latest)
    if watermark is not None:
        truncated = (
            F.col(NEW).isNotNull() & ~F.col(f"{NEW}.{DELETED}") & (F.col(f"{NEW}.{SEQ}") < F.lit(watermark))
        )
        result = result.withColumn(
            NEW, F.when(truncated, _tombstone(stored.schema, key, watermark, run_id)).otherwise(F.col(NEW))
        )
    written = F.col(NEW).isNotNull() & (F.col("__now").isNull() | (order(NEW) != order("__now")))
    return result.select(*quoted(key), OLD, NEW, written.alias(_APPEND))


def _tombstone(schema: StructType, key: list[str], watermark: str, run_id: int) -> Column:
    """The row a truncate at ``watermark`` leaves for the key of ``_new``: a tombstone ordered
    before every event of that sequence (file ``""``, line 0)."""
    meta: dict[str, Column] = {
        SEQ: F.lit(watermark),
        FILE: F.lit(""),
        LINE: F.lit(0).cast("long"),
        OP: F.lit("t"),
        DELETED: F.lit(True),
        RUN: F.lit(run_id).cast("long"),
    }
    fields = []
    for f in schema.fields:
        if f.name in meta:
            value = meta[f.name]
        elif f.name in key:
            value = F.col(f"{NEW}.{quote(f.name)}")
        else:
            value = F.lit(None)
        fields.append(value.cast(f.dataType).alias(f.name))
    return F.struct(*fields)


def _same_order(table: pa.Table) -> pa.ChunkedArray:
    """Per row of an images table: whether ``_old`` and ``_new`` are the same stored event."""
    same = None
    for name in (SEQ, FILE, LINE):
        old = pc.struct_field(table.column(OLD), name)
        new = pc.struct_field(table.column(NEW), name)
        both_null = pc.and_(pc.is_null(old), pc.is_null(new))
        equal = pc.fill_null(pc.equal(old, new), False)
        part = pc.or_(both_null, equal)
        same = part if same is None else pc.and_(same, part)
    return same


def from_events(events: DataFrame, source: SourceConfig, schema: StructType, run_id: int) -> DataFrame:
    """The state a source's complete event history implies: per key its newest event, as a
    tombstone when that is a delete or when a later truncate removed it (lazy).

    Args:
        events: every bronze event of the source (a snapshot of its bronze table).
        schema: the state table's schema (the rows are conformed to it).
        run_id: written to ``_cdc_run``.
    """
    key = list(source.primary_key)
    rows = conform(event_rows(events, source, run_id), schema)
    truncates = rows.filter(F.col(OP) == "t").select(F.col(SEQ).alias("__w"))
    watermark = truncates.agg(F.max("__w").alias("__w"))
    latest = newest(rows.filter(F.col(OP) != "t"), key).crossJoin(F.broadcast(watermark))
    older = F.col("__w").isNotNull() & ~F.col(DELETED) & (F.col(SEQ) < F.col("__w"))
    return latest.select(
        *[
            F.when(older, _truncated_value(f, key, run_id)).otherwise(F.col(quote(f.name))).alias(f.name)
            for f in schema.fields
        ]
    )


def rebuild(
    storage: Storage, path: str, source: SourceConfig, events: DataFrame, run_id: int
) -> tuple[int, str | None]:
    """Overwrite the state table with :func:`from_events` of a bronze snapshot, in key order:
    one commit, so readers see the old table or the new one.

    Returns the rows written and the watermark (the greatest truncate sequence).
    """
    row_type = events.schema["_after"].dataType
    assert isinstance(row_type, StructType)
    schema = state_schema(row_type)
    if not storage.create(path, schema, cdf=False, properties=table_properties("state")):
        storage.evolve(path, schema)
    schema = storage.schema(path)
    rows = from_events(events, source, schema, run_id)
    written = storage.overwrite(path, rows.orderBy(*quoted(source.primary_key)))
    found = events.filter(F.col("_op") == "t").agg(F.max("_seq").alias("w")).first()
    return written.rows_inserted or 0, found["w"] if found is not None else None


def _truncated_value(field: StructField, key: list[str], run_id: int) -> Column:
    """One column of the tombstone a truncate at ``__w`` leaves (see :func:`_tombstone`)."""
    meta: dict[str, Column] = {
        SEQ: F.col("__w"),
        FILE: F.lit(""),
        LINE: F.lit(0),
        OP: F.lit("t"),
        DELETED: F.lit(True),
        RUN: F.lit(run_id),
    }
    if field.name in meta:
        return meta[field.name].cast(field.dataType)
    if field.name in key:
        return F.col(quote(field.name))
    return F.lit(None).cast(field.dataType)


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

    ``on`` pairs state key columns with ``keys`` columns (default: the same names).
    """
    if keys is None:
        return newest(storage.read(path, version), key)
    pairs = list(on or [(c, c) for c in key])
    stored, _ = read_keyed(storage, path, keys.frame, pairs, version, keys.values(pairs[0][1]))
    return newest(stored, key)


def compact(storage: Storage, path: str, key: Sequence[str], last_run_id: int) -> int:
    """Rewrite the table keeping, per key, its newest row and its newest row of a completed run.

    The second is what an unfinished run needs as its old image; after a completed run the two
    are the same row. Returns the rows kept.
    """
    version = storage.version(path)
    stored = storage.read(path, version)
    settled = newest(stored.filter(F.col(RUN) <= last_run_id), key)
    rows = newest(stored, key).unionByName(settled).dropDuplicates([*key, SEQ, FILE, LINE])
    written = storage.overwrite(path, rows.orderBy(*quoted(key)), expected_version=version)
    return written.rows_inserted or 0
