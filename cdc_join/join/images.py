"""A changed key's rows before and after a run: the old image (as the last completed run left it)
and the new one (once the run's events are applied).

Old images are read at the state version the last checkpoint recorded (time travel), never by
run id: rows a killed or beaten run appended after it are not what the last completed run left.
The new image is the newer of the row now in the table and the key's newest event, made a
truncate tombstone when it is older than the watermark. A key whose image moved, or whose same
event was hashed otherwise (a rebuild after a column widened), changed: its subscriptions
(:mod:`cdc_join.join.subscription`) derive from both images, its silver row from the new one.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import (
    StructField,
    StructType,
)

from cdc_join.changeset import (
    ChangeSet,
    nullable_struct_sql,
    one_partition,
    rows_of_struct,
)
from cdc_join.columns import (
    DELETED,
    FILE,
    HASH,
    LINE,
    OP,
    RUN,
    SEQ,
)
from cdc_join.config import SourceConfig
from cdc_join.join.increment import Previous, SourceChanges
from cdc_join.join.state import order_sql
from cdc_join.schemas import conform, quote, quoted
from cdc_join.storage import Storage
from cdc_join.storage.pruning import read_keyed

if TYPE_CHECKING:
    pass

OLD = "_old"
NEW = "_new"
_APPEND = "_append"


def images(
    storage: Storage,
    path: str,
    source: SourceConfig,
    keys: ChangeSet,
    changes: SourceChanges,
    previous: Previous,
    run_id: int,
) -> DataFrame:
    """Per key in ``keys``: ``_old``, its row at the last completed run, and ``_new``, its row
    once ``changes`` are applied; ``_append`` says whether ``_new`` must be written (lazy).

    ``_old`` is read at the state version the last checkpoint recorded (time travel): rows a
    killed or losing run appended after it are not what the last completed run left, whatever
    run id they carry. ``_new`` is the newer of the row now in the table and the key's newest
    event (which is not older than the watermark), made a truncate tombstone when it is older
    than the watermark. The stored rows of the keys and the events are folded in one
    aggregation.
    """
    key = list(source.primary_key)
    on = [(c, c) for c in key]
    stored, scan = read_keyed(storage, path, keys, on, values=keys.values(key[0]))
    parts = [stored.withColumn("__src", F.lit("now")), changes.rows.withColumn("__src", F.lit("event"))]
    on_driver = None if scan.rows_on_driver is None else scan.rows_on_driver + changes.events
    old = "FALSE"  # no completed run wrote this table
    if previous.version is not None:
        old = "__src = 'now'"
        if storage.version(path) != previous.version:
            settled, seen = read_keyed(storage, path, keys, on, previous.version, keys.values(key[0]))
            parts.append(conform(settled, stored.schema).withColumn("__src", F.lit("old")))
            more = seen.rows_on_driver
            on_driver = None if on_driver is None or more is None else on_driver + more
            old = "__src = 'old'"
    both = one_partition(functools.reduce(lambda a, b: a.unionByName(b), parts), on_driver)
    # SQL text: one round trip each to a classic session's JVM, not several per column. Every
    # field of the packed row nullable: a key without an old (or new) row gets a null struct,
    # which Arrow cannot hold under a type with NOT NULL fields.
    row = nullable_struct_sql(stored.schema)
    folded = both.groupBy(*quoted(key)).agg(
        F.expr(f"max_by({row}, CASE WHEN {old} THEN {order_sql()} END) AS {OLD}"),
        F.expr(f"max_by({row}, CASE WHEN __src = 'now' THEN {order_sql()} END) AS __now"),
        F.expr(f"max_by({row}, CASE WHEN __src = 'event' THEN {order_sql()} END) AS __event"),
    )
    newer = f"__event IS NOT NULL AND (__now IS NULL OR {order_sql('__event')} > {order_sql('__now')})"
    result = folded.selectExpr("*", f"CASE WHEN {newer} THEN __event ELSE __now END AS {NEW}")
    if changes.watermark is not None:
        deleted, seq = F.col(f"{NEW}.{DELETED}"), F.col(f"{NEW}.{SEQ}")
        live_older = F.col(NEW).isNotNull() & ~deleted & (seq < F.lit(changes.watermark))
        tombstone = _tombstone(stored.schema, key, changes.watermark, run_id)
        result = result.withColumn(NEW, F.when(live_older, tombstone).otherwise(F.col(NEW)))
    written = f"{NEW} IS NOT NULL AND (__now IS NULL OR {order_sql(NEW)} != {order_sql('__now')})"
    return result.selectExpr(*quoted(key), OLD, NEW, f"{written} AS {_APPEND}")


def appended(images_set: ChangeSet) -> pa.Table:
    """The rows of materialized :func:`images` that must be written: the ``_new`` rows to append."""
    return rows_of_struct(images_set.table, NEW, where=_APPEND, schema=images_set.schema[NEW].dataType)


def changed(images_set: ChangeSet) -> ChangeSet:
    """The keys of materialized :func:`images` whose row differs from the last completed run:
    another event, or the same event hashed otherwise (a rebuild from bronze after a column
    widened hashes 1 as 1.0): the subscriptions must carry the hash the state holds."""
    table = images_set.table
    same_hash = _same(table, HASH)
    return images_set.filtered(pc.invert(pc.and_(_same_order(table), same_hash)))


def changes_schema(schema: StructType, key: Sequence[str]) -> StructType:
    """Columns of the changed keys of an images frame: the key, then the old and the new row."""
    return StructType([*[schema[c] for c in key], StructField(OLD, schema), StructField(NEW, schema)])


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
    return functools.reduce(pc.and_, [_same(table, name) for name in (SEQ, FILE, LINE)])


def _same(table: pa.Table, name: str) -> pa.ChunkedArray:
    """Per row of an images table: whether field ``name`` of ``_old`` and ``_new`` is equal,
    or null in both."""
    old = pc.struct_field(table.column(OLD), name)
    new = pc.struct_field(table.column(NEW), name)
    both_null = pc.and_(pc.is_null(old), pc.is_null(new))
    return pc.or_(both_null, pc.fill_null(pc.equal(old, new), False))
