"""What a run reads from bronze: which sources have events yet, and the rows to apply.

A source's columns are only known from its events, or from its ``columns:`` declaration in the
pipeline YAML. Until a source has one or the other:

- if it is the left source, there is nothing to join: the run says so and changes nothing;
- if it is a right source, silver cannot be built (a left join would need its columns for the
  null right side): the run stops with :class:`~cdc_join.errors.SourceNotReadyError`, which
  names the source and the declaration that would let it go on. Nothing is silently skipped.

A declared source gets an empty bronze table with the declared row type, so joins run before
its first event (a left join then shows null right columns); events that arrive later decode
into the declared types (widening them where they need more room).

The rows a run applies to a source's state are its bronze table's change feed since the
version the last checkpoint recorded; a source the checkpoint does not know yet (a first run,
a source added to the pipeline) is read as a snapshot instead, so a run never depends on the
change feed's history going back to version 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import LongType, StringType, StructField, StructType, TimestampType

from cdc_join.changeset import arrow_of
from cdc_join.checkpoint import Checkpoint
from cdc_join.config import PipelineConfig
from cdc_join.errors import SourceNotReadyError, StorageError
from cdc_join.report import RunReport
from cdc_join.schemas import parse_type
from cdc_join.storage import Storage
from cdc_join.storage.base import FileStats


def bronze_schema(row: StructType) -> StructType:
    """The schema of a bronze table whose row images have type ``row`` (what ingest writes)."""
    return StructType(
        [
            StructField("_file", StringType()),
            StructField("_line", LongType()),
            StructField("_op", StringType()),
            StructField("_seq", StringType()),
            StructField("_seq_values", StringType()),
            StructField("_ts_ms", LongType()),
            StructField("_before", row),
            StructField("_after", row),
            StructField("_raw", StringType()),
            StructField("_ingested_at", TimestampType()),
        ]
    )


def declared_row(config: PipelineConfig, name: str) -> StructType | None:
    """The row type a source's ``columns:`` declaration gives, or ``None``."""
    declared = config.sources[name].columns
    if not declared:
        return None
    return StructType([StructField(column, parse_type(text)) for column, text in declared])


@dataclass(frozen=True)
class Ready:
    """Every source can be joined; their bronze versions, pinned for the run."""

    bronze_versions: dict[str, int]


def prepare(storage: Storage, config: PipelineConfig, report: RunReport) -> Ready | None:
    """Pin every source's bronze version, creating declared sources' bronze tables first.

    Returns ``None`` (and says why in the report) when the left source has no events yet.

    Raises:
        SourceNotReadyError: a right source has neither events nor declared columns.
    """
    waiting = []
    for name in config.sources:
        path = config.bronze_path(name)
        if storage.exists(path):
            continue
        row = declared_row(config, name)
        if row is None:
            waiting.append(name)
        else:
            storage.create(path, bronze_schema(row), cdf=True)
    if config.left in waiting:
        report.steps["join"] = {
            "waiting": f"source {config.left!r} (the left side) has no events yet: nothing to join",
        }
        report.warnings.append(report.steps["join"]["waiting"])
        return None
    if waiting:
        names = ", ".join(repr(n) for n in waiting)
        raise SourceNotReadyError(
            f"source(s) {names} have no events yet, so their columns are unknown and silver cannot be "
            f"built. Declare them in the pipeline YAML (e.g. sources.{waiting[0]}.columns: "
            "{id: bigint, name: string}) to join before their first event, or wait for it.",
            hint=f"declare sources.{waiting[0]}.columns, or run again once its first events landed",
        )
    return Ready({name: storage.version(config.bronze_path(name)) for name in config.sources})


@dataclass(frozen=True)
class Increment:
    """Bronze rows a run applies to a source's state, with their Arrow copy when the storage
    backend handed them over on the driver (then keys are read without a Spark job)."""

    frame: DataFrame
    arrow: pa.Table | None = None


def increment(
    storage: Storage, config: PipelineConfig, name: str, previous: Checkpoint, end: int
) -> Increment | None:
    """The bronze rows a run applies to a source's state: ``None`` when there are none.

    The change feed's inserts in versions after the checkpoint's, up to ``end``; the snapshot at
    ``end`` when the checkpoint has no version for the source.
    """
    path = config.bronze_path(name)
    start = previous.bronze_versions.get(name)
    if start is None:
        snapshot = storage.read(path, end)
        return Increment(snapshot, arrow_of(snapshot))
    if start >= end:
        return None
    try:
        changes = storage.read_changes(path, start + 1, end)
    except StorageError:
        # No change feed (a bronze table another tool writes without one, or its history is
        # gone): the files added since the checkpoint hold the new rows of an append-only
        # table. Rows of rewritten files come again, which applying tolerates.
        return _added_rows(storage, path, start, end)
    inserts = changes.filter(F.col("_change_type") == "insert").drop("_change_type", "_commit_version")
    arrow = arrow_of(changes)
    if arrow is not None:
        arrow = arrow.filter(pc.equal(arrow.column("_change_type"), "insert")).drop_columns(
            ["_change_type", "_commit_version"]
        )
    return Increment(inserts, arrow)


def _added_rows(storage: Storage, path: str, start: int, end: int) -> Increment | None:
    """The rows of the data files added between two versions of an append-only table."""
    try:
        added, _ = _files_since(storage, path, start, end)
    except StorageError:
        return Increment(storage.read(path, end))  # not even the checkpoint's version is left
    return Increment(storage.read(path, end, files=[f.path for f in added])) if added else None


def appended_rows(
    storage: Storage, config: PipelineConfig, name: str, previous: Checkpoint, end: int
) -> int | None:
    """How many rows :func:`increment` gives, from file statistics alone (no Spark job): the rows
    of the files added after the checkpoint's version, where bronze was only appended to since;
    ``None`` where statistics cannot tell (a file of that version is gone, compacted or
    rewritten, so its rows are no change; a file without a row count; the versions unreadable)."""
    start = previous.bronze_versions.get(name)
    if start is not None and start >= end:
        return 0
    try:
        added, appended = _files_since(storage, config.bronze_path(name), start, end)
    except StorageError:
        return None
    if not appended or any(f.num_records is None or f.deleted_rows for f in added):
        return None
    return sum(int(f.num_records or 0) for f in added)


def _files_since(storage: Storage, path: str, start: int | None, end: int) -> tuple[list[FileStats], bool]:
    """The data files of version ``end`` that version ``start`` lacks (all of them with ``start``
    None), and whether every file of ``start`` is still there (the table was only appended to)."""
    now = storage.files(path, end)
    before = set() if start is None else {f.path for f in storage.files(path, start)}
    return [f for f in now if f.path not in before], before <= {f.path for f in now}


def empty(storage: Storage, config: PipelineConfig, name: str, version: int) -> DataFrame:
    """No rows, with the bronze table's columns."""
    return storage.read(config.bronze_path(name), version).limit(0)
