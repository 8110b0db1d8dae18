"""The distributed storage backend: Delta Lake through the Delta jars on the Spark classpath.

Used on Databricks and on any cluster started with Delta (delta-spark 4.x; ``withSchemaEvolution``
needs 3.2 or later). Table data is read and written by Spark through the public APIs of
delta-spark (``delta.tables.DeltaTable``, ``format("delta")`` reads with ``versionAsOf`` and
``readChangeFeed``, ``OPTIMIZE``), so Spark Connect works too. The one exception is a guarded
append in a session whose JVM is this process's own: there it is one transaction of Delta's
Scala API (:mod:`cdc_join.storage.delta_txn`), which needs no rebuild of the table's state.

Choices that keep this backend interchangeable with :mod:`cdc_join.storage.delta_rs` (the
contract tests in ``tests/contract`` run both):

- ``create`` sets only table properties the runtime knows. Open-source Delta refuses unknown
  ``delta.*`` keys (``DELTA_UNKNOWN_CONFIGURATION``), so Databricks-only ones such as
  ``delta.targetFileSize`` are passed on Databricks only (``DATABRICKS_RUNTIME_VERSION`` set).
  New tables get deletion vectors (``delta.enableDeletionVectors``, Delta 2.3+; MERGE uses them
  from 3.1) unless the caller's properties say otherwise: a MERGE or DELETE that touches a few
  rows of a file marks them deleted instead of rewriting the file. Once a file has a deletion
  vector the table is for this backend only (the delta-rs backend refuses such files).
- ``files`` lists a snapshot's data files with statistics. ``DESCRIBE DETAIL`` gives the table's
  location and id; delta-rs (``deltalake.DeltaTable(location, version).get_add_actions()``, native,
  no Spark job) reads the add actions when it can open that location and finds the same table id.
  Otherwise (a location delta-rs has no credentials for, a protocol it cannot read, column
  mapping) Delta lists the files (``DataFrame.inputFiles()``) and their statistics come from the
  transaction log read with Spark as data: the newest checkpoint at or below the version (with
  its v2 sidecars) and the commits after it, or the whole log if one of those is gone; log paths
  are glob-escaped. Where the log cannot be read either (Unity Catalog managed tables refuse
  path access), the files are listed without statistics, which callers treat as "may hold any
  value". Minimums and maximums are bounds (see :func:`file_stats_from_add`); ``num_records``
  counts live rows (deletion vectors subtracted).
- ``read(files=...)`` reads the snapshot through Delta (deletion vectors and column mapping are
  honoured) and keeps the rows whose ``_metadata.file_name`` is one of the named files (Delta
  data file names carry a UUID, so they are unique within a table). That filter alone skips no
  file: Delta's file index prunes by predicates on data columns only. So the read also filters
  on up to two columns by the union of the named files' [min, max] ranges (and ``IS NULL`` where
  they hold nulls); every row of the named files passes it, so no result changes, and Delta's
  data skipping leaves out the other files whose ranges lie outside it. A keyed read
  (:func:`cdc_join.storage.pruning.read_keyed`) therefore opens only its candidate files, also on
  its semi-join path, where no ``IN`` list reaches Delta.
- MERGE hands its source to Delta as it is: Delta materializes a MERGE source itself whenever a
  second evaluation could see other rows (``spark.databricks.delta.merge.materializeSource``,
  default ``auto``: sources that are not only deterministic Delta scans), which covers the
  duplicates of delta-io/delta#527; ``localCheckpoint`` would lose its blocks when autoscaling
  removes executors and does not exist on Spark Connect. Clauses use
  ``whenMatchedUpdateAll``/``whenNotMatchedInsertAll`` when source and target have exactly the
  same columns (or the source adds columns under ``merge_schema``, with
  ``withSchemaEvolution()``); otherwise they use explicit ``set``/``values`` maps over the
  source's written columns. Columns a ``merge_schema`` merge must add while other columns are
  excluded are added first with ``ALTER TABLE ... ADD COLUMNS`` (every identifier, nested ones
  too, backtick-quoted): an explicit assignment to a column the target does not have yet is not
  something every Delta release evolves.
- Source columns the target lacks are ignored without ``merge_schema`` (Delta's documented
  UPDATE SET * / INSERT * behaviour, and what the delta-rs backend does).
- MERGE metrics: row counts from the DataFrame ``DeltaMergeBuilder.execute()`` returns
  (``num_inserted_rows``, ``num_updated_rows``, ``num_deleted_rows``; the commit's
  ``operationMetrics`` only if a release returns nothing). The version and file counts come from
  the commit itself, one history entry: files added are the data files written, files removed
  the files rewritten plus the files given a deletion vector (``numTargetFilesRemoved +
  numTargetDeletionVectorsAdded``; Delta counts replaced vectors among the added ones). A
  MERGE that changed nothing may commit nothing (Delta skips empty commits) and keeps the
  version. Other writes: row counts from the commit's ``operationMetrics``, files added/removed
  from the difference of the snapshot's file lists, as in delta-rs. Delta MERGE reports no files
  scanned/skipped, so those stay ``None``.
- ``optimize(target_size=...)``: OPTIMIZE reads its target file size only from the session
  (``spark.databricks.delta.optimize.maxFileSize``; the builder has no per-command option), so the
  setting is made for the one command, under a lock, and the previous value restored (or the
  key unset) in a ``finally`` block.
- ``exists`` answers for Delta tables only: a name that resolves to a view is no table.
- ``read_changes`` clamps the end version to the latest version and returns an empty frame
  for an empty range (Delta itself raises when the start is past the latest version), and
  drops ``_commit_timestamp`` like the delta-rs backend.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import reduce
from typing import Any
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType,
    DataType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampNTZType,
)

from cdc_join.changeset import (
    ChangeSet,
    Rows,
    arrow_schema,
    found_in,
    frame_of,
    plain_types,
    to_arrow,
)
from cdc_join.errors import ConcurrentRunError, StorageError, first_line
from cdc_join.locations import glob_escape, has_scheme, is_table_name, local_path, quote_table_name
from cdc_join.schemas import changed_types, conform, merge_schemas, quote, widens_to
from cdc_join.storage import arrow_files, delta_txn, keyed
from cdc_join.storage.base import (
    DATA_PRESERVING_OPERATIONS,
    SMALL_READ_BYTES,
    FileStats,
    MergeSpec,
    WriteMetrics,
    lost_create,
    normalize_history_entry,
    other_files,
    refuse_other_files,
    rows_matching,
)
from cdc_join.storage.stats import (
    basename,
    deleted_rows,
    file_stats_from_add,
    file_stats_from_values,
    int_or_none,
    ranges_predicate,
    skipping_ranges,
)
from cdc_join.storage.untyped import (
    MARK,
    has_untyped,
    is_marked,
    logical_schema,
    needs_storing,
    stored_schema,
    to_logical,
    to_stored,
)

_log = logging.getLogger(__name__)

_COMMIT_TIMESTAMP = "_commit_timestamp"
_OPTIMIZE_MAX_FILE_SIZE = "spark.databricks.delta.optimize.maxFileSize"
_LOG_ADD_SCHEMA = (
    "add struct<path:string, size:long, stats:string, deletionVector:struct<cardinality:long>>, "
    "sidecar struct<path:string>"
)
# Commits and checkpoints are named by their 20-digit version; sidecars by a UUID, whose leading
# digits are no version.
_LOG_VERSION = re.compile(r"^(\d{20})\.")
# Classic (single or part i of n) and v2 (UUID-named manifest) checkpoint files.
_CHECKPOINT_FILE = re.compile(
    r"^(\d{20})\.checkpoint(?:\.(\d+)\.(\d+))?(?:\.[0-9A-Fa-f-]+)?\.(?:parquet|json)$"
)
_DELETION_VECTORS = "delta.enableDeletionVectors"
_TYPE_WIDENING = "delta.enableTypeWidening"
_CHANGE_DATA_FEED = "delta.enableChangeDataFeed"
# Databricks table properties open-source Delta does not know (DeltaConfigs has no entry).
_DATABRICKS_ONLY_PROPERTIES = frozenset({"delta.targetfilesize", "delta.tunefilesizesforrewrites"})
# Snapshots' file lists kept per backend (a keyed read lists a version twice).
_FILE_LISTS_KEPT = 8
# Local tables' schemas kept per backend (by commit file).
_SCHEMAS_KEPT = 256
# OPTIMIZE's target size is a session setting: one OPTIMIZE at a time sets it in this process.
_SESSION_CONF_LOCK = threading.Lock()


def _spark_exception_types() -> tuple[type[BaseException], ...]:
    """Spark's exception classes: AnalysisException, Delta's captured errors, py4j errors."""
    from pyspark.errors import PySparkException

    types: list[type[BaseException]] = [PySparkException]
    try:
        from py4j.protocol import Py4JError

        types.append(Py4JError)
    except ImportError:  # Spark Connect-only installs have no py4j
        pass
    return tuple(types)


#: Delta's commit-conflict exceptions (``delta.exceptions``), by class name: another writer
#: committed something this transaction's reads or writes depend on.
_CONFLICTS = frozenset(
    {
        "DeltaConcurrentModificationException",
        "ConcurrentWriteException",
        "MetadataChangedException",
        "ProtocolChangedException",
        "ConcurrentAppendException",
        "ConcurrentDeleteReadException",
        "ConcurrentDeleteDeleteException",
        "ConcurrentTransactionException",
    }
)
_CONFLICT_TEXT = re.compile(
    r"\b(DELTA_CONCURRENT_\w+|DELTA_METADATA_CHANGED|DELTA_PROTOCOL_CHANGED)\b|"
    + "|".join(sorted(_CONFLICTS))
)


def is_conflict(exc: BaseException) -> bool:
    """Whether ``exc`` is Delta refusing a commit because another writer committed first (by
    class, or, over Spark Connect and py4j where the class may not come through, by name)."""
    if any(c.__name__ in _CONFLICTS for c in type(exc).__mro__):
        return True
    return bool(_CONFLICT_TEXT.search(str(exc)[:2000]))


@contextmanager
def _spark_errors(action: str, path: str) -> Iterator[None]:
    """Re-raise Spark/Delta failures as :class:`StorageError` naming the action and the table;
    a commit conflict as :class:`ConcurrentRunError` (another run wrote the table first)."""
    try:
        yield
    except (StorageError, ConcurrentRunError):
        raise
    except _spark_exception_types() as exc:
        first = first_line(exc)
        if is_conflict(exc):
            raise ConcurrentRunError(
                f"could not {action} the Delta table at {path}: another writer committed first ({first})"
            ) from exc
        raise StorageError(f"Delta (Spark) could not {action} the Delta table at {path}: {first}") from exc


def _ddl_type(data_type: DataType) -> str:
    """A type as Spark SQL DDL with every nested field name backtick-quoted.

    ``simpleString()`` leaves nested names bare (``struct<a-b:int>``), which SQL cannot parse.
    """
    if isinstance(data_type, StructType):
        fields = ", ".join(f"{quote(f.name)}: {_ddl_type(f.dataType)}{_comment(f)}" for f in data_type.fields)
        return f"STRUCT<{fields}>"
    if isinstance(data_type, ArrayType):
        return f"ARRAY<{_ddl_type(data_type.elementType)}>"
    if isinstance(data_type, MapType):
        return f"MAP<{_ddl_type(data_type.keyType)}, {_ddl_type(data_type.valueType)}>"
    return data_type.simpleString()


def _typed_before(frame: DataFrame, stored: StructType, path: str) -> DataFrame:
    """``frame``, refused where it brings the first type of a column the table stores as
    untyped (:mod:`cdc_join.storage.untyped`): a MERGE would cast the values to the stored
    string, and they would read as null. :meth:`DeltaSparkStorage.evolve` comes first."""
    if not is_marked(stored):
        return frame
    marked = {f.name for f in stored.fields if is_marked(f)}
    table = {f.name: f for f in logical_schema(stored).fields if f.name in marked}
    for field in frame.schema.fields:
        known = table.get(field.name)
        if known is not None and not widens_to(field.dataType, known.dataType):
            raise StorageError(
                f"column {field.name!r} of the Delta table at {path} has no type yet "
                f"({known.dataType.simpleString()}); {field.dataType.simpleString()} needs "
                "evolve() before the write"
            )
    return frame


def _marked_at(stored: StructType, parts: Sequence[str]) -> bool:
    """Whether the field at ``parts`` (through structs) of a stored schema holds an untyped void."""
    dtype: DataType = stored
    field = None
    for name in parts:
        if not isinstance(dtype, StructType) or name not in dtype.names:
            return False
        field = dtype[name]
        dtype = field.dataType
    return field is not None and is_marked(field)


def _comment(field: StructField) -> str:
    """A field's comment as DDL (how a void stored as a string is marked, see
    :mod:`cdc_join.storage.untyped`)."""
    comment = field.metadata.get("comment")
    return f" COMMENT {_sql_text(comment)}" if isinstance(comment, str) else ""


def _log_version(file_name: str | None) -> int:
    """The log version a ``_delta_log`` file belongs to (unnumbered files such as sidecars: -1)."""
    match = _LOG_VERSION.match(file_name or "")
    return int(match.group(1)) if match else -1


def on_databricks() -> bool:
    """Whether this process runs in a Databricks runtime."""
    return bool(os.environ.get("DATABRICKS_RUNTIME_VERSION"))


def create_properties(properties: Mapping[str, str] | None, *, cdf: bool, databricks: bool) -> dict[str, str]:
    """The table properties ``create`` sets: deletion vectors on, the caller's properties (they
    win; Databricks-only keys are dropped elsewhere), and the change data feed with ``cdf``.

    Type widening is left off until a column widens (:meth:`DeltaSparkStorage.evolve`): delta-rs,
    which reads local tables' logs and files for this backend, refuses tables with that feature.
    """
    result = {_DELETION_VECTORS: "true"}
    for key, value in (properties or {}).items():
        if not databricks and key.lower() in _DATABRICKS_ONLY_PROPERTIES:
            continue
        result = {k: v for k, v in result.items() if k.lower() != key.lower()}
        result[key] = value
    if cdf:
        result = {k: v for k, v in result.items() if k.lower() != _CHANGE_DATA_FEED.lower()}
        result[_CHANGE_DATA_FEED] = "true"
    return result


def _data_file_uri(location: str, add_path: str) -> str:
    """An add action's ``path`` (URI-encoded; relative to the table unless it has a scheme) as
    Spark names the file: the table location from ``DESCRIBE DETAIL``, ``/``, the decoded path.

    This is the form ``DataFrame.inputFiles()`` returns, so every way of listing files agrees.
    """
    if has_scheme(add_path):
        return unquote(add_path)
    return location.rstrip("/") + "/" + unquote(add_path)


def _delta_rs_uri(location: str) -> str | None:
    """Where delta-rs finds the table at a Spark ``location``, or ``None`` if it cannot."""
    if location.startswith("file:"):
        rest = location[len("file:") :]
        return "/" + rest.lstrip("/")
    if location.startswith("dbfs:"):
        # Classic Databricks clusters mount DBFS at /dbfs; elsewhere delta-rs cannot reach it.
        local = "/dbfs/" + location[len("dbfs:") :].lstrip("/")
        return local if os.path.isdir("/dbfs") else None
    if "://" in location:
        return location  # object stores: delta-rs takes credentials from the environment
    if location.startswith("/"):
        return location  # the default filesystem; a different table there fails the id check
    return None


# ------------------------------------------------------------------ skipping by file ranges


@dataclass(frozen=True)
class MergePlan:
    """How a :class:`MergeSpec` becomes delta-spark builder calls (pure, testable without jars).

    Attributes:
        star: use ``whenMatchedUpdateAll``/``whenNotMatchedInsertAll``.
        evolve: call ``withSchemaEvolution()`` (only with ``star``).
        add_columns: columns to add with ``ALTER TABLE`` before an explicit-map merge.
        assignments: target column → source expression for explicit maps.
    """

    star: bool
    evolve: bool
    add_columns: tuple[str, ...]
    assignments: Mapping[str, str]


def plan_merge(source_columns: Sequence[str], target_columns: Sequence[str], spec: MergeSpec) -> MergePlan:
    """Decide between ``*`` clauses and explicit maps for a merge of these column sets."""
    source_set, target_set = set(source_columns), set(target_columns)
    excluded = set(spec.exclude_columns) & source_set
    new_columns = [c for c in source_columns if c not in target_set and c not in excluded]
    if not excluded and target_set <= source_set:
        if not new_columns:
            return MergePlan(star=True, evolve=False, add_columns=(), assignments={})
        if spec.merge_schema:
            return MergePlan(star=True, evolve=True, add_columns=(), assignments={})
    written = [
        c
        for c in source_columns
        if c not in excluded and (c in target_set or (spec.merge_schema and c in new_columns))
    ]
    return MergePlan(
        star=False,
        evolve=False,
        add_columns=tuple(new_columns) if spec.merge_schema else (),
        assignments={quote(c): f"s.{quote(c)}" for c in written},
    )


class DeltaSparkStorage:
    """:class:`~cdc_join.storage.base.Storage` on delta-spark (Delta jars in the Spark JVM).

    Args:
        spark: the session; it needs the Delta jars and, for SQL on ``delta.`path``` tables,
            ``io.delta.sql.DeltaSparkSessionExtension`` (built into Databricks).
    """

    name = "delta-spark"
    #: A keyed replace marks deleted rows in deletion vectors instead of rewriting files.
    replaces_keys_in_place = True

    def __init__(self, spark: SparkSession) -> None:
        self.spark = spark
        # (location, table id, version) → its files: a version's files never change.
        self._file_lists: dict[tuple[str, str | None, int], list[FileStats]] = {}
        # (root, version) → delta-rs's table of a local table (see _dataset).
        self._delta_rs_tables: dict[tuple[str, int], Any] = {}
        # Locations delta-rs failed to open: not tried again (an object store without
        # credentials can make every attempt wait for credential lookups to time out).
        self._delta_rs_failed: set[str] = set()
        # A local table's commit file (path, version, inode, mtime, size) → the schema it leaves.
        self._schemas: dict[tuple[str, int, int, int, int], StructType] = {}
        # Whether guarded appends can be Delta transactions in this JVM (None: not asked yet).
        self._delta_log: bool | None = None

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _location(path: str | os.PathLike[str]) -> str:
        # Spark resolves paths itself (local, dbfs:, abfss:, s3a: ...); only PathLikes need text.
        return os.fspath(path)

    @staticmethod
    def _sql_ref(path: str) -> str:
        """How SQL names the table: ```catalog`.`schema`.`table``` or ``delta.`<path>```."""
        if is_table_name(path):
            return quote_table_name(path)
        return "delta.`{}`".format(os.fspath(path).replace("`", "``"))

    def _storage_location(self, path: str) -> str:
        """The table's folder (named tables: from DESCRIBE DETAIL), for reading its log."""
        if not is_table_name(path):
            return self._location(path)
        return self._detail(path)[0]

    def _detail(self, path: str) -> tuple[str, str | None]:
        """The table's location as Spark qualifies it, and its id, from ``DESCRIBE DETAIL``
        (a local table's location without it, and no id: its path names it)."""
        log = _local_log(path)
        if log is not None:
            return "file:" + os.path.dirname(os.path.abspath(log)), None
        with _spark_errors("describe", path):
            row = self.spark.sql(f"DESCRIBE DETAIL {self._sql_ref(path)}").select("location", "id").head()
        if row is None or row["location"] is None:
            raise StorageError(f"DESCRIBE DETAIL names no location for the Delta table at {path}")
        return str(row["location"]), None if row["id"] is None else str(row["id"])

    def _snapshot(self, path: str, version: int | None = None) -> DataFrame:
        """The table's rows at ``version`` (default latest), voids read as voids: read on the
        driver where :meth:`_small_snapshot` can, else by Delta's reader."""
        small = self._small_snapshot(path, version)
        return small if small is not None else to_logical(self._stored(path, version))

    def _small_snapshot(self, path: str, version: int | None) -> DataFrame | None:
        """A local table's snapshot whose data files come to at most :data:`SMALL_READ_BYTES`,
        read on the driver (:meth:`_dataset`: no deletion vector, mapped column, partition or
        stored void), in the table's logical schema with its NOT NULLs, with the Arrow rows
        attached (:data:`~cdc_join.changeset.ARROW_ATTRIBUTE`, so keys and counts of it need no
        Spark job); ``None`` elsewhere. Delta 4.4 computes a snapshot's state from its log with
        Spark jobs for every read of a version (three "Compute snapshot" jobs and a file
        filtering job before the scan's own): a run's first read of a small bronze or state
        table cost 7 jobs per source, its full refresh 21 per state table."""
        log = _local_log(path)
        resolved = None if log is None else _local_log_version(log) if version is None else int(version)
        if log is None or resolved is None:
            return None
        dataset = self._dataset(path, resolved, None)  # the version the schema is read at
        if dataset is None:
            return None
        try:
            size = sum(os.path.getsize(f) for f in dataset.files)
        except OSError:
            return None
        stored = None if size > SMALL_READ_BYTES else _local_schema(log, resolved)
        if stored is None:
            return None
        schema = logical_schema(stored)
        try:  # the frame carries its rows (ChangeSet.frame)
            return ChangeSet(self.spark, schema, plain_types(dataset.to_table())).frame
        except Exception:  # a file gone since, or rows Spark takes otherwise: Delta's reader
            return None

    def _stored(self, path: str, version: int | None = None) -> DataFrame:
        """The table's rows as stored (:mod:`cdc_join.storage.untyped`)."""
        if not self.exists(path):
            raise StorageError(f"No Delta table at {path}")
        with _spark_errors("read" if version is None else f"read version {version} of", path):
            if is_table_name(path):
                travel = "" if version is None else f" VERSION AS OF {int(version)}"
                return self.spark.sql(f"SELECT * FROM {self._sql_ref(path)}{travel}")
            reader = self.spark.read.format("delta")
            if version is not None:
                reader = reader.option("versionAsOf", int(version))
            return reader.load(self._location(path))

    def _stored_schema(self, path: str) -> StructType:
        """The table's latest schema as stored. A local table's is kept per commit file (a run
        reads a table's schema several times between two of its commits; a table deleted and
        created again has new files); other tables' is read each time."""
        log = _local_log(path)
        version = None if log is None else _local_log_version(log)
        if log is None or version is None:
            return self._stored(path).schema
        try:
            commit = os.stat(os.path.join(log, f"{version:020d}.json"))
        except FileNotFoundError:
            return self._stored(path).schema
        key = (os.path.abspath(log), version, commit.st_ino, commit.st_mtime_ns, commit.st_size)
        found = self._schemas.get(key)
        if found is None:
            found = _local_schema(log, version) or self._stored(path, version).schema
            if len(self._schemas) >= _SCHEMAS_KEPT:
                self._schemas.clear()
            self._schemas[key] = found
        return found

    def _save(self, writer: Any, path: str) -> None:
        if is_table_name(path):
            writer.saveAsTable(path)
        else:
            writer.save(self._location(path))

    def _log_adds(
        self, path: str, version: int, names: set[str], location: str | None = None
    ) -> dict[str, Any]:
        """The latest add action (at or below ``version``) of each data file named in ``names``.

        Reads the newest complete checkpoint at or below ``version`` (with the sidecars a v2
        checkpoint lists) and the commits after it up to ``version``, or every commit up to
        ``version`` when there is no such checkpoint; if one of those files is gone, the whole
        log (the slow path).
        """
        if not names:
            return {}
        log = (location or self._storage_location(path)).rstrip("/") + "/_delta_log"
        checkpoint = self._checkpoint_version(path, log, version)
        rows = self._log_add_rows(path, log, names, checkpoint, version)
        if rows is None:
            rows = self._log_add_rows(path, log, names, None, None)
        latest: dict[str, tuple[int, Any]] = {}
        for row in rows or []:
            log_version = _log_version(row["log_file"])
            if log_version > version:
                continue
            # Names in the log are URL-encoded; Delta's own file names never need encoding.
            name = row["name"]
            if name not in latest or log_version >= latest[name][0]:
                latest[name] = (log_version, row)
        return {name: row for name, (_, row) in latest.items()}

    def _checkpoint_version(self, path: str, log: str, version: int) -> int | None:
        """The newest checkpoint at or below ``version`` with all its parts, from the names of the
        checkpoint files (``_last_checkpoint`` cannot be read with Spark: its file index leaves
        out every file whose name starts with ``_``)."""
        try:
            listing = self.spark.read.format("binaryFile").load(f"{glob_escape(log)}/*.checkpoint*")
        except _spark_exception_types() as exc:
            if "PATH_NOT_FOUND" in str(exc) or "Path does not exist" in str(exc):
                return None
            raise StorageError(f"Cannot list the checkpoints of {path}: {exc}") from exc
        with _spark_errors("list the checkpoints of", path):
            # Without the content column binaryFile reads no file, it only lists them.
            files = [basename(str(r["path"])) for r in listing.select("path").collect()]
        parts: dict[int, set[int]] = {}
        complete: set[int] = set()
        for name in files:
            match = _CHECKPOINT_FILE.match(name)
            if match is None:
                continue
            checkpoint = int(match.group(1))
            if match.group(2) is None:
                complete.add(checkpoint)  # single-file classic or v2 checkpoint
                continue
            parts.setdefault(checkpoint, set()).add(int(match.group(2)))
            if len(parts[checkpoint]) == int(match.group(3)):
                complete.add(checkpoint)
        usable = [c for c in complete if c <= version]
        return max(usable) if usable else None

    def _log_add_rows(
        self, path: str, log: str, names: set[str], checkpoint: int | None, version: int | None
    ) -> list[Any] | None:
        """Add actions of ``names`` with the log file each came from.

        ``checkpoint`` and ``version`` bound the read to that checkpoint (with the sidecars a v2
        checkpoint lists) and the commits after it up to ``version`` (no checkpoint: from 0);
        ``version=None`` reads the whole log. Returns ``None`` when a bounded read misses a file
        it needs.
        """
        escaped = glob_escape(log)
        if version is None:
            frames = self._read_log(path, "json", [f"{escaped}/*.json"], _LOG_ADD_SCHEMA)
            frames += self._read_log(path, "parquet", [f"{escaped}/*.checkpoint*.parquet"], _LOG_ADD_SCHEMA)
            frames += self._read_log(path, "parquet", [f"{escaped}/_sidecars/*.parquet"], _LOG_ADD_SCHEMA)
        else:
            frames = []
            if checkpoint is not None:
                prefix = f"{escaped}/{checkpoint:020d}.checkpoint"
                frames += self._read_log(path, "parquet", [f"{prefix}*.parquet"], _LOG_ADD_SCHEMA)
                frames += self._read_log(path, "json", [f"{prefix}.*.json"], _LOG_ADD_SCHEMA)
                if not frames:
                    return None
            first = 0 if checkpoint is None else checkpoint + 1
            commits = [f"{escaped}/{v:020d}.json" for v in range(first, version + 1)]
            if commits:
                found = self._read_log(path, "json", commits, _LOG_ADD_SCHEMA)
                if not found:
                    return None
                frames += found
        rows = self._collect_adds(path, frames, names, with_sidecars=version is not None)
        if version is None or checkpoint is None:
            return [r for r in rows if r["sidecar"] is None]
        sidecars = sorted({r["sidecar"] for r in rows if r["sidecar"] is not None})
        if sidecars:
            patterns = [
                glob_escape(unquote(s)) if has_scheme(s) else f"{escaped}/_sidecars/{glob_escape(unquote(s))}"
                for s in sidecars
            ]
            found = self._read_log(path, "parquet", patterns, _LOG_ADD_SCHEMA)
            if not found:
                return None
            # Sidecar file names carry no version: their adds are the checkpoint's.
            named = [f.withColumn("log_file", F.lit(f"{checkpoint:020d}.checkpoint.sidecar")) for f in found]
            rows += self._collect_adds(path, named, names, with_sidecars=False)
        return [r for r in rows if r["sidecar"] is None]

    def _collect_adds(
        self, path: str, frames: list[DataFrame], names: set[str], *, with_sidecars: bool
    ) -> list[Any]:
        """The add actions of ``names`` in ``frames`` (and, ``with_sidecars``, the sidecar files
        that v2 checkpoints among them list), in one Spark job."""
        if not frames:
            return []
        log = reduce(lambda a, b: a.unionByName(b), frames)
        name_of = F.element_at(F.split(F.col("add.path"), "/"), -1)
        wanted = F.col("add").isNotNull() & name_of.isin(sorted(names))
        if with_sidecars:
            wanted = wanted | F.col("sidecar").isNotNull()
        with _spark_errors("read the transaction log of", path):
            return (
                log.where(wanted)
                .select(
                    F.col("add.path").alias("path"),
                    F.col("add.size").alias("size"),
                    F.col("add.stats").alias("stats"),
                    F.col("add.deletionVector.cardinality").alias("dv_cardinality"),
                    F.col("log_file"),
                    name_of.alias("name"),
                    F.col("sidecar.path").alias("sidecar"),
                )
                .collect()
            )

    def _read_log(self, path: str, fmt: str, patterns: list[str], schema: str) -> list[DataFrame]:
        """``patterns`` (glob-escaped) read as JSON or parquet: one frame, or none if no file matched."""
        reader = self.spark.read.schema(schema)
        try:
            frame = reader.json(patterns) if fmt == "json" else reader.parquet(*patterns)
        except _spark_exception_types() as exc:
            # A path that matches nothing is an AnalysisException at load time; anything else
            # (no permission to read the log, ...) is a real failure.
            if "PATH_NOT_FOUND" in str(exc) or "Path does not exist" in str(exc):
                return []
            raise StorageError(f"Cannot read the transaction log of {path}: {exc}") from exc
        return [frame.withColumn("log_file", F.col("_metadata.file_name"))]

    # ------------------------------------------------------------------ protocol: tables

    def exists(self, path: str) -> bool:
        """Whether a Delta table is at ``path`` (a name that resolves to a view is no table)."""
        if is_table_name(path):
            with _spark_errors("probe", path):
                if not self.spark.catalog.tableExists(path):
                    return False
                table = self.spark.catalog.getTable(path)
                return not (table.isTemporary or "VIEW" in str(table.tableType or "").upper())
        log = _local_log(path)
        if log is not None:
            return _local_log_version(log) is not None
        try:
            self.spark.sql(f"DESCRIBE DETAIL {self._sql_ref(path)}").select("format").head()
        except _spark_exception_types() as exc:
            if _NOT_A_TABLE.search(str(exc)[:2000]):
                return False
            raise StorageError(f"Delta (Spark) could not probe {path}: {first_line(exc)}") from exc
        return True

    def create(
        self,
        path: str,
        schema: StructType,
        *,
        cdf: bool = True,
        properties: Mapping[str, str] | None = None,
    ) -> bool:
        """Create an empty table if none is at ``path``; return whether this call created it.

        One ``CREATE TABLE`` statement (SQL, so Spark Connect needs no Delta Connect plugin).
        Properties the runtime does not know are left out (see :func:`create_properties`); the
        table features its types need are named (``timestampNtz``).
        """
        if self.exists(path):
            return False
        if not is_table_name(path):
            refuse_other_files(path)
        schema = stored_schema(schema)
        columns = ", ".join(
            f"{quote(f.name)} {_ddl_type(f.dataType)}{'' if f.nullable else ' NOT NULL'}{_comment(f)}"
            for f in schema.fields
        )
        props = {**create_properties(properties, cdf=cdf, databricks=on_databricks()), **_features(schema)}
        listed = ", ".join(f"{_sql_text(k)} = {_sql_text(v)}" for k, v in props.items())
        try:
            with _spark_errors("create", path):
                self.spark.sql(
                    f"CREATE TABLE {self._sql_ref(path)} ({columns}) USING delta TBLPROPERTIES ({listed})"
                )
        except (StorageError, ConcurrentRunError) as exc:
            # Lost a race with another creator: the table is there now (or soon), and it is not ours.
            # Delta says a folder holding only the other creator's unfinished ``_delta_log`` "is not
            # empty and also not a Delta table": that is the same race, unless other files are there.
            being_created = _NON_EMPTY.search(str(exc)) is not None and not other_files(path)
            return lost_create(self.exists, path, exc, being_created=being_created)
        self._forget(path)
        return True

    def version(self, path: str) -> int:
        """The latest version of the table: the newest commit in a local table's log, else
        ``DESCRIBE HISTORY``."""
        log = _local_log(path)
        if log is not None:
            found = _local_log_version(log)
            if found is None:
                raise StorageError(f"No Delta table at {path}")
            return found
        entries = self.history(path, 1)
        if not entries:
            raise StorageError(f"No Delta table at {path}")
        return int(entries[0]["version"])

    def schema(self, path: str) -> StructType:
        """The table's current schema (nullability as declared in the table)."""
        return logical_schema(self._stored_schema(path))

    def history(self, path: str, limit: int | None = None) -> list[dict[str, Any]]:
        """Commits newest first (see :func:`cdc_join.storage.base.normalize_history_entry`)."""
        keys = (
            "version",
            "timestamp",
            "operation",
            "operationParameters",
            "operationMetrics",
            "userMetadata",
        )
        return [{k: e[k] for k in keys} for e in self._commits(path, limit)]

    def _commits(self, path: str, limit: int | None = None) -> list[dict[str, Any]]:
        """``DESCRIBE HISTORY`` rows, newest first, with the commit's user metadata and the
        version its transaction read (a local table's: its commit files, read directly)."""
        log = _local_log(path)
        if log is not None:
            found = _local_commits(log, limit)
            if found is None:
                raise StorageError(f"No Delta table at {path}")
            return found
        if not self.exists(path):
            raise StorageError(f"No Delta table at {path}")
        bound = "" if limit is None else f" LIMIT {int(limit)}"
        with _spark_errors("read the history of", path):
            rows = (
                self.spark.sql(f"DESCRIBE HISTORY {self._sql_ref(path)}{bound}")
                .select(
                    "version",
                    # Epoch milliseconds: a collected TimestampType is a naive datetime in the
                    # Python process's local zone, which need not be UTC.
                    F.unix_millis("timestamp").alias("timestamp"),
                    "operation",
                    "operationParameters",
                    "operationMetrics",
                    "userMetadata",
                    "readVersion",
                )
                .collect()
            )
        return [
            {
                **normalize_history_entry(d),
                "userMetadata": d.get("userMetadata"),
                "readVersion": d.get("readVersion"),
            }
            for d in (r.asDict(recursive=True) for r in rows)
        ]

    # ------------------------------------------------------------------ protocol: writes

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
        option = ("mergeSchema", "true") if merge_schema else None
        return self._write(path, df, "append", option, expected_version, note)

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
        (Delta's ``overwriteSchema``; one commit, history and properties stay); ``note`` is the
        commit's user metadata."""
        if isinstance(df, ChangeSet) and not replace_schema:
            rewritten = self._rewrite_small(path, df, expected_version, note)
            if rewritten is not None:
                return rewritten
        option = ("overwriteSchema", "true") if replace_schema else None
        return self._write(path, df, "overwrite", option, expected_version, note)

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
        """Delta's ``replaceWhere`` with the keys as its predicate: one commit whose delete marks
        the rows in deletion vectors, where the table has them, instead of rewriting their files
        (and reads only the key columns to find them); the change data feed of a deletion vector
        is derived from it, so no column is read for it either. A feed reader sees a replaced
        key as ``delete`` and ``insert`` in one commit (docs/storage.md)."""
        if str(self.spark.conf.get("spark.sql.parser.escapedStringLiterals", "false")).lower() == "true":
            raise StorageError("replace_keys needs spark.sql.parser.escapedStringLiterals off")
        where = keyed.spark_predicate(columns, keys)
        # Delta checks every written row against a replaceWhere predicate, evaluated row by row:
        # an IN of 4,650 keys made writing 4,386 rows one task of 1.7 s (TPC-H SF 1). Rows on
        # the driver are checked here instead, at once; a lazy frame keeps Delta's check.
        on_driver = isinstance(rows, ChangeSet)
        if on_driver:
            keyed.check_named(rows.table, columns, keys)
            if expected_version is not None:
                rewritten = self._rewrite_small(path, rows, expected_version, note, (columns, keys, where))
                if rewritten is not None:
                    return rewritten
        with _session_confs(self.spark, {REPLACE_WHERE_CHECK: "false"} if on_driver else {}, optional=True):
            return self._write(path, rows, "overwrite", ("replaceWhere", where), expected_version, note)

    def _write(
        self,
        path: str,
        rows: Rows,
        mode: str,
        option: tuple[str, str] | None,
        expected_version: int | None,
        note: str | None = None,
    ) -> WriteMetrics:
        if mode == "append" and option is None and isinstance(rows, ChangeSet):
            appended = self._append_file(path, rows, expected_version, note)
            if appended is not None:
                return appended
        df = _few_files(rows)
        self._check_version(path, expected_version)
        replacing = option == ("overwriteSchema", "true")
        if not replacing and self.exists(path):
            df = _typed_before(df, self._stored_schema(path), path)
        if has_untyped(df.schema):
            df = to_stored(df, None if replacing else self.schema(path))
        if option is not None and option[0] != "replaceWhere":
            self._enable_features(path, df.schema)
        guard = _Guard.of(expected_version, note)
        if (
            guard is not None
            and mode == "append"
            and option is None
            and self._appends_in_jvm(path, df.schema)
        ):
            try:
                with _spark_errors("append to", path):
                    location = self._location(path)
                    delta_txn.append_at(self.spark, location, df, guard.expected, GUARD_APP_ID, guard.token)
            except delta_txn.Unsupported as exc:
                _log.info("guarded appends go through the data-frame writer: %s", exc)
                self._delta_log = False
            else:
                self._forget(path)
                return self._metrics(path, self._commit_of(path, guard), mode)
        writer = df.write.format("delta").mode(mode)
        if option is not None:
            writer = writer.option(*option)
        if guard is not None:
            writer = (
                writer.option("txnAppId", GUARD_APP_ID)
                .option("txnVersion", str(guard.txn_version))
                .option("userMetadata", guard.token)
            )
        elif note is not None:
            writer = writer.option("userMetadata", note)
        with _spark_errors("append to" if mode == "append" else mode, path):
            self._save(writer, path)
        self._forget(path)
        return self._metrics(path, self._commit_of(path, guard), mode)

    def _appends_in_jvm(self, path: str, schema: StructType) -> bool:
        """Whether a guarded append to ``path`` can be one transaction of Delta's own API
        (:mod:`cdc_join.storage.delta_txn`): a path table of this session's open-source Delta,
        and rows with exactly the table's columns and types."""
        if self._delta_log is None:
            self._delta_log = delta_txn.delta_log_class(self.spark) is not None
        if not self._delta_log or is_table_name(path) or not self.exists(path):
            return False
        return delta_txn.same_columns(schema, self._stored_schema(path))

    def _append_file(
        self, path: str, rows: ChangeSet, expected_version: int | None, note: str | None
    ) -> WriteMetrics | None:
        """Rows on the driver appended as one data file written here, in one Delta transaction
        (:func:`cdc_join.storage.delta_txn.append_file`: no Spark query), where the table is a
        folder on this machine that takes such a file and the rows have exactly its columns and
        types; ``None``, with nothing written, where not (Spark's writer then appends them)."""
        folder = None if is_table_name(path) else local_path(self._location(path))
        if folder is None or not self._appends_in_jvm(path, rows.schema):
            return None
        stored = self._stored_schema(path)
        if is_marked(stored) or has_untyped(rows.schema):
            return None
        self._check_version(path, expected_version)
        try:  # nullable in the file, as Spark writes it; Delta's NOT NULL is checked apart
            kinds = pa.schema([f.with_nullable(True) for f in arrow_schema(stored)])
            table = rows.table.select(stored.names).cast(kinds)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, KeyError, TypeError, ValueError):
            return None
        guard = _Guard.of(expected_version, note)
        with _spark_errors("append to", path):
            version = self._in_jvm(
                "appends of rows on the driver go through the data-frame writer",
                lambda: delta_txn.append_file(
                    self.spark,
                    self._location(path),
                    folder,
                    table,
                    None if guard is None else guard.expected,
                    GUARD_APP_ID,
                    note if guard is None else guard.token,
                ),
            )
        if version is None:
            return None
        self._forget(path)
        metrics = {"numFiles": 1, "numOutputRows": table.num_rows}
        return WriteMetrics(
            version=version,
            rows_inserted=table.num_rows,
            files_added=1,
            files_removed=0,
            extra={"operation": "WRITE", "metrics": metrics},
        )

    def _in_jvm(self, fallback: str, write: Callable[[], int | None]) -> int | None:
        """``write``, a transaction of Delta's own API (:mod:`cdc_join.storage.delta_txn`):
        the version it committed, or ``None`` where it wrote nothing and the caller's Spark
        path writes instead. Where this session's Delta has no such API (``Unsupported``), it
        says so once (``fallback``: what happens instead) and is not asked again."""
        try:
            return write()
        except delta_txn.Unsupported as exc:
            _log.info("%s: %s", fallback, exc)
            self._delta_log = False
            return None

    def _rewrite_small(
        self,
        path: str,
        rows: ChangeSet,
        expected_version: int | None,
        note: str | None,
        replaced: tuple[Sequence[str], pa.Table, str] | None = None,
    ) -> WriteMetrics | None:
        """An overwrite of a small table as one file written here, every file of it swapped
        for the new one in one Delta transaction (:func:`cdc_join.storage.delta_txn.rewrite_files`:
        no Spark job): of every row, or, with ``replaced`` (the key columns, the keys and their
        predicate), of the keys' rows only (:meth:`replace_keys`), the table's other rows read
        on the driver and kept, with a change data file of the deleted and inserted rows where
        the table has the change data feed (an overwrite of every row writes none: a feed
        reader reads its removed files as deletes, as of Delta's own overwrite). At
        ``expected_version``, guarded as :meth:`append` is; without it, at the latest version.
        For a local table this session's Delta writes to whose checksum lists its files
        (Delta lists up to 50), for a keyed replace of at most :data:`SMALL_REWRITE_BYTES`;
        ``None`` elsewhere, with nothing written, and Spark's writer writes."""
        folder = None if is_table_name(path) else local_path(self._location(path))
        if folder is None or not self._appends_in_jvm(path, rows.schema):
            return None
        expected = self.version(path) if expected_version is None else expected_version
        most = SMALL_REWRITE_BYTES if replaced is not None else sys.maxsize
        checksum = _small_checksum(folder, expected, most)
        stored = self._stored_schema(path)
        if checksum is None or is_marked(stored) or has_untyped(rows.schema) or _refused(checksum):
            return None
        listed, conf = checksum["allFiles"], checksum["metadata"].get("configuration") or {}
        try:  # nullable in the file, as Spark writes it; Delta's NOT NULL is checked apart
            kinds = pa.schema([f.with_nullable(True) for f in arrow_schema(stored)])
            new = rows.table.select(stored.names).cast(kinds)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, KeyError, TypeError, ValueError):
            return None
        merged, deleted, changes, where = new, _live_rows(checksum), None, None
        if replaced is not None:
            feed = str(conf.get(_CHANGE_DATA_FEED, "false")).lower() == "true"
            found = self._keys_replaced_here(path, expected, kinds, new, replaced[:2], feed)
            if found is None:
                return None
            (merged, deleted, changes), where = found, replaced[2]
        guarded = expected_version is not None
        token = _Guard.token_of(note) if guarded else note
        rewrite = delta_txn.Rewrite(
            expected, GUARD_APP_ID if guarded else None, token, where, deleted or 0, new.num_rows
        )
        with _spark_errors("replace rows of" if replaced else "overwrite", path):
            version = self._in_jvm(
                "small overwrites go through Spark's writer",
                lambda: delta_txn.rewrite_files(
                    self.spark, self._location(path), folder, listed, merged, changes, rewrite
                ),
            )
        if version is None:
            return None
        self._forget(path)
        return _rewritten(version, rewrite, len(listed), merged.num_rows, deleted, changes)

    def _keys_replaced_here(
        self,
        path: str,
        version: int,
        kinds: pa.Schema,
        new: pa.Table,
        replaced: tuple[Sequence[str], pa.Table],
        feed: bool,
    ) -> tuple[pa.Table, int, pa.Table | None] | None:
        """The rows of the table at ``version``, read on the driver, with the rows of the keys
        (``replaced``: the key columns and the keys) replaced by ``new``; the rows deleted; the
        change data rows with ``feed`` (:func:`_keys_replaced`). ``None`` where the rows cannot
        be read here."""
        found = self._driver_table(path, version)
        if found is None:
            return None
        try:
            current = keyed.all_rows(found[0]).select(kinds.names).cast(kinds)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, KeyError, TypeError, ValueError):
            return None
        merged, old, changes = _keys_replaced(current, new, *replaced, feed)
        return merged, old.num_rows, changes

    def _metrics(self, path: str, commit: Mapping[str, Any], mode: str) -> WriteMetrics:
        """A write's metrics from its commit's history entry."""
        raw = commit.get("operationMetrics") or {}
        return WriteMetrics(
            version=int(commit["version"]) if commit else self.version(path),
            rows_inserted=int_or_none(raw.get("numOutputRows")),
            rows_deleted=int_or_none(raw.get("numDeletedRows")) if mode == "overwrite" else None,
            files_added=int_or_none(raw.get("numFiles")),
            files_removed=int_or_none(raw.get("numRemovedFiles")) if mode == "overwrite" else 0,
            extra={"operation": commit.get("operation"), "metrics": dict(raw)},
        )

    def merge(
        self,
        path: str,
        source: Rows,
        spec: MergeSpec,
        *,
        expected_version: int | None = None,
        note: str | None = None,
    ) -> WriteMetrics:
        """``MERGE INTO`` as ``spec`` says, in SQL over a temporary view of the source (Delta
        materializes the source when it must, see the module docstring); ``note`` is the commit's
        user metadata."""
        if spec.delete_condition is None and not spec.update and not spec.insert:
            raise ValueError("MergeSpec has no clause: set delete_condition, update or insert")
        self._check_version(path, expected_version)
        stored = self._stored_schema(path)
        frame = to_stored(_typed_before(frame_of(source), stored, path), logical_schema(stored))
        target_columns = stored.names
        plan = plan_merge(frame.columns, target_columns, spec)
        if plan.add_columns:
            fields = {f.name: f for f in frame.schema.fields}
            columns = ", ".join(
                f"{quote(c)} {_ddl_type(fields[c].dataType)}{_comment(fields[c])}" for c in plan.add_columns
            )
            self._enable_features(path, StructType([fields[c] for c in plan.add_columns]))
            with _spark_errors("add columns to", path):
                self.spark.sql(f"ALTER TABLE {self._sql_ref(path)} ADD COLUMNS ({columns})")
            self._forget(path)
            if expected_version is not None:
                expected_version = self._moved_by_us(path, expected_version)
        elif plan.evolve:
            self._enable_features(path, frame.schema)
        view = f"cdc_join_merge_{uuid.uuid4().hex}"
        frame.createOrReplaceTempView(view)
        guard = _Guard.of(expected_version, note)
        noted = _guard_confs(guard) if guard is not None else {} if note is None else {_USER_METADATA: note}
        try:
            with _spark_errors("merge into", path), _session_confs(self.spark, noted):
                result = self.spark.sql(merge_sql(self._sql_ref(path), view, spec, plan)).collect()
        finally:
            self.spark.catalog.dropTempView(view)
        self._forget(path)
        commit = self._commit_of(path, guard)
        return _merge_metrics(commit, result[0].asDict() if result else {}, self.version(path))

    def delete(self, path: str, predicate: str | None = None) -> WriteMetrics:
        """Delete the rows matching ``predicate`` (all rows when ``None``)."""
        before = self.version(path)
        where = "" if predicate is None else f" WHERE {predicate}"
        with _spark_errors("delete from", path):
            result = self.spark.sql(f"DELETE FROM {self._sql_ref(path)}{where}").collect()
        self._forget(path)
        commit = self._commit_of(path, None)
        raw = commit.get("operationMetrics") or {} if commit.get("version", before) != before else {}
        deleted = int_or_none(raw.get("numDeletedRows"))
        if deleted is None and result and "num_affected_rows" in result[0].asDict():
            deleted = int_or_none(result[0]["num_affected_rows"])
        return WriteMetrics(
            version=self.version(path),
            rows_deleted=deleted if deleted is not None else 0,
            files_added=int_or_none(raw.get("numAddedFiles")) if raw else 0,
            files_removed=_removed_files(raw) if raw else 0,
            extra={"operation": commit.get("operation") if raw else None, "metrics": dict(raw)},
        )

    def evolve(self, path: str, schema: StructType) -> bool:
        """Add ``schema``'s new columns; widen types in place with Delta's type widening
        (``delta.enableTypeWidening`` is turned on for it: no file is rewritten), or, where Delta
        cannot widen a type, by rewriting the table once with ``overwriteSchema``."""
        stored = self._stored_schema(path)
        current = logical_schema(stored)
        target = merge_schemas(current, schema)
        # A void under an array or a map as delta-rs writes it: Delta (Spark) cannot write to
        # the table until it is stored as this backend stores it (cdc_join.storage.untyped).
        as_written_by_delta_rs = has_untyped(stored)
        if target == current and not as_written_by_delta_rs:
            return False
        changed = changed_types(current, target)
        self._enable_features(path, target)
        # A column stored untyped that gets a type is rewritten with the new comments: an
        # in-place change would keep the stale one.
        untyped = any(_marked_at(stored, parts) or needs_storing(t) for parts, t in changed)
        if as_written_by_delta_rs or (changed and (untyped or not self._widened(path, changed))):
            with _spark_errors("change the schema of", path):
                rows = to_stored(conform(self._snapshot(path), target))
                writer = rows.write.format("delta").mode("overwrite").option("overwriteSchema", "true")
                self._save(writer, path)
            self._forget(path)
            return True
        with _spark_errors("change the schema of", path):
            if self.schema(path) != target:  # new columns: an empty append with schema merging
                empty = self.spark.createDataFrame([], stored_schema(target))
                self._save(empty.write.format("delta").mode("append").option("mergeSchema", "true"), path)
        self._forget(path)
        return True

    def set_properties(self, path: str, properties: Mapping[str, str]) -> bool:
        """Set the properties whose value differs, in one ``ALTER TABLE … SET TBLPROPERTIES``."""
        have = self._properties(path)
        changed = {k: v for k, v in properties.items() if have.get(k) != v}
        if not changed:
            return False
        listed = ", ".join(f"{_sql_text(k)} = {_sql_text(v)}" for k, v in changed.items())
        with _spark_errors("set the table properties of", path):
            self.spark.sql(f"ALTER TABLE {self._sql_ref(path)} SET TBLPROPERTIES ({listed})")
        self._forget(path)
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

        With ``purge``, ``REORG TABLE … APPLY (PURGE)`` instead: every file with a deletion
        vector is rewritten without the rows it removes, whatever its size (OPTIMIZE leaves a
        file alone that fills a bin by itself, however many of its rows are deleted).
        ``target_size`` is ``spark.databricks.delta.optimize.maxFileSize`` for this command only:
        the session's setting is put back afterwards (:func:`_session_confs`).
        """
        if not self.exists(path):
            raise StorageError(f"No Delta table at {path}")
        if purge and zorder_by:
            raise ValueError("optimize: purge and zorder_by are exclusive")
        before = self.version(path)
        order = "" if not zorder_by else " ZORDER BY (" + ", ".join(quote(c) for c in zorder_by) + ")"
        size = {} if target_size is None else {_OPTIMIZE_MAX_FILE_SIZE: str(int(target_size))}
        ref = self._sql_ref(path)
        sql = f"REORG TABLE {ref} APPLY (PURGE)" if purge else f"OPTIMIZE {ref}{order}"
        with _spark_errors("purge" if purge else "optimize", path), _session_confs(self.spark, size):
            row = self.spark.sql(sql).head()
        self._forget(path)
        stats = (
            row["metrics"].asDict(recursive=True) if row is not None and row["metrics"] is not None else {}
        )
        version = self.version(path)
        return WriteMetrics(
            version=version,
            files_added=int_or_none(stats.get("numFilesAdded")) if version != before else 0,
            files_removed=int_or_none(stats.get("numFilesRemoved")) if version != before else 0,
            files_scanned=int_or_none(stats.get("totalConsideredFiles")),
            files_skipped=int_or_none(stats.get("totalFilesSkipped")),
            extra={
                "operation": ("REORG" if purge else "OPTIMIZE") if version != before else None,
                "optimize": stats,
            },
        )

    # ------------------------------------------------------------------ guarded commits

    def _widened(self, path: str, changed: Sequence[tuple[Sequence[str], DataType]]) -> bool:
        """Widen the ``changed`` columns in place (type widening on first); whether Delta could."""
        ref = self._sql_ref(path)
        try:
            if self._table_property(path, _TYPE_WIDENING) != "true":
                self.spark.sql(f"ALTER TABLE {ref} SET TBLPROPERTIES ('{_TYPE_WIDENING}' = 'true')")
            for parts, dtype in changed:
                column = ".".join(quote(p) for p in parts)
                self.spark.sql(f"ALTER TABLE {ref} ALTER COLUMN {column} TYPE {_ddl_type(dtype)}")
        except _spark_exception_types() as exc:
            _log.info("Delta cannot widen %s in place (%s); the table is rewritten", path, first_line(exc))
            return False
        finally:
            self._forget(path)
        return True

    def _check_version(self, path: str, expected_version: int | None) -> None:
        """Refuse a write when the table moved past ``expected_version`` (the check before it;
        :meth:`_commit_of` checks what happened between this check and the commit)."""
        if expected_version is not None and self.version(path) != expected_version:
            raise ConcurrentRunError(
                f"the Delta table at {path} moved past version {expected_version}: another writer "
                "committed to it first"
            )

    def _commit_of(self, path: str, guard: _Guard | None) -> dict[str, Any]:
        """The history entry of the commit a write just made (``{}``: it committed nothing).

        For a guarded write: its commit is the one carrying its token. None means Delta skipped
        the write, because another guarded writer committed the version it expected first; a
        commit whose transaction read a later version than expected, or that came after a
        commit that changed data, was made on top of another writer's data. Either way the
        write lost: :class:`~cdc_join.errors.ConcurrentRunError`.
        """
        if guard is None:
            found = self._commits(path, 1)
            return found[0] if found else {}
        entries = self._commits_since(path, guard.expected)
        ours = next((e for e in entries if e.get("userMetadata") == guard.token), None)
        if ours is None:
            raise ConcurrentRunError(
                f"the Delta table at {path} moved past version {guard.expected}: another writer "
                "committed to it first"
            )
        between = [e for e in entries if guard.expected < int(e["version"]) < int(ours["version"])]
        if any(str(e.get("operation") or "").upper() not in DATA_PRESERVING for e in between):
            raise ConcurrentRunError(
                f"another writer committed to the Delta table at {path} after version "
                f"{guard.expected}, while this write was under way"
            )
        return ours

    def _commits_since(self, path: str, version: int) -> list[dict[str, Any]]:
        """History entries newer than ``version`` (a few, unless many writers came after)."""
        latest = self.version(path)
        return [e for e in self._commits(path, max(latest - version, 1)) if int(e["version"]) > version]

    def _moved_by_us(self, path: str, expected: int) -> int:
        """The version after this process's schema change (one commit) of a table that was at
        ``expected``; another writer's commit in between stops the write."""
        entries = self._commits_since(path, expected)
        if len(entries) != 1 or str(entries[0].get("operation") or "").upper() not in DATA_PRESERVING:
            raise ConcurrentRunError(
                f"the Delta table at {path} moved past version {expected}: another writer "
                "committed to it first"
            )
        return int(entries[0]["version"])

    def _enable_features(self, path: str, schema: StructType) -> None:
        """Name the table features ``schema``'s types need before a write brings them in."""
        needed = _features(schema)
        if needed:
            self.set_properties(path, needed)

    def _properties(self, path: str) -> dict[str, str]:
        with _spark_errors("read the properties of", path):
            rows = self.spark.sql(f"SHOW TBLPROPERTIES {self._sql_ref(path)}").collect()
        return {str(r["key"]): str(r["value"]) for r in rows}

    def _table_property(self, path: str, name: str) -> str | None:
        return self._properties(path).get(name)

    def _forget(self, path: str) -> None:
        """Drop what is cached of a table this backend just wrote (nothing is, by now)."""

    # ------------------------------------------------------------------ protocol: reads

    def read(self, path: str, version: int | None = None, files: Sequence[str] | None = None) -> DataFrame:
        """The snapshot at ``version`` (default latest), optionally only the rows of ``files``.

        With ``files`` the snapshot's version is fixed first, so the names are checked against
        the version that is read; the read carries the file ranges' predicate (module docstring).
        """
        if files is None:
            return self._snapshot(path, version)
        resolved = self.version(path) if version is None else int(version)
        df = self._stored(path, resolved)
        listed = self.files(path, resolved)
        by_name = {basename(f.path): f for f in listed}
        wanted: dict[str, FileStats] = {}
        for file in files:
            name = basename(file)
            if name not in by_name:
                where = "the latest version" if version is None else f"version {version}"
                raise StorageError(f"{file} is not a data file of {where} of the Delta table at {path}")
            wanted[name] = by_name[name]
        if not wanted:
            return to_logical(df.where(F.lit(False)))
        if len(wanted) == len(by_name):
            return to_logical(df)
        others = [f for name, f in by_name.items() if name not in wanted]
        exact = F.col("_metadata.file_name").isin(sorted(wanted))
        ranges = ranges_predicate(df.schema, skipping_ranges(df.schema, list(wanted.values()), others))
        return to_logical(df.where(exact if ranges is None else ranges & exact))

    def read_arrow(
        self, path: str, columns: Sequence[str] | None = None, files: Sequence[str] | None = None
    ) -> pa.Table:
        """The latest snapshot (or only ``files`` of it) as Arrow: its parquet files read on the
        driver where :meth:`_dataset` can, else collected from Spark (one job)."""
        dataset = self._dataset(path, None, files)
        if dataset is not None:
            with _spark_errors("read", path):
                return dataset.to_table(columns=None if columns is None else list(columns))
        df = self.read(path, files=files)
        return to_arrow(df.select(*[quote(c) for c in columns]) if columns is not None else df)

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
        """The rows whose ``column`` equals one of ``values`` (a null matches nothing; only
        ``columns`` of them), read on the driver where :meth:`_dataset` can, or, for a table
        with deletion vectors (silver), by delta-rs's ``QueryBuilder`` (:meth:`_queried`);
        ``None`` where neither can, and the keyed read stays a Spark read (see
        :func:`cdc_join.storage.pruning.read_keyed`)."""
        dataset = self._dataset(path, version, files)
        if dataset is None:
            return None if files is not None else self._queried(path, column, values, version, columns)
        with _spark_errors("read", path):
            found = rows_matching(dataset, column, values)
        return found if columns is None else found.select(list(columns))

    def _queried(
        self,
        path: str,
        column: str,
        values: Sequence[Any],
        version: int | None,
        columns: Sequence[str] | None,
    ) -> pa.Table | None:
        """:meth:`read_rows` of a local table with deletion vectors, which pyarrow datasets
        cannot apply and delta-rs's ``QueryBuilder`` does (:func:`cdc_join.storage.keyed.rows_of`);
        ``None`` for a table :meth:`_dataset` refuses for another reason, or values the query
        cannot name. Measured on the scheduler's benchmark (a warm run of 10 changed rows):
        silver's step went from 13 Spark jobs to 8 (2026-12-06)."""
        found = self._driver_table(path, version)
        if found is None or not found[1]:
            return None
        try:
            return keyed.rows_of(found[0], column, values, columns)
        except BaseException as exc:  # delta-rs cannot read this table: Spark does
            if not isinstance(exc, Exception) and type(exc).__name__ != "PanicException":
                raise
            return None

    def _driver_table(self, path: str, version: int | None) -> tuple[Any, bool] | None:
        """delta-rs's view of a local table at ``version`` (default latest) and whether
        deletion vectors hide rows of it, where its parquet files hold its rows as they are (no
        partition values, no mapped column names, no stored void); ``None`` elsewhere.

        Raises:
            StorageError: no table at ``path``.
        """
        log = _local_log(path)
        if log is None:
            return None
        resolved = _local_log_version(log) if version is None else int(version)
        if resolved is None:
            raise StorageError(f"No Delta table at {path}")
        try:
            table = self._delta_rs_table(os.path.dirname(os.path.abspath(log)), resolved)
            meta = table.metadata()
            if meta.partition_columns or meta.configuration.get("delta.columnMapping.mode", "none") != "none":
                return None
            if MARK in table.schema().to_json():  # a stored void: Spark reads it
                return None
            return table, bool(deleted_rows(table))
        except BaseException as exc:  # delta-rs cannot read this table: Spark does
            if not isinstance(exc, Exception) and type(exc).__name__ != "PanicException":
                raise
            return None

    def _dataset(self, path: str, version: int | None, files: Sequence[str] | None) -> Any:
        """A local table's snapshot (or ``files`` of it) as a pyarrow dataset of its parquet
        files, which gives exactly its rows where none of them has a deletion vector, no column
        is mapped and none partitions it (tables cdc_join appends to: state, subscriptions,
        logs); ``None`` elsewhere. delta-rs reads the log: no Spark job."""
        found = self._driver_table(path, version)
        if found is None or found[1]:
            return None
        table = found[0]
        root = os.path.dirname(os.path.abspath(str(_local_log(path))))
        try:
            names = [
                unquote(a) for a in pa.table(table.get_add_actions(flatten=True)).column("path").to_pylist()
            ]
            schema = pa.schema(table.schema().to_arrow())
        except BaseException as exc:  # delta-rs cannot read this table: Spark does
            if not isinstance(exc, Exception) and type(exc).__name__ != "PanicException":
                raise
            return None
        if files is not None:
            present = {basename(n): n for n in names}
            missing = [f for f in files if basename(f) not in present]
            if missing:
                where = "the latest version" if version is None else f"version {version}"
                raise StorageError(f"{missing[0]} is not a data file of {where} of the Delta table at {path}")
            names = [present[basename(f)] for f in files]
        import pyarrow.dataset as ds

        paths = [n if has_scheme(n) else os.path.join(root, n) for n in names]
        return ds.dataset(sorted(paths), schema=schema, format="parquet")

    def _delta_rs_table(self, root: str, version: int) -> Any:
        """delta-rs's view of a local table at a version (kept: a version never changes)."""
        from deltalake import DeltaTable as DeltaRsTable

        key = (root, version)
        table = self._delta_rs_tables.get(key)
        if table is None:
            table = self._delta_rs_tables[key] = DeltaRsTable(root, version=version)
            while len(self._delta_rs_tables) > _FILE_LISTS_KEPT * 4:
                self._delta_rs_tables.pop(next(iter(self._delta_rs_tables)))
        return table

    def files(self, path: str, version: int | None = None) -> list[FileStats]:
        """The snapshot's data files with statistics of the top-level columns.

        delta-rs reads the add actions where it can open the table's location; otherwise Delta
        lists the files and Spark reads their statistics from the log (module docstring).
        """
        resolved = self.version(path) if version is None else int(version)
        location, table_id = self._detail(path)
        key = (location, table_id, resolved)
        cached = self._file_lists.get(key)
        if cached is None:
            cached = self._files_from_delta_rs(path, location, table_id, resolved)
            if cached is None:
                cached = self._files_from_log(path, location, resolved)
            self._file_lists[key] = cached
            while len(self._file_lists) > _FILE_LISTS_KEPT:
                self._file_lists.pop(next(iter(self._file_lists)))
        return list(cached)

    def _files_from_delta_rs(
        self, path: str, location: str, table_id: str | None, version: int
    ) -> list[FileStats] | None:
        """The files of ``version`` as delta-rs reads them from the log, or ``None`` where it cannot
        (or where what it opens is not this table)."""
        uri = _delta_rs_uri(location)
        if uri is None or location in self._delta_rs_failed:
            return None
        try:
            from deltalake import DeltaTable as DeltaRsTable

            table = DeltaRsTable(uri, version=version)
            meta = table.metadata()
            if table_id is not None and meta.id != table_id:
                return None
            # With column mapping the log's statistics are keyed by physical names.
            if meta.configuration.get("delta.columnMapping.mode", "none") != "none":
                return None
            schema = StructType.fromJson(json.loads(table.schema().to_json()))
            adds = pa.table(table.get_add_actions(flatten=False)).to_pylist()
            deleted = deleted_rows(table)
        except BaseException as exc:  # any failure here only means: use Spark's log reader
            # delta-rs reports some failures as pyo3's PanicException, which is no Exception.
            if not isinstance(exc, Exception) and type(exc).__name__ != "PanicException":
                raise
            _log.info(
                "delta-rs cannot list the files of %s (%s), Spark reads its log: %s", path, location, exc
            )
            self._delta_rs_failed.add(location)
            return None
        return [
            file_stats_from_values(
                _data_file_uri(location, add["path"]),
                add.get("size_bytes"),
                add.get("num_records"),
                deleted.get(basename(unquote(add["path"]))),
                add.get("min") or {},
                add.get("max") or {},
                add.get("null_count") or {},
                schema,
            )
            for add in adds
        ]

    def _files_from_log(self, path: str, location: str, version: int) -> list[FileStats]:
        """The files of ``version`` as Delta lists them, with statistics from the log where it
        can be read (else none: Unity Catalog refuses path access to managed tables' logs)."""
        df = to_logical(self._stored(path, version))  # Delta's reader: it lists the files
        schema = df.schema
        with _spark_errors("list the files of", path):
            live = list(df.inputFiles())
        try:
            adds = self._log_adds(path, version, {basename(f) for f in live}, location)
        except StorageError as exc:
            _log.warning("No file statistics for %s, its transaction log cannot be read: %s", path, exc)
            adds = {}
        result = []
        for file in live:
            add = adds.get(basename(file))
            if add is None:
                # No add action left in the readable log: the file is listed without statistics.
                result.append(file_stats_from_add(file, None, None, None, schema))
            else:
                result.append(
                    file_stats_from_add(file, add["size"], add["stats"], add["dv_cardinality"], schema)
                )
        return result

    def read_changes(self, path: str, start_version: int, end_version: int | None = None) -> DataFrame:
        """Change Data Feed rows of versions ``start_version..end_version`` (inclusive)."""
        if start_version < 0:
            raise StorageError(f"read_changes of {path}: start_version {start_version} is negative")
        latest = self.version(path)
        if not is_table_name(path) and self._table_property(path, _CHANGE_DATA_FEED) != "true":
            # Delta's own error would come only when the rows are read.
            raise StorageError(f"The Delta table at {path} has no change data feed ({_CHANGE_DATA_FEED})")
        end = latest if end_version is None else min(end_version, latest)
        empty = start_version > end
        # An empty range reads the latest version's changes and keeps none of them, so its
        # schema is exactly that of a non-empty feed.
        first, last = (latest, latest) if empty else (start_version, end)
        # Up to the latest version, not only to the range's end: Delta reads a feed in the latest
        # schema, so a type widened after ``last`` (an ingest that overlapped the reader) is
        # as much in the way as one inside the range.
        changed = [] if empty else self._schema_changes(path, first, latest)
        if changed:
            # Delta reads a feed in the latest schema and refuses, only once rows are read,
            # data written before a widened type; say so now, so the caller can read otherwise.
            raise StorageError(
                f"Delta (Spark) cannot read the change feed of {path} across its schema change at "
                f"version {changed[0]} (versions {first}..{last})"
            )
        appended = None if empty else self._appended_feed(path, first, last)
        if appended is not None:
            return appended
        with _spark_errors(f"read the change feed (versions {first}..{last}) of", path):
            if is_table_name(path):
                quoted = path.replace("'", "\\'")
                feed = self.spark.sql(f"SELECT * FROM table_changes('{quoted}', {first}, {last})")
            else:
                reader = self.spark.read.format("delta").option("readChangeFeed", "true")
                reader = reader.option("startingVersion", first).option("endingVersion", last)
                feed = reader.load(self._location(path))
            changes = to_logical(feed.drop(_COMMIT_TIMESTAMP))
        return changes.where(F.lit(False)) if empty else changes

    def _appended_feed(self, path: str, first: int, last: int) -> DataFrame | None:
        """The change feed of versions ``first..last`` of a local table that they only appended
        to (appends and insert-only MERGEs: bronze), read on the driver: the rows of the files
        they added, each an ``insert`` of its version, and the Arrow rows attached to the frame
        (:data:`~cdc_join.changeset.ARROW_ATTRIBUTE`), as delta-rs's feed has them. ``None``
        where Spark reads it: a version that removed rows or wrote change data files, files of
        more than :data:`SMALL_FEED_BYTES`, deletion vectors, or a table :meth:`_dataset`
        cannot read (a stored void, mapped columns, partitions). Saves a run's plan step the
        Spark jobs of Delta's feed reader (2 on the scheduler's benchmark)."""
        log = _local_log(path)
        if log is None:
            return None
        added = _local_appends(log, first, last, SMALL_FEED_BYTES)
        stored = _local_schema(log, last)
        found = None if added is None or stored is None else self._driver_table(path, last)
        if added is None or stored is None or found is None:
            return None
        import pyarrow.dataset as ds

        root = os.path.dirname(os.path.abspath(log))
        schema = pa.schema(found[0].schema().to_arrow())  # as of ``last``: later columns null
        parts = []
        for version, files in added.items():
            paths = [f if has_scheme(f) else os.path.join(root, f) for f in files]
            try:  # a file a compaction replaced since may be gone: Spark's reader says so
                rows = ds.dataset(paths, schema=schema, format="parquet").to_table()
            except (OSError, pa.ArrowException):
                return None
            kinds = pa.array(["insert"] * rows.num_rows, pa.string())
            versions = pa.array([version] * rows.num_rows, pa.int64())
            parts.append(rows.append_column(CHANGE_TYPE, kinds).append_column(COMMIT_VERSION, versions))
        feed_schema = StructType(
            [
                *logical_schema(stored).fields,
                StructField(CHANGE_TYPE, StringType()),
                StructField(COMMIT_VERSION, LongType()),
            ]
        )
        arrow = plain_types(pa.concat_tables(parts)) if parts else arrow_schema(feed_schema).empty_table()
        try:  # the table's types and NOT NULLs, as Delta's reader gives them; rows attached
            return ChangeSet(self.spark, feed_schema, arrow).frame
        except Exception:  # rows Spark takes otherwise from Arrow: its reader reads them
            return None

    def _schema_changes(self, path: str, first: int, last: int) -> list[int]:
        """Versions in ``first + 1..last`` whose schema change a change feed cannot be read
        across (a column retyped or dropped; an added column is fine): from a local table's
        commit files, else from its history (the operations that can make such a change)."""
        if last <= first:
            return []
        log = _local_log(path)
        if log is None:
            entries = [e for e in self._commits(path, self.version(path) - first) if _retypes(e)]
            return sorted(int(e["version"]) for e in entries if first < int(e["version"]) <= last)
        found: list[int] = []
        before: StructType | None = None
        for version in range(first + 1, last + 1):
            schema = _local_schema_of(log, version)
            if schema is False:
                continue
            if before is None and isinstance(schema, StructType):
                before = self.read(path, version - 1).schema
            if not isinstance(schema, StructType) or not _additive(before, schema):
                found.append(version)
            before = schema if isinstance(schema, StructType) else None
        return found


# ------------------------------------------------------------------ guarded commits

#: The app id of guarded writes' transaction identifiers (Delta's idempotent writes).
GUARD_APP_ID = "cdc_join"
#: A commit of one of these between a guarded write's expected version and its commit is no
#: other writer's data.
DATA_PRESERVING = DATA_PRESERVING_OPERATIONS
_TXN_APP_ID = "spark.databricks.delta.write.txnAppId"
_TXN_VERSION = "spark.databricks.delta.write.txnVersion"
_USER_METADATA = "spark.databricks.delta.commitInfo.userMetadata"
_NOT_A_TABLE = re.compile(
    r"DELTA_MISSING_DELTA_TABLE|DELTA_TABLE_NOT_FOUND|PATH_NOT_FOUND|is not a Delta table"
)


@dataclass(frozen=True)
class _Guard:
    """A write that must find the table at ``expected``.

    Delta commits against the latest snapshot, so a version check alone leaves a gap between
    the check and the commit. The write also carries the transaction identifier
    (:data:`GUARD_APP_ID`, ``expected + 1``): Delta skips a write whose identifier another
    guarded writer already committed, and fails one whose concurrent commit carries the same
    app id (``ConcurrentTransactionException``). The ``token`` in the commit's user metadata
    tells afterwards whether the write committed, and on top of what (:meth:`_commit_of`).
    """

    expected: int
    token: str

    @property
    def txn_version(self) -> int:
        return self.expected + 1

    @staticmethod
    def of(expected_version: int | None, note: str | None = None) -> _Guard | None:
        """The guard of a write expecting ``expected_version``; its token starts with the
        write's ``note``, which the commit's user metadata then carries."""
        if expected_version is None:
            return None
        return _Guard(int(expected_version), _Guard.token_of(note))

    @staticmethod
    def token_of(note: str | None) -> str:
        """A new guard's token: the write's ``note`` (or ``cdc_join``), then a random id."""
        return f"{note or 'cdc_join'}:{uuid.uuid4()}"


def _guard_confs(guard: _Guard | None) -> dict[str, str]:
    """Session settings that give a SQL command (MERGE) the guard's transaction identifier."""
    if guard is None:
        return {}
    return {_TXN_APP_ID: GUARD_APP_ID, _TXN_VERSION: str(guard.txn_version), _USER_METADATA: guard.token}


#: Delta's check that the rows a ``replaceWhere`` writes satisfy its predicate
#: (``DeltaSQLConf.REPLACEWHERE_CONSTRAINT_CHECK_ENABLED``, on by default).
REPLACE_WHERE_CHECK = "spark.databricks.delta.replaceWhere.constraintCheck.enabled"


@contextmanager
def _session_confs(
    spark: SparkSession, settings: Mapping[str, str], *, optional: bool = False
) -> Iterator[None]:
    """Set session settings for the block, then put back what was there (or unset them).

    Under a process-wide lock, so two threads of this process never see each other's settings
    (a guarded MERGE's transaction identifier, OPTIMIZE's file size). With ``optional``, a
    session that refuses a setting (Databricks serverless allows only some) runs the block
    without it.
    """
    if not settings:
        yield
        return
    with _SESSION_CONF_LOCK:
        # With a default, get() returns it unless the key was explicitly set: None means unset.
        previous: dict[str, str | None] = {}
        for key, value in settings.items():
            try:
                previous[key] = spark.conf.get(key, None)
                spark.conf.set(key, value)
            except Exception:
                if not optional:
                    raise
                _log.info("the session refused %s=%s; the write goes on without it", key, value)
                previous.pop(key, None)
        try:
            yield
        finally:
            for key, held in previous.items():
                if held is None:
                    spark.conf.unset(key)
                else:
                    spark.conf.set(key, held)


def _merge_metrics(commit: Mapping[str, Any], returned: Mapping[str, Any], version: int) -> WriteMetrics:
    """Metrics of a MERGE: rows from the row it returned (the commit's ``operationMetrics``
    without one), files from its commit (``{}``: it committed nothing, Delta skips the commit
    of a MERGE that changed nothing)."""
    raw = dict(commit.get("operationMetrics") or {}) if commit.get("operation") == "MERGE" else {}
    names = {
        "rows_inserted": ("num_inserted_rows", "numTargetRowsInserted"),
        "rows_updated": ("num_updated_rows", "numTargetRowsUpdated"),
        "rows_deleted": ("num_deleted_rows", "numTargetRowsDeleted"),
    }
    rows = {
        field: int_or_none(returned[ours] if returned.get(ours) is not None else raw.get(logged))
        for field, (ours, logged) in names.items()
    }
    if not raw:
        return WriteMetrics(version=version, files_added=0, files_removed=0, extra={}, **rows)
    # A file that keeps some rows gets a deletion vector instead of a rewrite: its add action
    # is replaced all the same (Delta counts updated vectors in "added").
    rewritten = int_or_none(raw.get("numTargetFilesRemoved"))
    marked = int_or_none(raw.get("numTargetDeletionVectorsAdded")) or 0
    return WriteMetrics(
        version=int(commit["version"]),
        files_added=int_or_none(raw.get("numTargetFilesAdded")),
        files_removed=None if rewritten is None else rewritten + marked,
        extra={"operation": "MERGE", "metrics": raw},
        **rows,
    )


def _removed_files(raw: Mapping[str, Any]) -> int | None:
    """Files a DELETE rewrote or gave a deletion vector."""
    removed = int_or_none(raw.get("numRemovedFiles"))
    return None if removed is None else removed + (int_or_none(raw.get("numDeletionVectorsAdded")) or 0)


def merge_sql(target: str, view: str, spec: MergeSpec, plan: MergePlan) -> str:
    """The ``MERGE INTO`` statement of ``spec`` (clauses in the order of :class:`MergeSpec`)."""
    clauses = []
    if spec.delete_condition is not None:
        clauses.append(f"WHEN MATCHED AND ({spec.delete_condition}) THEN DELETE")
    if spec.update and (plan.star or plan.assignments):
        when = "WHEN MATCHED" + ("" if spec.update_condition is None else f" AND ({spec.update_condition})")
        sets = "*" if plan.star else ", ".join(f"t.{c} = {v}" for c, v in plan.assignments.items())
        clauses.append(f"{when} THEN UPDATE SET {sets}")
    if spec.insert and (plan.star or plan.assignments):
        when = "WHEN NOT MATCHED" + (
            "" if spec.insert_condition is None else f" AND ({spec.insert_condition})"
        )
        if plan.star:
            clauses.append(f"{when} THEN INSERT *")
        else:
            names = ", ".join(plan.assignments)
            values = ", ".join(plan.assignments.values())
            clauses.append(f"{when} THEN INSERT ({names}) VALUES ({values})")
    evolve = " WITH SCHEMA EVOLUTION" if plan.evolve else ""
    return f"MERGE{evolve} INTO {target} AS t USING {view} AS s ON {spec.on} " + " ".join(clauses)


def _features(schema: StructType) -> dict[str, str]:
    """Table features a table of ``schema`` needs named (open-source Delta does not add them
    by itself): ``timestampNtz`` for a TIMESTAMP_NTZ column, nested ones too."""
    return {"delta.feature.timestampNtz": "supported"} if _has_type(schema, TimestampNTZType) else {}


def _has_type(data_type: DataType, wanted: type) -> bool:
    if isinstance(data_type, wanted):
        return True
    if isinstance(data_type, StructType):
        return any(_has_type(f.dataType, wanted) for f in data_type.fields)
    if isinstance(data_type, ArrayType):
        return _has_type(data_type.elementType, wanted)
    if isinstance(data_type, MapType):
        return _has_type(data_type.keyType, wanted) or _has_type(data_type.valueType, wanted)
    return False


def _sql_text(value: str) -> str:
    """A SQL string literal."""
    return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'") + "'"


def _few_files(rows: Rows) -> DataFrame:
    """A Spark frame of ``rows``; a change set from the driver (small by nature) as one file."""
    if isinstance(rows, ChangeSet):
        return rows.frame.coalesce(1)
    return rows


_NON_EMPTY = re.compile(r"DELTA_CREATE_TABLE_WITH_NON_EMPTY_LOCATION|is not empty and also not a Delta table")


SMALL_REWRITE_BYTES = 4 * 1024 * 1024
"""The most bytes of data files a keyed replace rewrites on the driver
(:meth:`DeltaSparkStorage._rewrite_small`)."""


def _small_checksum(folder: str, version: int, most_bytes: int) -> dict[str, Any] | None:
    """The checksum Delta writes beside the commit ``version`` of the local table in
    ``folder``, where it lists every data file of the table (``allFiles``, as ``add`` actions:
    Delta lists up to 50) and they come to at most ``most_bytes``; ``None`` elsewhere."""
    try:
        with open(os.path.join(folder, "_delta_log", f"{version:020d}.crc"), encoding="utf-8") as f:
            checksum = json.load(f)
    except (OSError, ValueError):
        return None
    files = checksum.get("allFiles")
    if not isinstance(files, list) or int(checksum.get("tableSizeBytes", most_bytes + 1)) > most_bytes:
        return None
    if len(files) != checksum.get("numFiles") or not isinstance(checksum.get("metadata"), dict):
        return None
    return checksum


def _rewritten(
    version: int,
    rewrite: delta_txn.Rewrite,
    removed: int,
    rows: int,
    deleted: int | None,
    changes: pa.Table | None,
) -> WriteMetrics:
    """The metrics of a rewrite on the driver that committed ``version``: ``removed`` files
    swapped for one of ``rows`` rows (none when empty)."""
    return WriteMetrics(
        version=version,
        rows_inserted=rewrite.inserted,
        rows_deleted=deleted,
        files_added=1 if rows else 0,
        files_removed=removed,
        extra={"operation": "WRITE", "metrics": rewrite.metrics(removed, rows, changes)},
    )


def _live_rows(checksum: Mapping[str, Any]) -> int | None:
    """The rows of the table whose checksum this is, from its files' statistics (less the rows
    their deletion vectors hide); ``None`` where a file has none."""
    total = 0
    for add in checksum["allFiles"]:
        try:
            total += int(json.loads(add["stats"])["numRecords"])
        except (KeyError, TypeError, ValueError):
            return None
        total -= int((add.get("deletionVector") or {}).get("cardinality") or 0)
    return total


def _refused(checksum: Mapping[str, Any]) -> bool:
    """Whether the table whose checksum this is takes no data file written here."""
    return arrow_files.refused(checksum.get("protocol") or {}, checksum["metadata"]) is not None


def _keys_replaced(
    current: pa.Table, new: pa.Table, columns: Sequence[str], keys: pa.Table, feed: bool
) -> tuple[pa.Table, pa.Table, pa.Table | None]:
    """A table's rows ``current`` with the rows of ``keys`` replaced by ``new``; the rows
    replaced; and, with ``feed``, the change data rows: those deleted, then those inserted."""
    hit = found_in(current, keys, columns)
    old, kept = current.filter(hit), current.filter(pc.invert(hit))
    changes = None
    if feed:
        changes = pa.concat_tables([_change_rows(old, "delete"), _change_rows(new, "insert")])
    return pa.concat_tables([kept, new]), old, changes


def _change_rows(table: pa.Table, kind: str) -> pa.Table:
    """``table``'s rows as change data rows of ``kind`` (``_change_type``)."""
    return table.append_column("_change_type", pa.array([kind] * table.num_rows, pa.string()))


SMALL_FEED_BYTES = 4 * 1024 * 1024
"""The most bytes of added data files whose change feed is read on the driver
(:meth:`DeltaSparkStorage._appended_feed`)."""

CHANGE_TYPE, COMMIT_VERSION = "_change_type", "_commit_version"


def _local_appends(log: str, first: int, last: int, most_bytes: int) -> dict[int, list[str]] | None:
    """Per version of ``first..last`` of a local table, the data files it added, where these
    versions only added rows (a rearrangement such as a compaction adds and removes files
    without changing data, and counts for nothing) and the files come to at most
    ``most_bytes``; ``None`` elsewhere (a version that removed or changed rows, wrote change
    data files or deletion vectors, or whose commit file is gone)."""
    added: dict[int, list[str]] = {}
    total = 0
    for version in range(first, last + 1):
        try:
            actions = _commit_actions(log, version)
        except (OSError, ValueError):
            return None
        if actions is None:
            return None
        files = []
        for action in actions:
            if "cdc" in action:
                return None
            for kind in ("add", "remove"):
                file = action.get(kind)
                if file is None or not file.get("dataChange", True):
                    continue
                if kind == "remove" or file.get("deletionVector"):
                    return None
                total += int(file.get("size") or most_bytes + 1)
                files.append(unquote(file["path"]))
        if total > most_bytes:
            return None
        if files:
            added[version] = files
    return added


def _local_log(path: str) -> str | None:
    """The ``_delta_log`` folder of a table on the local file system, else ``None``."""
    local = None if is_table_name(path) else local_path(path)
    return None if local is None else os.path.join(local, "_delta_log")


def _commit_actions(log: str, version: int) -> list[dict[str, Any]] | None:
    """The actions of a local table's commit ``version``; ``None`` where its file is gone."""
    try:
        with open(os.path.join(log, f"{version:020d}.json"), encoding="utf-8") as commit:
            return [json.loads(line) for line in commit if line.strip()]
    except FileNotFoundError:
        return None


def _local_commits(log: str, limit: int | None) -> list[dict[str, Any]] | None:
    """The newest ``limit`` commits of a local table (all with ``None``), newest first, as
    ``DESCRIBE HISTORY`` gives them (``None``: no table there). Commits whose file the log
    cleanup removed end the list, as they end Delta's history."""
    latest = _local_log_version(log)
    if latest is None:
        return None
    first = 0 if limit is None else max(0, latest - int(limit) + 1)
    found = []
    for version in range(latest, first - 1, -1):
        actions = _commit_actions(log, version)
        if actions is None:
            break
        info = next((a["commitInfo"] for a in actions if "commitInfo" in a), {})
        found.append(
            {
                **normalize_history_entry(
                    {
                        "version": version,
                        "timestamp": info.get("inCommitTimestamp", info.get("timestamp")),
                        "operation": info.get("operation"),
                        "operationParameters": info.get("operationParameters"),
                        "operationMetrics": info.get("operationMetrics"),
                    }
                ),
                "userMetadata": info.get("userMetadata"),
                "readVersion": info.get("readVersion"),
            }
        )
    return found


def _local_schema_of(log: str, version: int) -> StructType | bool | None:
    """The schema a local table's commit ``version`` sets (``False``: it sets none; ``None``:
    its commit file is gone, so what it changed is unknown)."""
    try:
        with open(os.path.join(log, f"{version:020d}.json"), encoding="utf-8") as commit:
            for line in commit:
                if line.startswith('{"metaData"'):
                    return StructType.fromJson(json.loads(json.loads(line)["metaData"]["schemaString"]))
    except FileNotFoundError:
        return None
    return False


def _local_schema(log: str, version: int) -> StructType | None:
    """The schema of a local table at ``version`` from its commit files (the newest ``metaData``
    at or before it), as Spark reads it, without a Spark job; ``None`` where only Delta can tell
    (a commit file removed by the log's cleanup, or columns with metadata other than a comment:
    column mapping, generated columns, char types, which Spark's read schema may show otherwise)."""
    for at in range(version, -1, -1):
        schema = _local_schema_of(log, at)
        if schema is None:
            return None
        if isinstance(schema, StructType):
            return schema if _only_comments(schema) else None
    return None


def _only_comments(kind: DataType) -> bool:
    """Whether no field in ``kind`` (nested ones too) has metadata other than its comment."""
    if isinstance(kind, StructType):
        return all(set(f.metadata) <= {"comment"} and _only_comments(f.dataType) for f in kind.fields)
    if isinstance(kind, ArrayType):
        return _only_comments(kind.elementType)
    if isinstance(kind, MapType):
        return _only_comments(kind.keyType) and _only_comments(kind.valueType)
    return True


def _additive(before: StructType | None, after: StructType) -> bool:
    """Whether ``after`` keeps every column of ``before`` with its type (columns may be added)."""
    if before is None:
        return False
    return set(before.names) <= set(after.names) and not changed_types(before, after)


#: Operations that can retype or drop a column in place.
_RETYPING = frozenset(
    {"CHANGE COLUMN", "REPLACE COLUMNS", "RENAME COLUMN", "DROP COLUMNS", "REPLACE TABLE"}
    | {"CREATE OR REPLACE TABLE"}
)


def _retypes(entry: Mapping[str, Any]) -> bool:
    """Whether a history entry may have retyped or dropped a column (an overwrite may have)."""
    operation = str(entry.get("operation") or "").upper()
    mode = str((entry.get("operationParameters") or {}).get("mode") or "").lower()
    return operation in _RETYPING or (operation == "WRITE" and mode == "overwrite")


def _local_log_version(log: str) -> int | None:
    """The newest commit in a local ``_delta_log`` (``None``: no table there)."""
    try:
        names = os.listdir(log)
    except (FileNotFoundError, NotADirectoryError):
        return None
    versions = [int(n[:20]) for n in names if len(n) == 25 and n.endswith(".json") and n[:20].isdigit()]
    return max(versions) if versions else None
