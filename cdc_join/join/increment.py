"""What a run's bronze increment changes in a source's state: the keys whose current row may
change, its rows shaped as state rows, the truncate watermark.

A truncate (``op = t``) at sequence ``W`` removes every row whose sequence is smaller than
``W`` and raises the source's watermark: later events older than it are ignored. The keys a
run looks at are its increment's, the rows a new truncate removes, and the rows that runs
which did not commit appended since the last completed run (a beaten run may have applied an
event the winner applied otherwise, and written silver from it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import (
    StructType,
)

from cdc_join.changeset import (
    ChangeSet,
    empty,
    from_arrow,
    materialize,
)
from cdc_join.columns import (
    DELETED,
    OP,
    SEQ,
    table_properties,
)
from cdc_join.config import PipelineConfig, SourceConfig
from cdc_join.join.state import event_rows, newest, state_schema
from cdc_join.landing import bronze
from cdc_join.landing.bronze import Increment
from cdc_join.schemas import conform, quoted
from cdc_join.storage import Storage, commits

if TYPE_CHECKING:
    from cdc_join.checkpoint import Checkpoint

_COUNT = "__events"


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
    completed run (:func:`cdc_join.storage.commits.appended_files`): this run looks at them again."""


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
