"""Bronze change events → the current-state table of a source (KIP-213's materialized KTable).

One row per primary key: the ``after`` image of the event with the greatest sequence, or a
tombstone (``_cdc_deleted``) when that event is a delete. Tombstones stay, so a late event
older than the delete cannot resurrect the row. A truncate (``op = t``) deletes every row whose
sequence is smaller, and raises the source's *truncate watermark*: later-arriving events older
than it are ignored, since the rows they describe were truncated.

The MERGE is guarded by sequence (``s._cdc_seq > t._cdc_seq``), so applying the same events
twice, in any order or batching, leaves the same table: that is what makes a rerun after a
crash safe.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F
from pyspark.sql.types import BooleanType, LongType, StringType, StructField, StructType

from cdc_join.changeset import collect
from cdc_join.config import SourceConfig
from cdc_join.hashing import row_hash
from cdc_join.maintenance import table_properties
from cdc_join.storage import MergeSpec, Storage

SEQ = "_cdc_seq"
OP = "_cdc_op"
DELETED = "_cdc_deleted"
HASH = "_cdc_hash"
TS_MS = "_cdc_ts_ms"
METADATA = (SEQ, OP, DELETED, HASH, TS_MS)
_META_FIELDS = (
    StructField(SEQ, StringType(), False),
    StructField(OP, StringType(), True),
    StructField(DELETED, BooleanType(), False),
    StructField(HASH, LongType(), True),
    StructField(TS_MS, LongType(), True),
)


@dataclass(frozen=True)
class StateApplyReport:
    """What one application of bronze changes did to a state table."""

    events: int
    keys_changed: int
    truncate_watermark: str | None
    version: int


def state_schema(row_schema: StructType) -> StructType:
    """The state table's schema: the decoded row's columns, then the metadata columns."""
    return StructType([*row_schema.fields, *_META_FIELDS])


def value_fields(schema: StructType) -> list[StructField]:
    """The row's own columns (not the metadata) of a state-shaped schema."""
    return [f for f in schema.fields if f.name not in METADATA]


def key_condition(columns: tuple[str, ...], left: str = "t", right: str = "s") -> str:
    """``t.a = s.a AND t.b = s.b`` for a (composite) key."""
    return " AND ".join(f"{left}.`{c}` = {right}.`{c}`" for c in columns)


def events_as_state_rows(events: DataFrame, source: SourceConfig) -> DataFrame:
    """Shape bronze events (``_op``, ``_before``, ``_after``, ``_seq`` …) like state rows.

    The key comes from ``before`` for deletes and from ``after`` otherwise; a delete keeps only
    its key. Truncate events are not rows and must be removed before.
    """
    row_type = events.schema["_after"].dataType
    assert isinstance(row_type, StructType)
    is_delete = F.col("_op") == "d"
    columns: list[Column] = []
    for f in row_type.fields:
        after = F.col(f"_after.`{f.name}`")
        if f.name in source.primary_key:
            value = F.when(is_delete, F.col(f"_before.`{f.name}`")).otherwise(after)
        else:
            value = F.when(is_delete, F.lit(None).cast(f.dataType)).otherwise(after)
        columns.append(value.alias(f.name))
    shaped = events.select(
        *columns,
        F.col("_seq").alias(SEQ),
        F.col("_op").alias(OP),
        is_delete.alias(DELETED),
        F.col("_ts_ms").alias(TS_MS),
        F.col("_file"),
        F.col("_line"),
    )
    fields = row_type.fields
    return shaped.withColumn(
        HASH, F.when(~F.col(DELETED), row_hash(fields)).otherwise(F.lit(None).cast("long"))
    )


def newest_per_key(rows: DataFrame, primary_key: tuple[str, ...]) -> DataFrame:
    """Keep, per key, the row of greatest sequence; ties (duplicates) by landing file and line."""
    order = Window.partitionBy(*[F.col(f"`{c}`") for c in primary_key]).orderBy(
        F.col(SEQ).desc(), F.col("_file").desc(), F.col("_line").desc()
    )
    return (
        rows.withColumn("_rank", F.row_number().over(order))
        .filter("_rank = 1")
        .drop("_rank", "_file", "_line")
    )


def truncate_watermark(events: DataFrame, previous: str | None) -> str | None:
    """The greatest truncate sequence seen so far (one small aggregate over the change set)."""
    row = events.filter(F.col("_op") == "t").agg(F.max("_seq").alias("w")).first()
    found = row["w"] if row is not None else None
    if found is None:
        return previous
    return found if previous is None or found > previous else previous


def apply_changes(
    storage: Storage,
    path: str,
    source: SourceConfig,
    events: DataFrame,
    previous_watermark: str | None,
) -> StateApplyReport:
    """Apply bronze change events to the state table at ``path`` (created if absent).

    Args:
        storage: the storage seam.
        path: the state table.
        source: the source the events belong to.
        events: bronze rows (any order, duplicates allowed).
        previous_watermark: the source's truncate watermark before these events.

    Returns:
        A report with the new watermark and the state table's version afterwards.
    """
    rows_schema = events.schema["_after"].dataType
    assert isinstance(rows_schema, StructType)
    if not storage.create(path, state_schema(rows_schema), cdf=True, properties=table_properties("state")):
        storage.evolve(path, state_schema(rows_schema))
    watermark = truncate_watermark(events, previous_watermark)
    if watermark is not None:
        _apply_truncate(storage, path, source, watermark)
    upserts = events.filter(F.col("_op") != "t")
    if watermark is not None:
        upserts = upserts.filter(F.col("_seq") > F.lit(watermark))
    # In key order, so the files the MERGE writes hold narrow key ranges and keyed reads of
    # the state table (left changes, the stale check) skip the others.
    newest = newest_per_key(events_as_state_rows(upserts, source), source.primary_key).orderBy(
        *[F.col(f"`{c}`") for c in source.primary_key]
    )
    # Collected once: the MERGE writes these rows and their count is the report's.
    rows = collect(newest).num_rows
    if rows == 0:
        return StateApplyReport(0, 0, watermark, storage.version(path))
    metrics = storage.merge(
        path,
        newest,
        MergeSpec(
            on=key_condition(source.primary_key),
            update_condition=f"s.{SEQ} > t.{SEQ}",
            merge_schema=True,
        ),
    )
    changed = (metrics.rows_inserted or 0) + (metrics.rows_updated or 0)
    return StateApplyReport(
        events=rows, keys_changed=changed, truncate_watermark=watermark, version=metrics.version
    )


def _apply_truncate(storage: Storage, path: str, source: SourceConfig, watermark: str) -> None:
    """Turn every live row older than the truncate into a tombstone carrying its sequence."""
    schema = storage.schema(path)
    live = storage.read(path).filter((F.col(SEQ) < F.lit(watermark)) & ~F.col(DELETED))
    meta = {
        SEQ: F.lit(watermark),
        OP: F.lit("t"),
        DELETED: F.lit(True),
        HASH: F.lit(None).cast("long"),
        TS_MS: F.lit(None).cast("long"),
    }
    tombstones = live.select(
        *[
            meta[f.name].alias(f.name)
            if f.name in meta
            else (
                F.col(f"`{f.name}`") if f.name in source.primary_key else F.lit(None).cast(f.dataType)
            ).alias(f.name)
            for f in schema.fields
        ]
    )
    storage.merge(
        path,
        tombstones,
        MergeSpec(on=key_condition(source.primary_key), update_condition=f"s.{SEQ} > t.{SEQ}", insert=False),
    )


def current_rows(state: DataFrame) -> DataFrame:
    """The live rows of a state table (tombstones removed)."""
    return state.filter(~F.col(DELETED))
