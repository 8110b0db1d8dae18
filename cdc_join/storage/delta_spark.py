"""The distributed storage backend: Delta Lake through the Delta jars on the Spark classpath.

Used on Databricks and on any cluster started with Delta. Everything runs in Spark through the
public APIs of delta-spark (``delta.tables.DeltaTable``, ``format("delta")`` reads with
``versionAsOf`` and ``readChangeFeed``, ``OPTIMIZE``), so Spark Connect works too.

Choices that keep this backend interchangeable with :mod:`cdc_join.storage.delta_rs` (the
contract tests in ``tests/contract`` run both):

- ``read(files=...)`` reads the snapshot through Delta (so deletion vectors and column mapping
  are honoured) and keeps the rows whose ``_metadata.file_name`` is one of the named files.
  Delta data file names are unique within a table (they carry a UUID).
- ``files`` lists the snapshot's files with ``DataFrame.inputFiles()`` and takes their
  statistics from the add actions in the transaction log, read with Spark as data: the JSON
  commits (``_delta_log/*.json``), parquet checkpoints (``*.checkpoint*.parquet``) and v2
  checkpoint sidecars (``_delta_log/_sidecars/*.parquet``). For each file the add action of
  the highest log version not above the snapshot's wins. Delta exposes no public API that lists
  files with statistics, and this reads only small log files, never table data. A file whose add
  action is no longer in the log (cleaned up and absent from checkpoints that store only parsed
  statistics) reports ``None`` statistics.
- MERGE materializes its source with ``localCheckpoint(eager=True)``. Clauses use
  ``whenMatchedUpdateAll``/``whenNotMatchedInsertAll`` when source and target have exactly the
  same columns (or the source adds columns under ``merge_schema``, with
  ``withSchemaEvolution()``); otherwise they use explicit ``set``/``values`` maps over the
  source's written columns. Columns a ``merge_schema`` merge must add while other columns are
  excluded are added first with ``ALTER TABLE ... ADD COLUMNS``: an explicit assignment to a
  column the target does not have yet is not something every Delta release evolves.
- Source columns the target lacks are ignored without ``merge_schema`` (Delta's documented
  UPDATE SET * / INSERT * behaviour, and what the delta-rs backend does).
- Metrics: row counts come from the commit's ``operationMetrics`` (``numTargetRowsInserted``
  etc.); files added/removed from the difference of the snapshot's file lists, as in delta-rs.
  Delta MERGE reports no files scanned/skipped, so those stay ``None``.
- ``read_changes`` clamps the end version to the latest version and returns an empty frame
  for an empty range (Delta itself raises when the start is past the latest version), and
  drops ``_commit_timestamp`` like the delta-rs backend.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import date, datetime, timezone
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal, localcontext
from typing import Any

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import (
    BooleanType,
    ByteType,
    DataType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from cdc_join.changeset import to_arrow
from cdc_join.errors import ConcurrentRunError, StorageError
from cdc_join.schemas import changed_types, conform, merge_schemas
from cdc_join.storage.base import FileStats, MergeSpec, WriteMetrics, is_table_name, quote_table_name
from cdc_join.storage.delta_rs import normalize_history_entry, stat_upper_bound

_COMMIT_TIMESTAMP = "_commit_timestamp"
_OPTIMIZE_MAX_FILE_SIZE = "spark.databricks.delta.optimize.maxFileSize"
_LOG_ADD_SCHEMA = "add struct<path:string, size:long, stats:string, deletionVector:struct<cardinality:long>>"
_LEADING_DIGITS = re.compile(r"^(\d+)")


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


@contextmanager
def _spark_errors(action: str, path: str) -> Iterator[None]:
    """Re-raise Spark/Delta failures as :class:`StorageError` naming the action and the table."""
    try:
        yield
    except StorageError:
        raise
    except _spark_exception_types() as exc:
        text = str(exc).strip()
        first = text.splitlines()[0] if text else type(exc).__name__
        raise StorageError(f"Delta (Spark) could not {action} the Delta table at {path}: {first}") from exc


def _quote(name: str) -> str:
    """A column name as a backtick-quoted Spark SQL identifier."""
    return "`" + name.replace("`", "``") + "`"


def _basename(file: str) -> str:
    return file.rstrip("/").rsplit("/", 1)[-1]


def _log_version(file_name: str | None) -> int:
    """The log version a ``_delta_log`` file belongs to (sidecars, unnumbered: -1)."""
    match = _LEADING_DIGITS.match(file_name or "")
    return int(match.group(1)) if match else -1


def parse_stat(data_type: DataType, value: Any) -> Any:
    """A value of a Delta ``stats`` JSON (parsed with ``parse_float=Decimal``) as a Python value.

    Types match what delta-rs returns: ``int``, ``float``, ``Decimal``, ``str``, ``bool``,
    ``date``, aware UTC ``datetime`` for timestamps and naive ``datetime`` for timestamp_ntz.
    Unparseable values become ``None`` (no statistic rather than a wrong one).
    """
    if value is None or isinstance(value, (dict, list)):
        return None
    try:
        if isinstance(data_type, (LongType, IntegerType, ShortType, ByteType)):
            return int(value)
        if isinstance(data_type, (DoubleType, FloatType)):
            return float(value)
        if isinstance(data_type, DecimalType):
            return Decimal(str(value))
        if isinstance(data_type, StringType):
            return str(value)
        if isinstance(data_type, BooleanType):
            return bool(value)
        if isinstance(data_type, DateType):
            return date.fromisoformat(str(value))
        if isinstance(data_type, TimestampType):
            parsed = datetime.fromisoformat(str(value))
            if parsed.tzinfo is None:
                parsed = parsed.replace(tzinfo=timezone.utc)
            return parsed.astimezone(timezone.utc)
        if isinstance(data_type, TimestampNTZType):
            return datetime.fromisoformat(str(value)).replace(tzinfo=None)
    except (TypeError, ValueError, ArithmeticError):
        return None
    return None


def _widen_decimal(value: Decimal | None, data_type: DecimalType, *, upper: bool) -> Decimal | None:
    """Widen a decimal statistic that may have been rounded through a double.

    Some writers (delta-rs) log decimal statistics as JSON doubles, which keep about 15-17
    significant digits; a wider column's logged value can then sit on either side of the real
    one. Moving it outwards by the double's relative error (2**-52, with margin) and rounding
    outwards to the column's scale keeps it a bound whichever writer produced it.
    """
    if value is None or data_type.precision <= 15:
        return value
    # The default context keeps 28 digits; decimal(38, s) needs more, exactly.
    with localcontext() as ctx:
        ctx.prec = 100
        step = Decimal(1).scaleb(-data_type.scale)
        slack = abs(value) * Decimal(2) ** -52
        moved = value + slack if upper else value - slack
        return moved.quantize(step, rounding=ROUND_CEILING if upper else ROUND_FLOOR)


def file_stats_from_add(
    path: str, size: int | None, stats_json: str | None, dv_cardinality: int | None, schema: StructType
) -> FileStats:
    """One :class:`FileStats` from an add action's ``stats`` JSON.

    ``num_records`` counts live rows: the physical ``numRecords`` less the rows a deletion
    vector removes. Minimums are lower and maximums upper bounds: timestamp maximums are
    widened for millisecond truncation (:func:`cdc_join.storage.delta_rs.stat_upper_bound`)
    and decimals wider than 15 digits for double rounding (:func:`_widen_decimal`).
    """
    parsed: dict[str, Any] = {}
    if stats_json:
        try:
            parsed = json.loads(stats_json, parse_float=Decimal)
        except ValueError:
            parsed = {}
    mins = parsed.get("minValues") or {}
    maxs = parsed.get("maxValues") or {}
    nulls = parsed.get("nullCount") or {}
    num_records = parsed.get("numRecords")
    if num_records is not None:
        num_records = int(num_records) - int(dv_cardinality or 0)
    null_counts = {}
    for f in schema.fields:
        count = nulls.get(f.name)
        null_counts[f.name] = int(count) if isinstance(count, (int, Decimal)) else None
    min_values: dict[str, Any] = {}
    max_values: dict[str, Any] = {}
    for f in schema.fields:
        low = parse_stat(f.dataType, mins.get(f.name))
        high = stat_upper_bound(f.dataType, parse_stat(f.dataType, maxs.get(f.name)))
        if isinstance(f.dataType, DecimalType):
            low = _widen_decimal(low, f.dataType, upper=False)
            high = _widen_decimal(high, f.dataType, upper=True)
        min_values[f.name] = low
        max_values[f.name] = high
    return FileStats(
        path=path,
        size_bytes=int(size or 0),
        num_records=num_records,
        min_values=min_values,
        max_values=max_values,
        null_counts=null_counts,
    )


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
        assignments={_quote(c): f"s.{_quote(c)}" for c in written},
    )


class DeltaSparkStorage:
    """:class:`~cdc_join.storage.base.Storage` on delta-spark (Delta jars in the Spark JVM).

    Args:
        spark: the session; it needs the Delta jars and, for SQL on ``delta.`path``` tables,
            ``io.delta.sql.DeltaSparkSessionExtension`` (built into Databricks).
    """

    name = "delta-spark"

    def __init__(self, spark: SparkSession) -> None:
        self.spark = spark

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
        with _spark_errors("describe", path):
            return str(self.spark.sql(f"DESCRIBE DETAIL {self._sql_ref(path)}").select("location").head()[0])

    def _delta_table(self, path: str) -> Any:
        from delta.tables import DeltaTable

        if not self.exists(path):
            raise StorageError(f"No Delta table at {path}")
        with _spark_errors("open", path):
            if is_table_name(path):
                return DeltaTable.forName(self.spark, path)
            return DeltaTable.forPath(self.spark, self._location(path))

    def _snapshot(self, path: str, version: int | None = None) -> DataFrame:
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

    def _save(self, writer: Any, path: str) -> None:
        if is_table_name(path):
            writer.saveAsTable(path)
        else:
            writer.save(self._location(path))

    def _file_set(self, path: str) -> set[str]:
        with _spark_errors("list the files of", path):
            return set(self._snapshot(path).inputFiles())

    def _last_commit(self, path: str, version: int) -> dict[str, Any]:
        """The normalized history entry of ``version`` if it is the latest commit, else ``{}``."""
        entries = self.history(path, 1)
        return entries[0] if entries and entries[0]["version"] == version else {}

    def _metrics_after(
        self,
        path: str,
        before: set[str],
        metric_names: Mapping[str, str],
        *,
        files_scanned: int | None = None,
        files_skipped: int | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> WriteMetrics:
        """Metrics of the write just done, from its commit and the new snapshot's files."""
        version = self.version(path)
        after = self._file_set(path)
        commit = self._last_commit(path, version)
        raw = commit.get("operationMetrics", {})
        counts = {field: _int_or_none(raw.get(name)) for field, name in metric_names.items()}
        return WriteMetrics(
            version=version,
            files_added=len(after - before),
            files_removed=len(before - after),
            files_scanned=files_scanned,
            files_skipped=files_skipped,
            extra={"operation": commit.get("operation"), "metrics": dict(raw), **(extra or {})},
            **counts,
        )

    def _log_adds(self, path: str, version: int, names: set[str]) -> dict[str, Any]:
        """The latest add action (at or below ``version``) of each data file named in ``names``."""
        if not names:
            return {}
        log = self._storage_location(path).rstrip("/") + "/_delta_log"
        sources = (
            ("json", f"{log}/*.json"),
            ("parquet", f"{log}/*.checkpoint*.parquet"),
            ("parquet", f"{log}/_sidecars/*.parquet"),
        )
        frames = []
        for fmt, pattern in sources:
            reader = self.spark.read.schema(_LOG_ADD_SCHEMA)
            try:
                frame = reader.json(pattern) if fmt == "json" else reader.parquet(pattern)
            except Exception as exc:
                # A glob that matches nothing (no checkpoint yet, no sidecars) is an
                # AnalysisException at load time; anything else is a real failure.
                if "PATH_NOT_FOUND" in str(exc) or "Path does not exist" in str(exc):
                    continue
                raise StorageError(f"Cannot read the transaction log of {path}: {exc}") from exc
            frames.append(
                frame.where(F.col("add").isNotNull()).select(
                    F.col("add.path").alias("path"),
                    F.col("add.size").alias("size"),
                    F.col("add.stats").alias("stats"),
                    F.col("add.deletionVector.cardinality").alias("dv_cardinality"),
                    F.col("_metadata.file_name").alias("log_file"),
                )
            )
        if not frames:
            return {}
        adds = frames[0]
        for frame in frames[1:]:
            adds = adds.unionByName(frame)
        name_of = F.element_at(F.split(F.col("path"), "/"), -1)
        rows = adds.withColumn("name", name_of).where(F.col("name").isin(sorted(names))).collect()
        latest: dict[str, tuple[int, Any]] = {}
        for row in rows:
            log_version = _log_version(row["log_file"])
            if log_version > version:
                continue
            # Names in the log are URL-encoded; Delta's own file names never need encoding.
            name = row["name"]
            if name not in latest or log_version >= latest[name][0]:
                latest[name] = (log_version, row)
        return {name: row for name, (_, row) in latest.items()}

    # ------------------------------------------------------------------ protocol

    def exists(self, path: str) -> bool:
        """Whether a Delta table is at ``path``."""
        from delta.tables import DeltaTable

        with _spark_errors("probe", path):
            if is_table_name(path):
                return bool(self.spark.catalog.tableExists(path))
            return bool(DeltaTable.isDeltaTable(self.spark, self._location(path)))

    def create(
        self,
        path: str,
        schema: StructType,
        *,
        cdf: bool = True,
        properties: Mapping[str, str] | None = None,
    ) -> bool:
        """Create an empty table if none is at ``path``; return whether this call created it."""
        from delta.tables import DeltaTable

        if self.exists(path):
            return False
        builder = DeltaTable.createIfNotExists(self.spark)
        builder = builder.tableName(path) if is_table_name(path) else builder.location(self._location(path))
        builder = builder.addColumns(schema)
        for key, value in (properties or {}).items():
            builder = builder.property(key, value)
        if cdf:
            builder = builder.property("delta.enableChangeDataFeed", "true")
        with _spark_errors("create", path):
            builder.execute()
        return True

    def version(self, path: str) -> int:
        """The latest version of the table."""
        table = self._delta_table(path)
        with _spark_errors("read the history of", path):
            return int(table.history(1).select("version").head()[0])

    def schema(self, path: str) -> StructType:
        """The table's current schema (nullability as declared in the table)."""
        return self._snapshot(path).schema

    def read(self, path: str, version: int | None = None, files: Sequence[str] | None = None) -> DataFrame:
        """The snapshot at ``version`` (default latest), optionally only the rows of ``files``."""
        df = self._snapshot(path, version)
        if files is None:
            return df
        with _spark_errors("list the files of", path):
            present = {_basename(f) for f in df.inputFiles()}
        wanted = []
        for file in files:
            name = _basename(file)
            if name not in present:
                where = "the latest version" if version is None else f"version {version}"
                raise StorageError(f"{file} is not a data file of {where} of the Delta table at {path}")
            wanted.append(name)
        if not wanted:
            return df.where(F.lit(False))
        return df.where(F.col("_metadata.file_name").isin(sorted(set(wanted))))

    def read_arrow(
        self, path: str, columns: Sequence[str] | None = None, files: Sequence[str] | None = None
    ) -> pa.Table:
        """The latest snapshot (or only ``files`` of it) collected as Arrow (one Spark job)."""
        df = self.read(path, files=files)
        return to_arrow(df.select(*[_quote(c) for c in columns]) if columns is not None else df)

    def files(self, path: str, version: int | None = None) -> list[FileStats]:
        """The snapshot's data files with statistics of the top-level columns from the log."""
        resolved = self.version(path) if version is None else int(version)
        df = self._snapshot(path, resolved)
        schema = df.schema
        with _spark_errors("list the files of", path):
            live = list(df.inputFiles())
        adds = self._log_adds(path, resolved, {_basename(f) for f in live})
        result = []
        for file in live:
            add = adds.get(_basename(file))
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
        end = latest if end_version is None else min(end_version, latest)
        empty = start_version > end
        # An empty range reads the latest version's changes and keeps none of them, so its
        # schema is exactly that of a non-empty feed.
        first, last = (latest, latest) if empty else (start_version, end)
        reader = (
            self.spark.read.format("delta")
            .option("readChangeFeed", "true")
            .option("startingVersion", first)
            .option("endingVersion", last)
        )
        with _spark_errors(f"read the change feed (versions {first}..{last}) of", path):
            if is_table_name(path):
                quoted = path.replace("'", "\\'")
                feed = self.spark.sql(f"SELECT * FROM table_changes('{quoted}', {first}, {last})")
            else:
                feed = reader.load(self._location(path))
            changes = feed.drop(_COMMIT_TIMESTAMP)
        return changes.where(F.lit(False)) if empty else changes

    def append(
        self, path: str, df: DataFrame, *, merge_schema: bool = False, expected_version: int | None = None
    ) -> WriteMetrics:
        """Append ``df``; with ``merge_schema`` its new columns are added to the table."""
        option = ("mergeSchema", "true") if merge_schema else None
        return self._write(path, df, "append", option, expected_version, {"rows_inserted": "numOutputRows"})

    def overwrite(
        self, path: str, df: DataFrame, *, expected_version: int | None = None, replace_schema: bool = False
    ) -> WriteMetrics:
        """Replace every row of the table with ``df``: same schema, or ``df``'s with ``replace_schema``
        (Delta's ``overwriteSchema``; one commit, history and properties stay)."""
        option = ("overwriteSchema", "true") if replace_schema else None
        metrics = {"rows_inserted": "numOutputRows", "rows_deleted": "numDeletedRows"}
        return self._write(path, df, "overwrite", option, expected_version, metrics)

    def _write(
        self,
        path: str,
        df: DataFrame,
        mode: str,
        option: tuple[str, str] | None,
        expected_version: int | None,
        metrics: Mapping[str, str],
    ) -> WriteMetrics:
        self._check_version(path, expected_version)
        before = self._file_set(path)
        writer = df.write.format("delta").mode(mode)
        if option is not None:
            writer = writer.option(*option)
        with _spark_errors("append to" if mode == "append" else mode, path):
            self._save(writer, path)
        return self._metrics_after(path, before, metrics)

    def merge(
        self, path: str, source: DataFrame, spec: MergeSpec, *, expected_version: int | None = None
    ) -> WriteMetrics:
        """MERGE ``source`` (materialized first) into the table as ``spec`` says."""
        if spec.delete_condition is None and not spec.update and not spec.insert:
            raise ValueError("MergeSpec has no clause: set delete_condition, update or insert")
        self._check_version(path, expected_version)
        table = self._delta_table(path)
        before = self._file_set(path)
        target_columns = self._snapshot(path).columns
        with _spark_errors("materialize the merge source for", path):
            # Evaluated once, here: MERGE's passes then all see the same rows (delta-io/delta#527).
            materialized = source.localCheckpoint(eager=True)
        plan = plan_merge(materialized.columns, target_columns, spec)
        if plan.add_columns:
            fields = {f.name: f for f in materialized.schema.fields}
            columns = ", ".join(f"{_quote(c)} {fields[c].dataType.simpleString()}" for c in plan.add_columns)
            with _spark_errors("add columns to", path):
                self.spark.sql(f"ALTER TABLE {self._sql_ref(path)} ADD COLUMNS ({columns})")
        builder = table.alias("t").merge(materialized.alias("s"), spec.on)
        if spec.delete_condition is not None:
            builder = builder.whenMatchedDelete(condition=spec.delete_condition)
        if spec.update and (plan.star or plan.assignments):
            if plan.star:
                builder = builder.whenMatchedUpdateAll(condition=spec.update_condition)
            else:
                builder = builder.whenMatchedUpdate(
                    condition=spec.update_condition, set=dict(plan.assignments)
                )
        if spec.insert and (plan.star or plan.assignments):
            if plan.star:
                builder = builder.whenNotMatchedInsertAll(condition=spec.insert_condition)
            else:
                builder = builder.whenNotMatchedInsert(
                    condition=spec.insert_condition, values=dict(plan.assignments)
                )
        if plan.evolve:
            builder = builder.withSchemaEvolution()
        with _spark_errors("merge into", path):
            builder.execute()
        return self._metrics_after(
            path,
            before,
            {
                "rows_inserted": "numTargetRowsInserted",
                "rows_updated": "numTargetRowsUpdated",
                "rows_deleted": "numTargetRowsDeleted",
            },
        )

    def delete(self, path: str, predicate: str | None = None) -> WriteMetrics:
        """Delete the rows matching ``predicate`` (all rows when ``None``)."""
        table = self._delta_table(path)
        before = self._file_set(path)
        # A delete without predicate drops whole files and logs a row count only where Delta
        # is configured to take it from file metadata; count first (answered from statistics).
        everything = self._snapshot(path).count() if predicate is None else None
        with _spark_errors("delete from", path):
            table.delete(predicate)
        metrics = self._metrics_after(path, before, {"rows_deleted": "numDeletedRows"})
        if metrics.rows_deleted is None and everything is not None:
            metrics = replace(metrics, rows_deleted=everything)
        return metrics

    def evolve(self, path: str, schema: StructType) -> bool:
        """Add ``schema``'s new columns; widen types with ``ALTER COLUMN … TYPE`` where the table
        has ``delta.enableTypeWidening``, else by rewriting it once with ``overwriteSchema``."""
        current = self.schema(path)
        target = merge_schemas(current, schema)
        if target == current:
            return False
        changed = changed_types(current, target)
        ref = self._sql_ref(path)
        with _spark_errors("change the schema of", path):
            widening = self._table_property(path, "delta.enableTypeWidening") == "true"
            if changed and not widening:
                rows = conform(self._snapshot(path), target)
                writer = rows.write.format("delta").mode("overwrite").option("overwriteSchema", "true")
                self._save(writer, path)
                return True
            for parts, dtype in changed:
                column = ".".join(_quote(p) for p in parts)
                self.spark.sql(f"ALTER TABLE {ref} ALTER COLUMN {column} TYPE {dtype.simpleString()}")
            if self.schema(path) != target:  # new columns: an empty append with schema merging
                empty = self.spark.createDataFrame([], target)
                self._save(empty.write.format("delta").mode("append").option("mergeSchema", "true"), path)
        return True

    def _check_version(self, path: str, expected_version: int | None) -> None:
        """Refuse a write when the table moved past ``expected_version``.

        delta-spark always commits against the latest snapshot, so this is a check right
        before the write; Delta's own conflict detection covers writers racing inside it.
        """
        if expected_version is not None and self.version(path) != expected_version:
            raise ConcurrentRunError(
                f"the Delta table at {path} moved past version {expected_version}: another writer "
                "committed to it first"
            )

    def _table_property(self, path: str, name: str) -> str | None:
        rows = self.spark.sql(f"SHOW TBLPROPERTIES {self._sql_ref(path)}").collect()
        return next((str(r["value"]) for r in rows if r["key"] == name), None)

    def optimize(
        self, path: str, zorder_by: Sequence[str] | None = None, target_size: int | None = None
    ) -> WriteMetrics:
        """Z-order by ``zorder_by`` when given, else compact small files (no data change).

        ``target_size`` sets ``spark.databricks.delta.optimize.maxFileSize`` for this call.
        """
        table = self._delta_table(path)
        before = self._file_set(path)
        previous = self.spark.conf.get(_OPTIMIZE_MAX_FILE_SIZE, None)
        if target_size is not None:
            self.spark.conf.set(_OPTIMIZE_MAX_FILE_SIZE, str(int(target_size)))
        try:
            with _spark_errors("optimize", path):
                optimizer = table.optimize()
                result = (
                    optimizer.executeZOrderBy(list(zorder_by)) if zorder_by else optimizer.executeCompaction()
                )
                row = result.head()
        finally:
            if target_size is not None:
                if previous is None:
                    self.spark.conf.unset(_OPTIMIZE_MAX_FILE_SIZE)
                else:
                    self.spark.conf.set(_OPTIMIZE_MAX_FILE_SIZE, previous)
        stats = (
            row["metrics"].asDict(recursive=True) if row is not None and row["metrics"] is not None else {}
        )
        return self._metrics_after(
            path,
            before,
            {},
            files_scanned=_int_or_none(stats.get("totalConsideredFiles")),
            files_skipped=_int_or_none(stats.get("totalFilesSkipped")),
            extra={"optimize": stats},
        )

    def history(self, path: str, limit: int | None = None) -> list[dict[str, Any]]:
        """Commits newest first (see :func:`cdc_join.storage.delta_rs.normalize_history_entry`)."""
        table = self._delta_table(path)
        with _spark_errors("read the history of", path):
            frame = table.history(limit) if limit is not None else table.history()
            # Epoch milliseconds: a collected TimestampType is a naive datetime in the Python
            # process's local zone, which need not be UTC.
            rows = frame.select(
                "version",
                F.unix_millis("timestamp").alias("timestamp"),
                "operation",
                "operationParameters",
                "operationMetrics",
            ).collect()
        return [normalize_history_entry(r.asDict(recursive=True)) for r in rows]


def _int_or_none(value: Any) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
