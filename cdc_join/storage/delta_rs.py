"""The embedded storage backend: Delta tables through delta-rs (``deltalake``), compute in Spark.

Used where Spark has no Delta jars (a laptop, CI without a Maven repository). How each operation
maps onto delta-rs:

- Reads hand Spark the snapshot's data files as plain parquet with the table's schema, so Spark
  scans them in parallel and fills columns a file predates with nulls. That is only correct for
  tables whose files are the whole truth: unpartitioned, no column mapping, no deletion vectors.
  Tables that are not are refused with :class:`~cdc_join.errors.StorageError` instead of being
  read wrong (this project never creates such tables; delta-rs does not write deletion vectors).
- Writes of change sets (frames that carry their Arrow copy, or that Spark estimates below
  :data:`SPILL_BYTES`) collect the frame to the driver as Arrow and commit it as one batch;
  this is also what materializes a MERGE source before the merge. Writes of whole tables
  (rebuilds, compactions, a first silver) stream instead: Spark spills the frame as parquet,
  and delta-rs stages it chunk by chunk into files written in the frame's order, then commits
  them all in one transaction (:func:`_staged_write`), so driver memory does not grow with
  the table. delta-rs keeps the order of one batch across the files it writes, but not of
  several: it mixes the leftovers of each batch into a shared file, which would unsort a
  table rebuilt in key order.
- Change Data Feed comes from ``DeltaTable.load_cdf`` and is handed to Spark as Arrow.

Schemas convert through JSON: a Delta ``schemaString`` *is* Spark's ``StructType`` JSON, so
``timestamp``/``timestamp_ntz``, decimals, nested types, nullability and field metadata survive
both directions exactly.

Quirks of delta-rs 1.6 this module works around (the contract tests cover their effects):

- ``write_deltalake`` returns no metrics; they come from the commit's ``operationMetrics``.
- On a table with Change Data Feed and a NOT NULL column, a MERGE whose conditional insert
  skips an unmatched source row while inserting another fails with "rows failed validation
  check": delta-rs writes an all-null change-data row for the skipped one. Such rows are
  no-ops, so they are dropped from the source first (see ``_drop_unmatched_uninsertable``).
- MERGE's ``num_target_files_added`` counts change-data files too and is not always equal to
  the add actions it commits; file counts are therefore taken from the snapshot difference.
- MERGE with ``merge_schema=True`` rewrites the table schema even when the source brings no
  new column, relaxing NOT NULL columns to nullable from the (always nullable) Spark source; it
  is only passed when there is a column to add, with the source's nullability aligned first.
- ``load_cdf`` raises when the start version is past the latest version and silently clamps an
  end version past it; the range is clamped here and an empty range returns an empty frame.
- CDF batches use Arrow view types (``string_view``, ``binary_view``) that Spark cannot ingest,
  ``_commit_version`` is ``uint64`` and ``_commit_timestamp`` is a zone-less millisecond
  timestamp; the batch is cast to the table's types and ``_commit_timestamp`` is dropped (the
  delta-spark backend drops it as well).
- ``file_uris`` percent-encodes a table root with spaces, which Spark then cannot find; data
  file locations are built here from the table root and the add actions' relative paths.
- Decimal statistics are logged as JSON doubles (rounded past 15 digits) and timestamp
  statistics are truncated to milliseconds; :meth:`DeltaRsStorage.files` reports no statistics
  for decimals wider than 15 digits and widens timestamp maximums, so statistics stay bounds.
- Some malformed paths make delta-rs panic with ``pyo3_runtime.PanicException`` (a
  ``BaseException``); it is turned into ``StorageError`` like every other delta-rs error.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Literal
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset
import pyarrow.parquet as pq
from deltalake import CommitProperties, DeltaTable, QueryBuilder, write_deltalake
from deltalake import Schema as DeltaSchema
from deltalake.exceptions import DeltaError
from deltalake.transaction import AddAction
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.types import (
    ArrayType,
    DataType,
    DecimalType,
    LongType,
    MapType,
    NullType,
    StringType,
    StructField,
    StructType,
)

from cdc_join.changeset import (
    ARROW_ATTRIBUTE,
    ChangeSet,
    Rows,
    arrow_of,
    arrow_schema,
    cast_table,
    plain_types,
    spark_frame,
    to_arrow,
)
from cdc_join.errors import ConcurrentRunError, StorageError
from cdc_join.locations import has_scheme, is_table_name, local_path
from cdc_join.schemas import changed_types, conform, merge_schemas, nullable
from cdc_join.storage import keyed
from cdc_join.storage.base import (
    SMALL_READ_BYTES,
    FileStats,
    MergeSpec,
    WriteMetrics,
    lost_create,
    normalize_history_entry,
    refuse_other_files,
    rows_matching,
)
from cdc_join.storage.stats import int_or_none, stat_upper_bound

CHANGE_TYPE = "_change_type"
COMMIT_VERSION = "_commit_version"
# A double holds 15 significant decimal digits exactly.
_DOUBLE_EXACT_DIGITS = 15
_ROW_COLUMN = "__cdc_join_row"
#: Snapshots of given versions kept open (pinned versions a run reads again and again).
_SNAPSHOTS_KEPT = 64
_HIT_COLUMN = "__cdc_join_hit"
_SOURCE_NAME = "cdc_join_merge_source"
_TARGET_NAME = "cdc_join_merge_target"


_UNSUPPORTED_FEATURES = re.compile(r"[Uu]nsupported (?:table |reader |writer )?features?[^\[]*\[([^\]]*)\]")


@contextmanager
def _delta_errors(action: str, path: str) -> Iterator[None]:
    """Re-raise delta-rs failures as :class:`StorageError` naming the action and the table."""
    try:
        yield
    except StorageError:
        raise
    except DeltaError as exc:
        features = _UNSUPPORTED_FEATURES.search(str(exc))
        if features:
            raise StorageError(
                f"delta-rs cannot {action} the Delta table at {path}: it uses table features delta-rs "
                f"does not support ({features.group(1)}), as tables the delta-spark backend creates do "
                "(deletionVectors); run this lake with --storage delta-spark"
            ) from exc
        if type(exc).__name__ == "CommitFailedError":
            raise ConcurrentRunError(
                f"could not {action} the Delta table at {path}: another writer committed to it first ({exc})"
            ) from exc
        raise StorageError(f"delta-rs could not {action} the Delta table at {path}: {exc}") from exc
    except BaseException as exc:
        # A Rust panic surfaces as pyo3_runtime.PanicException, which derives from BaseException
        # and has no importable class; match it by name so KeyboardInterrupt etc. pass through.
        if type(exc).__name__ == "PanicException":
            raise StorageError(f"delta-rs failed to {action} the Delta table at {path}: {exc}") from exc
        raise


def _guard(expected_version: int | None, note: str | None = None) -> CommitProperties | None:
    """Commit properties that make a write fail if the table moved past ``expected_version``,
    and record ``note`` as the commit's user metadata.

    The table is loaded at that version and the commit may not be retried on a newer one, so
    a concurrent writer that committed first makes this write fail (optimistic concurrency).
    """
    if expected_version is None and note is None:
        return None
    return CommitProperties(
        custom_metadata=None if note is None else {"userMetadata": note},
        max_commit_retries=None if expected_version is None else 0,
    )


def table_root(path: str | os.PathLike[str]) -> str:
    """Normalize a table location: local paths and ``file:`` URIs become absolute local paths.

    Other URIs (object stores) are returned unchanged apart from a trailing slash.
    """
    text = os.fspath(path)
    if is_table_name(text):
        raise StorageError(
            f"{text} names a metastore table; tables by name need the delta-spark backend "
            "(Databricks, or Spark with the Delta jars). The delta-rs backend addresses tables by path."
        )
    local = local_path(text)
    return text.rstrip("/") if local is None else os.path.abspath(local)


def _is_local(root: str) -> bool:
    """Whether a table root (see :func:`table_root`) is on the local file system."""
    return local_path(root) is not None


def spark_file_uri(root: str, relative_or_absolute: str) -> str:
    """The location of one data file as Spark should be given it.

    Args:
        root: a normalized table root (see :func:`table_root`).
        relative_or_absolute: an add action's ``path``: URI-encoded, relative to the root
            unless it carries a scheme.

    Returns:
        ``file://`` plus the absolute local path for local tables (an explicit scheme, so a
        cluster whose default filesystem is not local still reads the local file), else the
        object-store URI.
    """
    if has_scheme(relative_or_absolute):
        local = local_path(relative_or_absolute)
        return relative_or_absolute if local is None else "file://" + unquote(local)
    decoded = unquote(relative_or_absolute)
    if _is_local(root):
        return "file://" + os.path.join(root, decoded)
    return f"{root}/{decoded}"


def _file_key(root: str, file: str) -> str:
    """A comparable key for a data file named in any of the accepted forms."""
    local = local_path(file)
    if local is None:
        return file
    if has_scheme(file):
        return os.path.normpath(local)
    if os.path.isabs(file):
        return os.path.normpath(file)
    return _file_key(root, spark_file_uri(root, file))


def delta_schema_to_spark(schema_json: str) -> StructType:
    """A Delta ``schemaString`` as a Spark ``StructType`` (the two share one JSON format)."""
    return StructType.fromJson(json.loads(schema_json))


def spark_schema_to_delta(schema: StructType) -> DeltaSchema:
    """A Spark ``StructType`` as a delta-rs schema, via the shared JSON format."""
    return DeltaSchema.from_json(schema.json())


def nullable_struct(schema: StructType) -> StructType:
    """:func:`cdc_join.schemas.nullable` for a whole schema."""
    result = nullable(schema)
    assert isinstance(result, StructType)
    return result


def change_feed_schema(table_schema: StructType) -> StructType:
    """The schema :meth:`Storage.read_changes` returns for a table of ``table_schema``."""
    fields = list(nullable_struct(table_schema).fields)
    fields += [StructField(CHANGE_TYPE, StringType(), True), StructField(COMMIT_VERSION, LongType(), True)]
    return StructType(fields)


def _has_null_type(data_type: DataType) -> bool:
    if isinstance(data_type, NullType):
        return True
    if isinstance(data_type, StructType):
        return any(_has_null_type(f.dataType) for f in data_type.fields)
    if isinstance(data_type, ArrayType):
        return _has_null_type(data_type.elementType)
    if isinstance(data_type, MapType):
        return _has_null_type(data_type.keyType) or _has_null_type(data_type.valueType)
    return False


#: A frame Spark estimates at fewer bytes than this is collected for a write, not spilled.
SPILL_BYTES = 64 * 1024 * 1024
# Spark prints a size as "12.3 MiB", or past 2048 EiB (a join's estimate) as "1.2E+22 B".
_SIZE = re.compile(r"sizeInBytes=([\d.]+(?:[eE][+-]?\d+)?)\s*(B|KiB|MiB|GiB|TiB|EiB|PiB)?")
_UNITS = {None: 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "PiB": 2**50, "EiB": 2**60}


def _estimated_bytes(df: DataFrame) -> int | None:
    """Spark's estimate of a frame's size (its optimized plan's statistics), ``None`` if unknown.

    Rows made on the driver (``createDataFrame``) count as small, whatever Spark estimates for
    them (it knows nothing of an RDD's size); a scan counts as its files' size, an upper bound.
    """
    try:
        text = df._jdf.queryExecution().stringWithStats()
    except Exception:  # Spark Connect: no JVM handle, but the cost plan prints the same
        try:
            text = df._explain_string(mode="cost")  # type: ignore[attr-defined]
        except Exception:
            return None
    return plan_size(text)


def plan_size(text: str) -> int | None:
    """The estimated size of a plan printed with its statistics (``explain(mode="cost")``)."""
    plan = text.split("== Physical Plan ==")[0]
    if "Relation [" not in plan and ("LogicalRDD" in plan or "LocalRelation" in plan):
        return 0
    found = _SIZE.search(plan)
    return None if found is None else int(float(found.group(1)) * _UNITS[found.group(2)])


#: A staged write hands delta-rs at most this many rows (or bytes) at a time, as one batch.
STAGE_ROWS = 1_000_000
STAGE_BYTES = 256 * 1024 * 1024
_STAGING_PREFIX = "cdc_join-staged-"


def _spilled(df: DataFrame, folder: str) -> pa.RecordBatchReader:
    """Write ``df`` as parquet into ``folder`` (Spark, in parallel) and stream it back in order.

    Spark names its part files in partition order and keeps each partition's row order, so
    reading the files by name gives the frame's order. Batches are cast to the Arrow types a
    collect would give (timestamps as UTC instants, Spark's INT96 read as microseconds).
    """
    df.write.parquet(folder)
    files = sorted(f for f in os.listdir(folder) if f.endswith(".parquet"))
    schema = arrow_schema(df.schema)

    def batches() -> Iterator[pa.RecordBatch]:
        for name in files:
            handle = pq.ParquetFile(os.path.join(folder, name), coerce_int96_timestamp_unit="us")
            for batch in handle.iter_batches(batch_size=65_536):
                yield cast_table(batch.select(schema.names), schema)

    return pa.RecordBatchReader.from_batches(schema, batches())


def _stages(rows: pa.RecordBatchReader, target: pa.Schema) -> Iterator[pa.RecordBatch]:
    """The rows as batches of the target's exact types, each of up to :data:`STAGE_ROWS` rows.

    The cast is the check delta-rs would make: a null in a NOT NULL column fails it. A column
    the table has and the rows lack is null.
    """
    pending: list[pa.RecordBatch] = []
    size = count = 0
    for batch in rows:
        columns = [
            batch.column(f.name) if f.name in batch.schema.names else pa.nulls(batch.num_rows, f.type)
            for f in target
        ]
        try:
            pending.append(cast_table(pa.RecordBatch.from_arrays(columns, names=target.names), target))
        except (pa.ArrowInvalid, ValueError) as e:
            raise StorageError(f"rows do not fit the table's schema: {e}") from None
        size, count = size + pending[-1].nbytes, count + batch.num_rows
        if count >= STAGE_ROWS or size >= STAGE_BYTES:
            yield pa.Table.from_batches(pending, target).combine_chunks().to_batches()[0]
            pending, size, count = [], 0, 0
    if pending:
        yield pa.Table.from_batches(pending, target).combine_chunks().to_batches()[0]


def _staged_write(
    dt: DeltaTable,
    root: str,
    rows: pa.RecordBatchReader,
    target: pa.Schema,
    mode: Literal["append", "overwrite"],
    commit: CommitProperties | None,
) -> int:
    """Write a stream of rows of any size into a table in one commit (with the ``commit``
    properties); returns the rows written.

    Each stage goes to a staging table inside the table's folder as one batch, so delta-rs
    writes its files in order (with their statistics); the staged files are then committed to
    the table as one append or overwrite. Files of a write killed before its commit are not in
    the table's log: they are never read, and a VACUUM removes them.
    """
    folder = f"{_STAGING_PREFIX}{uuid.uuid4().hex}"
    staging = os.path.join(root, folder)
    size = int(dt.metadata().configuration.get("delta.targetFileSize") or 0) or None
    for stage in _stages(rows, target):
        write_deltalake(staging, stage, mode="append", target_file_size=size)
    actions, inserted = [], 0
    for add in _log_adds(staging):
        stats = add.get("stats")
        inserted += int(json.loads(stats).get("numRecords", 0)) if stats else 0
        actions.append(
            AddAction(f"{folder}/{add['path']}", add["size"], {}, add["modificationTime"], True, stats or "")
        )
    dt.create_write_transaction(actions, mode=mode, schema=dt.schema(), commit_properties=commit)
    shutil.rmtree(os.path.join(staging, "_delta_log"), ignore_errors=True)
    return inserted


def _log_adds(root: str) -> list[dict[str, Any]]:
    """The add actions of a (small, checkpoint-free) table's log, in commit order."""
    log = os.path.join(root, "_delta_log")
    if not os.path.isdir(log):
        return []
    adds = []
    for name in sorted(f for f in os.listdir(log) if f.endswith(".json")):
        with open(os.path.join(log, name), encoding="utf-8") as handle:
            adds += [a["add"] for a in map(json.loads, filter(str.strip, handle)) if "add" in a]
    return adds


def _has_not_null(data_type: pa.DataType | pa.Schema) -> bool:
    fields: list[pa.Field]
    if isinstance(data_type, pa.Schema):
        fields = list(data_type)
    elif pa.types.is_struct(data_type):
        fields = [data_type.field(i) for i in range(data_type.num_fields)]
    elif pa.types.is_list(data_type) or pa.types.is_large_list(data_type) or pa.types.is_map(data_type):
        return (
            _has_not_null(data_type.value_type)
            if not pa.types.is_map(data_type)
            else (_has_not_null(data_type.item_type) or not data_type.item_field.nullable)
        )
    else:
        return False
    return any(not f.nullable or _has_not_null(f.type) for f in fields)


def _needs_insert_filter(dt: DeltaTable, target: pa.Schema) -> bool:
    """Whether a conditional insert hits delta-rs's change-data NOT NULL bug on this table."""
    cdf = dt.metadata().configuration.get("delta.enableChangeDataFeed", "false").lower() == "true"
    return cdf and _has_not_null(target)


class DeltaRsStorage:
    """:class:`~cdc_join.storage.base.Storage` on delta-rs; Spark reads the parquet files.

    Args:
        spark: the session reads and change feeds are returned in.
        storage_options: passed through to delta-rs for object stores (not used locally).
    """

    name = "delta-rs"
    #: A keyed replace rewrites every file it touches (delta-rs writes no deletion vectors).
    replaces_keys_in_place = False

    def __init__(self, spark: SparkSession, storage_options: dict[str, str] | None = None) -> None:
        self.spark = spark
        self.storage_options = storage_options
        self._latest: dict[str, DeltaTable] = {}
        self._versions: dict[tuple[str, int], DeltaTable] = {}
        self._files: dict[tuple[str, int], list[FileStats]] = {}
        self._local_master: bool | None = None

    # ------------------------------------------------------------------ helpers

    def _load(self, path: str, version: int | None = None) -> DeltaTable:
        """The table for reading: its latest snapshot, or a given version.

        Snapshots are kept per table root: the latest is brought up to date incrementally (a
        run opens the same tables dozens of times; a full load reads the whole log), and a
        given version never changes. Writes open their own (:meth:`_load_for_write`).
        """
        root = table_root(path)
        with _delta_errors("open" if version is None else f"open version {version} of", path):
            if version is not None:
                key = (root, int(version))
                if key not in self._versions:
                    self._versions[key] = self._open(root, path, version)
                    while len(self._versions) > _SNAPSHOTS_KEPT:
                        self._versions.pop(next(iter(self._versions)))
                return self._versions[key]
            latest = self._latest.get(root)
            if latest is None:
                latest = self._latest[root] = self._open(root, path, None)
            else:
                latest.update_incremental()
            return latest

    def _open(self, root: str, path: str, version: int | None) -> DeltaTable:
        if not DeltaTable.is_deltatable(root, self.storage_options):
            raise StorageError(f"No Delta table at {path}")
        return DeltaTable(root, version=version, storage_options=self.storage_options)

    def _load_for_write(self, path: str, expected_version: int | None = None) -> DeltaTable:
        """A fresh table object for a write (a commit updates the object it was made with)."""
        root = table_root(path)
        self._latest.pop(root, None)
        with _delta_errors("open", path):
            return self._open(root, path, expected_version)

    @staticmethod
    def _spark_schema(dt: DeltaTable) -> StructType:
        return delta_schema_to_spark(dt.schema().to_json())

    def _check_plain_parquet(self, dt: DeltaTable, path: str) -> None:
        """Refuse tables whose parquet files alone do not give the right rows."""
        meta = dt.metadata()
        if meta.partition_columns:
            raise StorageError(
                f"The Delta table at {path} is partitioned by {meta.partition_columns}; the delta-rs "
                "backend reads unpartitioned tables only"
            )
        mode = meta.configuration.get("delta.columnMapping.mode", "none")
        if mode != "none":
            raise StorageError(
                f"The Delta table at {path} uses column mapping ({mode}); the delta-rs backend cannot "
                "read its parquet files directly. Use the delta-spark backend."
            )
        if "deletionVectors" in (dt.protocol().reader_features or []):
            with _delta_errors("list the deletion vectors of", path):
                has_dvs = pa.table(dt.deletion_vectors()).num_rows > 0
            if has_dvs:
                raise StorageError(
                    f"The Delta table at {path} has deletion vectors; reading its parquet files would "
                    "return deleted rows. Use the delta-spark backend, or rewrite the table without "
                    "deletion vectors (REORG TABLE ... APPLY (PURGE))."
                )

    def _add_actions(
        self, dt: DeltaTable, path: str, columns: Sequence[str] | None = None
    ) -> list[dict[str, Any]]:
        """The snapshot's add actions, statistics flattened; only ``columns`` of them if given
        (Python objects of every statistic of 1,500 files take 0.2 s to build)."""
        with _delta_errors("list the files of", path):
            actions = pa.table(dt.get_add_actions(flatten=True))
            if columns is not None:
                actions = actions.select([c for c in columns if c in actions.column_names])
            return actions.to_pylist()

    def _file_records(self, dt: DeltaTable, path: str) -> dict[str, int | None]:
        """Data files of the loaded snapshot → their row counts."""
        root = table_root(path)
        return {
            spark_file_uri(root, row["path"]): row.get("num_records")
            for row in self._add_actions(dt, path, ("path", "num_records"))
        }

    def _metrics_after(
        self,
        path: str,
        before_version: int,
        before: Mapping[str, int | None],
        raw: Mapping[str, Any] | None = None,
        *,
        rows_inserted: int | None = None,
        rows_updated: int | None = None,
        rows_deleted: int | None = None,
        files_scanned: int | None = None,
        files_skipped: int | None = None,
        count_removed_rows: bool = False,
    ) -> WriteMetrics:
        """Metrics of the write just done: version and file counts from the new snapshot.

        A write that committed nothing (a MERGE that changed no row) keeps ``before_version``.

        With ``count_removed_rows`` and no ``rows_deleted``, the rows deleted are the row
        counts of the files the write removed (right for writes that drop whole files).
        """
        dt = self._load(path)
        after = self._file_records(dt, path)
        version = dt.version()
        removed = before.keys() - after.keys()
        if count_removed_rows and rows_deleted is None:
            counts = [before[f] for f in removed]
            rows_deleted = None if any(c is None for c in counts) else sum(int(c or 0) for c in counts)
        extra: dict[str, Any] = {}
        if raw is None and version != before_version:
            # write_deltalake returns nothing: read the commit's own metrics back.
            with _delta_errors("read the history of", path):
                last = dt.history(1)
            if last and last[0].get("version") == version:
                raw = last[0].get("operationMetrics") or {}
                extra["operation"] = last[0].get("operation")
        extra["metrics"] = dict(raw or {})
        return WriteMetrics(
            version=version,
            rows_inserted=rows_inserted,
            rows_updated=rows_updated,
            rows_deleted=rows_deleted,
            files_added=len(after.keys() - before.keys()),
            files_removed=len(removed),
            files_scanned=files_scanned,
            files_skipped=files_skipped,
            extra=extra,
        )

    def _can_spill(self, df: DataFrame, root: str) -> bool:
        """Whether to stream ``df`` through a parquet spill rather than collect it: it may be
        large (Spark's own size estimate, when it gives one), and both sides reach the spill."""
        if not _is_local(root) or _has_null_type(df.schema):  # parquet has no void type
            return False
        size = _estimated_bytes(df)
        if size is not None and size < SPILL_BYTES:
            return False
        if self._local_master is None:
            try:
                master = self.spark.conf.get("spark.master") or ""
            except Exception:  # a Connect server that does not say
                master = ""
            self._local_master = master.startswith("local")
        return self._local_master

    def _source_arrow(self, df: Rows, target: pa.Schema | None) -> pa.Table:
        """Collect ``df`` as Arrow, declaring NOT NULL where the target column is NOT NULL.

        Spark marks most columns nullable; delta-rs then relaxes NOT NULL target columns when
        it merges schemas. A column that really holds nulls keeps its nullable flag, so
        delta-rs still rejects the write instead of storing nulls in a NOT NULL column.
        """
        # A change set (or a frame materialized earlier in the run) carries its rows: no Spark
        # job, and for a change set not even a Spark frame.
        table = df.table if isinstance(df, ChangeSet) else arrow_of(df)
        if table is None:
            table = to_arrow(df)
        if target is None:
            return table
        fields = []
        changed = False
        for field in table.schema:
            idx = target.get_field_index(field.name)
            if (
                idx >= 0
                and not target.field(idx).nullable
                and field.nullable
                and table[field.name].null_count == 0
            ):
                field = field.with_nullable(False)
                changed = True
            fields.append(field)
        if not changed:
            return table
        return pa.Table.from_arrays(table.columns, schema=pa.schema(fields, metadata=table.schema.metadata))

    # ------------------------------------------------------------------ protocol

    def exists(self, path: str) -> bool:
        """Whether a Delta table is at ``path``."""
        with _delta_errors("probe", path):
            return DeltaTable.is_deltatable(table_root(path), self.storage_options)

    def create(
        self,
        path: str,
        schema: StructType,
        *,
        cdf: bool = True,
        properties: Mapping[str, str] | None = None,
    ) -> bool:
        """Create an empty table if none is at ``path``; return whether this call created it."""
        if self.exists(path):
            return False
        refuse_other_files(path)
        config: dict[str, str | None] = dict(properties or {})
        if cdf:
            config["delta.enableChangeDataFeed"] = "true"
        root = table_root(path)
        try:
            delta_schema = spark_schema_to_delta(schema)
        except Exception as exc:
            raise StorageError(f"Cannot create the Delta table at {path}: unsupported schema: {exc}") from exc
        try:
            with _delta_errors("create", path):
                DeltaTable.create(
                    root,
                    delta_schema,
                    mode="error",
                    configuration=config,
                    storage_options=self.storage_options,
                    raise_if_key_not_exists=False,
                    # No retry: a retried create commits a second table over the winner's.
                    commit_properties=CommitProperties(max_commit_retries=0),
                )
        except (StorageError, ConcurrentRunError) as exc:
            # Lost a race with another creator: the table is there now (or soon), and it is not ours.
            return lost_create(self.exists, path, exc)
        return True

    def version(self, path: str) -> int:
        """The latest version of the table."""
        return self._load(path).version()

    def schema(self, path: str) -> StructType:
        """The table's current schema (nullability as declared in the table)."""
        return self._spark_schema(self._load(path))

    def read(self, path: str, version: int | None = None, files: Sequence[str] | None = None) -> DataFrame:
        """The snapshot at ``version`` (default latest), optionally only the rows of ``files``.

        Raises:
            StorageError: no table, a version that does not exist, a file that is not a data
                file of that snapshot, or a table this backend cannot read correctly.
        """
        dt = self._load(path, version)
        self._check_plain_parquet(dt, path)
        schema = self._spark_schema(dt)
        root = table_root(path)
        adds = self._add_actions(dt, path, ("path", "size_bytes"))
        size = sum(int(a.get("size_bytes") or 0) for a in adds)
        if files is None and _is_local(root) and size <= SMALL_READ_BYTES:
            small = self._small_snapshot(dt, path, schema, [_file_key(root, a["path"]) for a in adds])
            if small is not None:
                return small
        uris = [spark_file_uri(root, row["path"]) for row in adds]
        if files is not None:
            by_key = {_file_key(root, uri): uri for uri in uris}
            chosen: list[str] = []
            for file in files:
                uri = by_key.get(_file_key(root, file))
                if uri is None:
                    raise StorageError(
                        f"{file} is not a data file of version {dt.version()} of the Delta table at {path}"
                    )
                if uri not in chosen:
                    chosen.append(uri)
            uris = chosen
        if not uris:
            return self.spark.createDataFrame([], nullable_struct(schema))
        return self.spark.read.schema(schema).parquet(*uris)

    def _small_snapshot(
        self, dt: DeltaTable, path: str, schema: StructType, files: list[str]
    ) -> DataFrame | None:
        """A local snapshot's data ``files`` (at most :data:`SMALL_READ_BYTES`; no deletion
        vector, :meth:`_check_plain_parquet` saw to it) read on the driver, with the Arrow rows
        attached (:data:`~cdc_join.changeset.ARROW_ATTRIBUTE`: keys and counts of it need no
        Spark job, and Spark plans over it without a file scan); ``None`` for rows Spark takes
        otherwise from Arrow (its parquet reader reads them). Columns a file lacks (added
        later) read as null."""
        with _delta_errors("read", path):
            kinds = pa.schema(dt.schema().to_arrow())
            arrow = plain_types(pa.dataset.dataset(sorted(files), schema=kinds, format="parquet").to_table())
        try:  # every column nullable, as Spark's parquet reader gives them (``read``'s other path)
            return ChangeSet(self.spark, nullable_struct(schema), arrow).frame
        except Exception:  # rows Spark takes otherwise from Arrow: its reader reads them
            return None

    def read_arrow(
        self, path: str, columns: Sequence[str] | None = None, files: Sequence[str] | None = None
    ) -> pa.Table:
        """The latest snapshot (or only ``files`` of it) as Arrow, read by delta-rs: no Spark job."""
        with _delta_errors("read", path):
            dataset = self._dataset(path, None, files)
            return dataset.to_table(columns=list(columns) if columns is not None else None)

    def read_rows(
        self,
        path: str,
        column: str,
        values: Sequence[Any],
        version: int | None = None,
        files: Sequence[str] | None = None,
        *,
        columns: Sequence[str] | None = None,
    ) -> pa.Table | None:
        """The rows of the snapshot at ``version`` (default latest; only ``files`` of it) whose
        ``column`` equals one of ``values`` (only ``columns`` of them), read by delta-rs on the
        driver: no Spark job.

        A null matches nothing, as in SQL's ``IN``. Parquet row groups whose statistics hold
        no wanted value are skipped, and the scan runs on Arrow's thread pool. A table whose
        protocol names deletion vectors (even with none left), which pyarrow datasets refuse,
        is read by delta-rs's ``QueryBuilder`` (:func:`cdc_join.storage.keyed.rows_of`);
        ``None`` where that cannot name the values or ``files`` are given: Spark reads it.

        Raises:
            StorageError: a file of ``files`` is not a data file of the snapshot (the table
                moved on since they were listed), as :meth:`read` does.
        """
        dt = self._load(path, version)
        if "deletionVectors" in (dt.protocol().reader_features or []):
            if files is not None:
                return None
            with _delta_errors("read", path):
                return keyed.rows_of(dt, column, values, columns)
        with _delta_errors("read", path):
            found = rows_matching(self._dataset(path, version, files), column, values)
        return found if columns is None else found.select(list(columns))

    def _dataset(self, path: str, version: int | None, files: Sequence[str] | None) -> pa.dataset.Dataset:
        """The snapshot's data files (or ``files`` of them) as a pyarrow dataset.

        Raises:
            StorageError: a file of ``files`` is not a data file of the snapshot.
        """
        dt = self._load(path, version)
        self._check_plain_parquet(dt, path)
        if files is None:
            return dt.to_pyarrow_dataset()
        root = table_root(path)
        in_snapshot = {_file_key(root, a["path"]) for a in self._add_actions(dt, path, ("path",))}
        wanted = {_file_key(root, f): f for f in files}
        missing = [file for key, file in wanted.items() if key not in in_snapshot]
        if missing:
            raise StorageError(
                f"{missing[0]} is not a data file of version {dt.version()} of the Delta table at {path}"
            )
        if _is_local(root):
            # A dataset of just these files: delta-rs builds one fragment per data file of the
            # table (2.6 s for 14,669 subscription files at SF 10), this takes milliseconds.
            # Columns a file lacks (added later) read as null, as in delta-rs's own dataset.
            schema = pa.schema(dt.schema().to_arrow())
            return pa.dataset.dataset(sorted(wanted), schema=schema, format="parquet")
        dataset = dt.to_pyarrow_dataset()
        fragments = [f for f in dataset.get_fragments() if _file_key(root, f.path) in wanted]
        return pa.dataset.FileSystemDataset(fragments, dataset.schema, dataset.format, dataset.filesystem)

    def files(self, path: str, version: int | None = None) -> list[FileStats]:
        """The snapshot's data files with min/max/null counts of the top-level columns.

        Minimums are lower bounds and maximums upper bounds of the file's values (timestamp
        maximums are widened by 999 µs, see :func:`stat_upper_bound`). Nested columns'
        statistics are omitted; a column without statistics maps to ``None``, as do decimals
        wider than 15 digits, whose delta-rs statistics are rounded doubles.
        """
        dt = self._load(path, version)
        key = (table_root(path), dt.version())
        if key not in self._files:
            self._files[key] = self._file_stats(dt, path)
            while len(self._files) > _SNAPSHOTS_KEPT:
                self._files.pop(next(iter(self._files)))
        return list(self._files[key])

    def _file_stats(self, dt: DeltaTable, path: str) -> list[FileStats]:
        self._check_plain_parquet(dt, path)
        root = table_root(path)
        fields = self._spark_schema(dt).fields
        # delta-rs writes decimal statistics as JSON doubles: exact only while a double holds
        # every digit. Wider decimals get no statistics rather than bounds that may be wrong.
        inexact = {
            f.name
            for f in fields
            if isinstance(f.dataType, DecimalType) and f.dataType.precision > _DOUBLE_EXACT_DIGITS
        }
        result = []
        for row in self._add_actions(dt, path):
            num_records = row.get("num_records")
            mins = {f.name: None if f.name in inexact else row.get(f"min.{f.name}") for f in fields}
            maxs = {
                f.name: None if f.name in inexact else stat_upper_bound(f.dataType, row.get(f"max.{f.name}"))
                for f in fields
            }
            result.append(
                FileStats(
                    path=spark_file_uri(root, row["path"]),
                    size_bytes=int(row["size_bytes"]),
                    num_records=None if num_records is None else int(num_records),
                    min_values=mins,
                    max_values=maxs,
                    null_counts={f.name: int_or_none(row.get(f"null_count.{f.name}")) for f in fields},
                )
            )
        return result

    def read_changes(self, path: str, start_version: int, end_version: int | None = None) -> DataFrame:
        """Change Data Feed rows of versions ``start_version..end_version`` (inclusive).

        The range is clamped to the latest version; an empty range gives an empty DataFrame.
        Versions that only rearrange files (OPTIMIZE) contribute no rows.
        """
        dt = self._load(path)
        table_schema = self._spark_schema(dt)
        out_schema = change_feed_schema(table_schema)
        latest = dt.version()
        end = latest if end_version is None else min(end_version, latest)
        if start_version < 0:
            raise StorageError(f"read_changes of {path}: start_version {start_version} is negative")
        if start_version > end:
            return self.spark.createDataFrame([], out_schema)
        with _delta_errors(f"read the change feed (versions {start_version}..{end}) of", path):
            changes = pa.table(dt.load_cdf(starting_version=start_version, ending_version=end))
        if changes.num_rows == 0:
            return self.spark.createDataFrame([], out_schema)
        columns = []
        for field in out_schema.fields:
            if field.name in changes.column_names:
                columns.append(changes[field.name])
            else:
                columns.append(pa.nulls(changes.num_rows))
        # _commit_version arrives as uint64; give createDataFrame a type it casts from cleanly.
        names = [f.name for f in out_schema.fields]
        arrow = pa.Table.from_arrays(columns, names=names)
        arrow = arrow.set_column(
            names.index(COMMIT_VERSION), COMMIT_VERSION, arrow[COMMIT_VERSION].cast(pa.int64())
        )
        # createDataFrame casts every column (string_view, binary_view, ...) to out_schema's types.
        frame = spark_frame(self.spark, arrow, out_schema)
        # The rows are on the driver already: callers can read keys from them without a job.
        setattr(frame, ARROW_ATTRIBUTE, plain_types(arrow))
        return frame

    def append(
        self,
        path: str,
        df: Rows,
        *,
        merge_schema: bool = False,
        expected_version: int | None = None,
        note: str | None = None,
    ) -> WriteMetrics:
        """Append ``df``; with ``merge_schema`` its new columns are added to the table; ``note`` is
        the commit's user metadata."""
        return self._write(
            path, df, "append", expected_version, schema_mode="merge" if merge_schema else None, note=note
        )

    def overwrite(
        self,
        path: str,
        df: Rows,
        *,
        expected_version: int | None = None,
        replace_schema: bool = False,
        note: str | None = None,
    ) -> WriteMetrics:
        """Replace every row of the table with ``df``: same schema, or ``df``'s with ``replace_schema``
        (one commit; the table's history and properties stay); ``note`` is the commit's user
        metadata."""
        return self._write(
            path,
            df,
            "overwrite",
            expected_version,
            schema_mode="overwrite" if replace_schema else None,
            note=note,
        )

    def replace_keys(
        self,
        path: str,
        rows: Rows,
        columns: Sequence[str],
        keys: pa.Table,
        *,
        expected_version: int | None = None,
        note: str | None = None,
    ) -> WriteMetrics:
        """``write_deltalake`` overwriting with the keys as its predicate: one commit, which
        rewrites every file holding one of the keys (delta-rs writes no deletion vectors)."""
        where = keyed.delta_rs_predicate(columns, keys)
        return self._write(path, rows, "overwrite", expected_version, note=note, predicate=where)

    def _write(
        self,
        path: str,
        df: Rows,
        mode: Literal["append", "overwrite"],
        expected_version: int | None,
        schema_mode: Literal["merge", "overwrite"] | None = None,
        note: str | None = None,
        predicate: str | None = None,
    ) -> WriteMetrics:
        dt = self._load_for_write(path, expected_version)
        before_version, before = dt.version(), self._file_records(dt, path)
        root, target = table_root(path), pa.schema(dt.schema().to_arrow())
        action, overwrite = ("append to" if mode == "append" else mode), mode == "overwrite"
        spillable = schema_mode is None and predicate is None
        if spillable and not isinstance(df, ChangeSet) and arrow_of(df) is None and self._can_spill(df, root):
            scratch = tempfile.mkdtemp(prefix="cdc_join_spill_")
            try:
                with _delta_errors(action, path):
                    rows = _spilled(df, os.path.join(scratch, "rows"))
                    inserted = _staged_write(dt, root, rows, target, mode, _guard(expected_version, note))
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            metrics = self._metrics_after(path, before_version, before, count_removed_rows=overwrite)
            return replace(metrics, rows_inserted=inserted)
        # One batch: delta-rs splits a single batch into files in order, but interleaves the
        # leftovers of several batches across files, which would undo a write sorted by key.
        data = self._source_arrow(df, target).combine_chunks()
        with _delta_errors(action, path):
            write_deltalake(
                dt,
                data,
                mode=mode,
                schema_mode=schema_mode,
                **({"predicate": predicate} if predicate is not None else {}),
                storage_options=self.storage_options,
                commit_properties=_guard(expected_version, note),
            )
        # A predicate's overwrite rewrites files: their rows are not all deleted ones.
        counted = overwrite and predicate is None
        metrics = self._metrics_after(path, before_version, before, count_removed_rows=counted)
        return replace(metrics, rows_inserted=int_or_none(metrics.extra["metrics"].get("num_added_rows")))

    def merge(
        self,
        path: str,
        source: Rows,
        spec: MergeSpec,
        *,
        expected_version: int | None = None,
        note: str | None = None,
    ) -> WriteMetrics:
        """MERGE ``source`` (materialized as Arrow first) into the table as ``spec`` says; ``note``
        is the commit's user metadata."""
        if spec.delete_condition is None and not spec.update and not spec.insert:
            raise ValueError("MergeSpec has no clause: set delete_condition, update or insert")
        dt = self._load_for_write(path, expected_version)
        before_version, before = dt.version(), self._file_records(dt, path)
        target = pa.schema(dt.schema().to_arrow())
        # toArrow() runs the source once, here, so the merge never re-evaluates it.
        data = self._source_arrow(source, target)
        if spec.insert and spec.insert_condition is not None and _needs_insert_filter(dt, target):
            data = self._drop_unmatched_uninsertable(dt, data, spec, path)
        excluded = set(spec.exclude_columns)
        new_columns = [c for c in data.column_names if c not in target.names and c not in excluded]
        except_cols = sorted(excluded & set(data.column_names))
        if not spec.merge_schema:
            # Like Delta's UPDATE SET * / INSERT *: source columns the target lacks are ignored.
            except_cols = sorted(set(except_cols) | set(new_columns))
        with _delta_errors("merge into", path):
            merger = dt.merge(
                data,
                spec.on,
                source_alias="s",
                target_alias="t",
                merge_schema=spec.merge_schema and bool(new_columns),
                # The source is in memory: let delta-rs use its statistics to prune target files.
                streamed_exec=False,
                commit_properties=_guard(expected_version, note),
            )
            if spec.delete_condition is not None:
                merger = merger.when_matched_delete(spec.delete_condition)
            if spec.update:
                merger = merger.when_matched_update_all(
                    spec.update_condition, except_cols=except_cols or None
                )
            if spec.insert:
                merger = merger.when_not_matched_insert_all(
                    spec.insert_condition, except_cols=except_cols or None
                )
            raw = merger.execute()
        return self._metrics_after(
            path,
            before_version,
            before,
            raw,
            rows_inserted=int_or_none(raw.get("num_target_rows_inserted")),
            rows_updated=int_or_none(raw.get("num_target_rows_updated")),
            rows_deleted=int_or_none(raw.get("num_target_rows_deleted")),
            files_scanned=int_or_none(raw.get("num_target_files_scanned")),
            files_skipped=int_or_none(raw.get("num_target_files_skipped_during_scan")),
        )

    def _drop_unmatched_uninsertable(
        self, dt: DeltaTable, data: pa.Table, spec: MergeSpec, path: str
    ) -> pa.Table:
        """Drop source rows that fail ``insert_condition`` and match no target row.

        Such rows are no-ops for the MERGE, but delta-rs 1.6 writes a null change-data row for
        them and then fails the table's NOT NULL check ("rows failed validation check") on a
        table with Change Data Feed. Which rows match is decided by DataFusion on the same
        snapshot and with the same SQL the MERGE uses, so the result is unchanged.
        """
        numbered = data.append_column(_ROW_COLUMN, pa.array(range(data.num_rows), pa.int64()))
        sql = (
            f"SELECT s.{_ROW_COLUMN} FROM {_SOURCE_NAME} AS s "
            f"LEFT JOIN (SELECT TRUE AS {_HIT_COLUMN}, * FROM {_TARGET_NAME}) AS t ON ({spec.on}) "
            f"WHERE NOT COALESCE(({spec.insert_condition}), FALSE) "
            f"GROUP BY s.{_ROW_COLUMN} HAVING COUNT(t.{_HIT_COLUMN}) = 0"
        )
        with (
            tempfile.TemporaryDirectory(prefix="cdc_join_merge_source_") as tmp,
            _delta_errors("stage the merge source for", path),
        ):
            write_deltalake(os.path.join(tmp, "source"), numbered)
            query = (
                QueryBuilder()
                .register(_SOURCE_NAME, DeltaTable(os.path.join(tmp, "source")))
                .register(_TARGET_NAME, dt)
            )
            drop = pa.table(query.execute(sql).read_all()).column(0)
        if len(drop) == 0:
            return data
        keep = pc.invert(pc.is_in(numbered[_ROW_COLUMN], value_set=drop))
        return data.filter(keep)

    def delete(self, path: str, predicate: str | None = None) -> WriteMetrics:
        """Delete the rows matching ``predicate`` (all rows when ``None``)."""
        dt = self._load_for_write(path)
        before_version, before = dt.version(), self._file_records(dt, path)
        with _delta_errors("delete from", path):
            raw = dt.delete(predicate)
        # A delete without predicate drops whole files unscanned and reports no row count; the
        # removed files' statistics give it.
        return self._metrics_after(
            path,
            before_version,
            before,
            raw,
            rows_deleted=int_or_none(raw.get("num_deleted_rows")),
            count_removed_rows=predicate is None,
        )

    def evolve(self, path: str, schema: StructType) -> bool:
        """Add ``schema``'s new columns; widen types by rewriting the table (delta-rs has no
        type widening). The rewrite is one overwrite commit: readers see the old or the new
        table, never a mix."""
        dt = self._load_for_write(path)
        current = self._spark_schema(dt)
        target = merge_schemas(current, schema)
        if target == current:
            return False
        arrow_target = pa.schema(spark_schema_to_delta(target).to_arrow())
        with _delta_errors("change the schema of", path):
            if changed_types(current, target):
                rows = self._source_arrow(conform(self.read(path), target), arrow_target)
                write_deltalake(
                    dt,
                    cast_table(rows, arrow_target),
                    mode="overwrite",
                    schema_mode="overwrite",
                    storage_options=self.storage_options,
                )
            else:
                write_deltalake(
                    dt,
                    arrow_target.empty_table(),
                    mode="append",
                    schema_mode="merge",
                    storage_options=self.storage_options,
                )
        return True

    def set_properties(self, path: str, properties: Mapping[str, str]) -> bool:
        """Set the properties whose value differs, in one metadata commit."""
        dt = self._load_for_write(path)
        have = dt.metadata().configuration
        changed = {k: v for k, v in properties.items() if have.get(k) != v}
        if not changed:
            return False
        with _delta_errors("set the table properties of", path):
            dt.alter.set_table_properties(
                changed, raise_if_not_exists=False, commit_properties=CommitProperties(max_commit_retries=0)
            )
        self._latest.pop(table_root(path), None)
        return True

    def optimize(
        self,
        path: str,
        zorder_by: Sequence[str] | None = None,
        target_size: int | None = None,
        *,
        purge: bool = False,
    ) -> WriteMetrics:
        """Z-order by ``zorder_by`` when given, else compact small files (no data change).

        ``purge`` changes nothing here: delta-rs writes no deletion vectors, and its compaction
        rewrites a file it selects without the rows a vector removes."""
        dt = self._load_for_write(path)
        before_version, before = dt.version(), self._file_records(dt, path)
        with _delta_errors("optimize", path):
            if zorder_by:
                raw = dt.optimize.z_order(list(zorder_by), target_size=target_size)
            else:
                raw = dt.optimize.compact(target_size=target_size)
        return self._metrics_after(
            path,
            before_version,
            before,
            raw,
            files_scanned=int_or_none(raw.get("totalConsideredFiles")),
            files_skipped=int_or_none(raw.get("totalFilesSkipped")),
        )

    def history(self, path: str, limit: int | None = None) -> list[dict[str, Any]]:
        """Commits newest first, in the shape of :func:`normalize_history_entry`."""
        dt = self._load(path)
        with _delta_errors("read the history of", path):
            entries = dt.history(limit)
        return [normalize_history_entry(e) for e in entries]
