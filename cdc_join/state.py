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

:func:`apply_all` is idempotent: a rerun after a crash appends only what is still missing (at most
duplicates of rows already there, which :func:`newest` folds), and it returns the same changed
keys with the same old and new images.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column, DataFrame
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

from cdc_join import bronze, commits
from cdc_join.bronze import Increment
from cdc_join.changeset import (
    ChangeSet,
    empty,
    from_arrow,
    materialize,
    materialize_all,
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
    STATE_METADATA,
    TS_MS,
    pk_columns,
    table_properties,
)
from cdc_join.config import PipelineConfig, SourceConfig
from cdc_join.hashing import row_hash_sql
from cdc_join.report import Step
from cdc_join.schemas import conform, ddl, quote, quoted
from cdc_join.storage import Storage
from cdc_join.storage.pruning import read_keyed

if TYPE_CHECKING:
    from cdc_join.runlog import Checkpoint

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


@dataclass(frozen=True)
class Previous:
    """What the last completed run left of a source: state version, watermark, run id."""

    version: int | None = None
    watermark: str | None = None
    run_id: int = 0

    @staticmethod
    def of(checkpoint: Checkpoint, name: str) -> Previous:
        """What the last completed run (``checkpoint``) left of one source."""
        return Previous(
            checkpoint.state_versions.get(name), checkpoint.watermarks.get(name), checkpoint.run_id
        )


@dataclass(frozen=True)
class SourceChanges:
    """A source's bronze increment, before it is applied: the keys whose current row may change
    (keys of new events; for a new truncate, every key it removes), the increment's rows
    (state-shaped, lazy, events older than the watermark dropped), and counts."""

    keys: ChangeSet
    rows: DataFrame
    events: int
    watermark: str | None
    truncating: bool
    unfinished: int = 0
    """Keys (among ``keys``) of rows a run that did not commit appended after the last
    completed run (:func:`cdc_join.commits.appended_files`): this run looks at them again."""


def plan(
    storage: Storage,
    path: str,
    source: SourceConfig,
    increment: Increment | None,
    previous: Previous,
    run_id: int,
) -> SourceChanges:
    """Plan applying a bronze increment (``None``: nothing new) to the state table at ``path``.

    Creates the table, or widens it, for the increment's row type. The increment's keys and
    truncates are read from its rows on the driver when it has them (no Spark job); a new
    truncate costs one read of the whole table, to find the rows it removes.

    The keys of rows that a run which did not commit appended after the last completed run are
    changes of this run too, whatever its increment holds: a run that lost a race may have
    appended rows of events the winner applied otherwise (a live row of an event a truncate
    the loser had not seen removes), and written silver rows from them. Looking at their keys
    again puts every such key right (one read of the files those runs added, after one only).
    """
    if increment is not None:
        row_type = increment.frame.schema["_after"].dataType
        assert isinstance(row_type, StructType)
        if not storage.create(path, state_schema(row_type), cdf=False, properties=table_properties("state")):
            storage.evolve(path, state_schema(row_type))
    schema = storage.schema(path)
    key = list(source.primary_key)
    redo = _unfinished_keys(storage, path, key, previous.version)
    if increment is None:
        nothing = empty(storage.spark, StructType([schema[c] for c in key]))
        keys = nothing if redo is None else redo
        return SourceChanges(
            keys, storage.read(path).limit(0), 0, previous.watermark, False, 0 if redo is None else redo.rows
        )
    rows = conform(event_rows(increment.frame, source, run_id), schema)
    if increment.arrow is not None:
        keys, truncate_seq = _arrow_keys(storage, increment.arrow, source, schema)
        events = increment.arrow.num_rows
    else:
        keys, truncate_seq, events = _reduce(rows, key)
    if redo is not None:
        keys = ChangeSet.concat([keys, redo], key)
    known = [w for w in (previous.watermark, truncate_seq) if w is not None]
    watermark = max(known) if known else None
    truncating = watermark is not None and watermark != previous.watermark
    if truncating:
        keys = ChangeSet.concat([keys, _truncated_keys(storage, path, key, previous, watermark)], key)
    upserts = rows.filter(F.col(OP) != "t")
    if watermark is not None:
        upserts = upserts.filter(F.col(SEQ) >= F.lit(watermark))
    return SourceChanges(keys, upserts, events, watermark, truncating, 0 if redo is None else redo.rows)


def _unfinished_keys(storage: Storage, path: str, key: list[str], version: int | None) -> ChangeSet | None:
    """The keys of the rows runs that did not commit appended after ``version``, or ``None``."""
    files = commits.appended_files(storage, path, version)
    if not files:
        return None
    return materialize(storage.read(path, files=files).select(*quoted(key)).distinct())


def plan_all(
    storage: Storage, config: PipelineConfig, previous: Checkpoint, versions: Mapping[str, int], run_id: int
) -> dict[str, SourceChanges]:
    """:func:`plan` for every source: its bronze increment since ``previous``, up to ``versions``."""
    return {
        name: plan(
            storage,
            config.state_path(name),
            config.sources[name],
            bronze.increment(storage, config, name, previous, versions[name]),
            Previous.of(previous, name),
            run_id,
        )
        for name in config.sources
    }


def _arrow_keys(
    storage: Storage, events: pa.Table, source: SourceConfig, schema: StructType
) -> tuple[ChangeSet, str | None]:
    """Distinct keys of the events (``before`` of deletes, ``after`` of the rest) and the
    greatest truncate sequence, from their rows on the driver."""
    op = events.column("_op")
    truncate = pc.fill_null(pc.equal(op, "t"), False)
    rows = events.filter(pc.invert(truncate))
    is_delete = pc.fill_null(pc.equal(rows.column("_op"), "d"), False)
    columns = {}
    for name in source.primary_key:
        before = pc.struct_field(rows.column("_before"), name)
        after = pc.struct_field(rows.column("_after"), name)
        columns[name] = pc.if_else(is_delete, before, after)
    key_schema = StructType([schema[c] for c in source.primary_key])
    keys = ChangeSet(storage.spark, key_schema, pa.table(columns)).distinct(list(source.primary_key))
    truncates = events.filter(truncate).column("_seq").to_pylist()
    return keys, max(truncates, default=None)


def _reduce(rows: DataFrame, key: list[str]) -> tuple[ChangeSet, str | None, int]:
    """Distinct keys, greatest truncate sequence and number of events of an increment that is
    not on the driver (one Spark job). Truncates have no key: they all land in the null key."""
    summary = materialize(
        rows.groupBy(*quoted(key)).agg(
            F.max(F.when(F.col(OP) == "t", F.col(SEQ))).alias("__truncate"), F.count(F.lit(1)).alias(_COUNT)
        )
    )
    table = summary.table
    truncate_seq = max((t for t in table.column("__truncate").to_pylist() if t is not None), default=None)
    events = int(pc.sum(table.column(_COUNT)).as_py() or 0)
    keyed = table.filter(pc.is_valid(table.column(key[0])))
    return (
        from_arrow(rows.sparkSession, StructType([rows.schema[c] for c in key]), keyed.select(key)),
        truncate_seq,
        events,
    )


def _truncated_keys(
    storage: Storage, path: str, key: list[str], previous: Previous, watermark: str
) -> ChangeSet:
    """Keys a truncate at ``watermark`` changes: live at the last completed run (the state
    version its checkpoint recorded) or live now (a killed attempt's rows, a rebuilt table),
    with a smaller sequence. One read of the whole table (two if it moved since)."""
    older = ~F.col(DELETED) & (F.col(SEQ) < F.lit(watermark))
    hit = newest(storage.read(path), key).filter(older).select(*quoted(key))
    if previous.version is not None and storage.version(path) != previous.version:
        settled = newest(storage.read(path, previous.version), key)
        hit = hit.unionByName(settled.filter(older).select(*quoted(key)))
    return materialize(hit.distinct())


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


def append(storage: Storage, path: str, rows: pa.Table) -> int:
    """Append state rows (already on the driver); returns the table's version afterwards."""
    if not rows.num_rows:
        return storage.version(path)
    return storage.append(path, from_arrow(storage.spark, storage.schema(path), rows)).version


@dataclass(frozen=True)
class Applied:
    """What a run applied to one state table. ``changes`` holds one row per key whose current
    row changed (for a source on the left side of a hop, with its ``_old`` and ``_new`` rows)."""

    changes: ChangeSet
    events: int
    appended: int
    truncated: int
    watermark: str | None
    version: int
    truncate_applied: bool = False
    unfinished: int = 0

    def as_counts(self) -> dict[str, int]:
        """The run report's counts for this source."""
        return {
            "events": self.events,
            "keys_changed": self.changes.rows,
            "appended": self.appended,
            "truncated": self.truncated,
            "truncate_applied": int(self.truncate_applied),
            "unfinished_keys": self.unfinished,
        }


def apply_all(
    storage: Storage,
    config: PipelineConfig,
    changes: Mapping[str, SourceChanges],
    subscribers: Mapping[str, ChangeSet],
    previous: Checkpoint,
    run_id: int,
    step: Step,
) -> tuple[dict[str, Applied], dict[str, ChangeSet]]:
    """Apply every source's changes (one Spark job for all, then one append per source).

    Returns what was applied per source, and per source on the left side of a hop
    (:attr:`~cdc_join.config.PipelineConfig.hop_sources`) the current rows of every key of it
    the run may affect: its changed keys and the subscribers of its hops' changed right keys.
    """
    with step("state"):
        before = {name: Previous.of(previous, name) for name in config.sources}
        planned = frames(storage, config, changes, subscribers, before, run_id)
        done = dict(zip(planned, materialize_all(list(planned.values())), strict=True)) if planned else {}
    out = {}
    for name in config.sources:
        with step(f"state:{name}") as counts:
            out[name] = applied(
                storage, config.state_path(name), config.sources[name], changes[name], done.get(name)
            )
            counts.update(out[name].as_counts())
    held = {name: current(storage, config.state_path(name), done.get(name)) for name in config.hop_sources}
    return out, held


def rebuild_all(
    storage: Storage, config: PipelineConfig, versions: Mapping[str, int], run_id: int, step: Step
) -> tuple[dict[str, int], dict[str, str]]:
    """Every state table rebuilt from its bronze snapshot; the new versions and watermarks."""
    pinned, watermarks = {}, {}
    for name in config.sources:
        with step(f"state:{name}") as counts:
            events = storage.read(config.bronze_path(name), versions[name])
            rows, watermark = rebuild(storage, config.state_path(name), config.sources[name], events, run_id)
            pinned[name] = storage.version(config.state_path(name))
            counts.update(rebuilt=rows)
            if watermark:
                watermarks[name] = watermark
    return pinned, watermarks


def frames(
    storage: Storage,
    config: PipelineConfig,
    changes: Mapping[str, SourceChanges],
    subscribers: Mapping[str, ChangeSet],
    previous: Mapping[str, Previous],
    run_id: int,
) -> dict[str, DataFrame]:
    """Per source with changes, the frame that applying them writes, to run all in one job.

    A source on the left side of a hop (the left source, a chain's middle sources) and a source
    a new truncate hits get :func:`images`; a hop's images are also read for the keys of the
    subscribers of its changed right keys, so one read of the table gives both the old rows of
    changed keys (their subscriptions move) and the current rows of affected ones (the stale
    check). Any other source gets the increment's newest row per key: appending it is enough,
    since readers keep the newest row of a key (an older row appended changes nothing).
    """
    out = {}
    for name, planned in changes.items():
        source, path = config.sources[name], config.state_path(name)
        key = list(source.primary_key)
        if name in config.hop_sources:
            pks = dict(zip(pk_columns(source), key, strict=True))
            extra = [
                found.distinct(list(pks)).renamed(pks)
                for alias, found in subscribers.items()
                if config.hop_left(config.join_for_alias(alias)).name == name
            ]
            keys = ChangeSet.concat([planned.keys, *extra], key) if extra else planned.keys
            if keys.rows:
                out[name] = images(storage, path, source, keys, planned, previous[name], run_id)
        elif planned.truncating:
            out[name] = images(storage, path, source, planned.keys, planned, previous[name], run_id)
        elif planned.keys.rows:
            out[name] = planned.rows
    return out


def applied(
    storage: Storage, path: str, source: SourceConfig, planned: SourceChanges, done: ChangeSet | None
) -> Applied:
    """Append what :func:`frames` computed for one source; what was applied."""
    schema = storage.schema(path)
    if done is None:
        nothing = empty(storage.spark, changes_schema(schema, source.primary_key))
        return Applied(
            nothing,
            planned.events,
            0,
            0,
            planned.watermark,
            storage.version(path),
            planned.truncating,
            planned.unfinished,
        )
    if NEW in done.schema.names:  # images: write the rows that changed, report the keys that did
        rows, keys = appended(done), changed(done)
    else:
        rows, keys = done.table, planned.keys
    version = append(storage, path, rows)
    truncated = (
        int(pc.sum(pc.cast(pc.equal(rows.column(OP), "t"), pa.int64())).as_py() or 0) if rows.num_rows else 0
    )
    return Applied(
        keys,
        planned.events,
        rows.num_rows,
        truncated,
        planned.watermark,
        version,
        planned.truncating,
        planned.unfinished,
    )


def current(storage: Storage, path: str, done: ChangeSet | None) -> ChangeSet:
    """The current rows (``_new``) of materialized images: every key of the source the run may
    affect."""
    schema = storage.schema(path)
    if done is None:
        return empty(storage.spark, schema)
    table = done.table.filter(pc.is_valid(done.table.column(NEW)))
    return from_arrow(storage.spark, schema, rows_of_struct(table, NEW, schema=schema))


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
    written = storage.overwrite(path, rows.orderBy(*quoted(source.primary_key)), note=commits.REBUILD)
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
