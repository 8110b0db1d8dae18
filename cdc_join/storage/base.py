"""The storage seam: the few Delta operations a run needs, as one small protocol.

Compute is Spark; this protocol is the only place that knows how a Delta table is read or
written (the rows of a few wanted keys may be read without Spark, see ``read_rows``). Two
backends implement it: :mod:`cdc_join.storage.delta_rs` (embedded default, ``deltalake``) and
:mod:`cdc_join.storage.delta_spark` (Delta on the Spark classpath).

Rules every backend follows (the contract tests in ``tests/contract`` check them):

- Paths are table roots (local paths or URIs), or — on backends that support it — metastore
  table names ``catalog.schema.table`` (see :func:`is_table_name`). ``create`` is create-if-absent and returns
  whether it created the table.
- ``read`` returns a Spark DataFrame of a snapshot: the latest version, or ``version``.
  ``files`` narrows the read to some of that snapshot's data files (as named by
  :meth:`Storage.files`), which is how callers skip files by statistics.
- ``read_arrow`` returns a small table's latest snapshot (optionally some columns, some of
  its files) as Arrow on the driver: for the pipeline's own logs, which a run reads without
  the cost of a Spark job where the backend can.
- ``read_rows`` returns the rows of a snapshot whose column equals one of some values (a null
  matches nothing) as Arrow on the driver, where the backend reads Delta without Spark
  (delta-rs); a backend that would need a Spark job for it returns ``None`` and the caller
  reads with Spark. Keyed reads of a run's changed keys go this way, and silver's hashes of
  them (a table with deletion vectors: delta-rs's ``QueryBuilder`` reads it, without
  ``files``). ``columns`` keeps only those columns.
- ``read_changes`` returns the Change Data Feed rows committed in versions
  ``start_version..end_version`` (both inclusive; ``end_version=None`` means latest), with the
  columns ``_change_type`` (``insert``, ``update_preimage``, ``update_postimage``, ``delete``)
  and ``_commit_version``. The table must have been created with ``cdf=True``.
- ``merge`` evaluates its source once (a lazily re-evaluated source that reads the target is how
  Delta MERGE produced duplicates, delta-io/delta#527: delta-rs takes the source as Arrow, and
  delta-spark's MERGE materializes its source itself), runs
  ``MERGE INTO target AS t USING source AS s ON spec.on`` with the clauses of
  :class:`MergeSpec` in the order delete, update, insert, and returns its metrics.
  Conditions are SQL over ``s.`` and ``t.`` that both Spark SQL and DataFusion accept: plain
  comparisons, ``AND``/``OR``/``NOT``, ``IS NULL``, ``IS DISTINCT FROM``.
- ``append``, ``overwrite`` and ``merge`` take their rows as a Spark frame or as a change set
  already on the driver (:data:`cdc_join.changeset.Rows`), and ``expected_version``: the
  write commits only if the table is still at that version, else it raises
  :class:`~cdc_join.errors.ConcurrentRunError` (another writer committed first). This is how
  a run makes sure nothing else wrote silver or the run log while it worked.
- ``append``, ``overwrite`` and ``merge`` record ``note`` (when given) as their commit's user
  metadata, which ``history`` gives back as ``userMetadata``: which run attempt made a commit,
  and what kind of write it was (:mod:`cdc_join.storage.commits`).
- ``evolve`` grows a table's schema to hold ``schema`` by :mod:`cdc_join.schemas`' rules: new
  columns (nested ones too) are added, widened types change in place where the backend can
  (Delta type widening) and by rewriting the table once where it cannot. It returns whether
  the schema changed.
- ``set_properties`` sets the table properties whose value differs (one metadata commit, no
  data file written) and returns whether any did.
- Nothing here vacuums.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Protocol, runtime_checkable

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.types import StructType

from cdc_join.changeset import Rows
from cdc_join.errors import ConcurrentRunError, StorageError
from cdc_join.locations import local_path

#: Operations (as :meth:`Storage.history` names them, upper-cased) that change no row: a
#: compaction, a schema or property change.
DATA_PRESERVING_OPERATIONS = frozenset(
    {
        "OPTIMIZE",
        "REORG",
        "ADD COLUMNS",
        "CHANGE COLUMN",
        "SET TBLPROPERTIES",
        "UNSET TBLPROPERTIES",
        "UPGRADE PROTOCOL",
        "ADD FEATURE",
        "VACUUM START",
        "VACUUM END",
        "COMPUTE STATS",
    }
)


@dataclass(frozen=True)
class MergeSpec:
    """What a MERGE does, independent of the backend.

    Clauses apply in this order: ``WHEN MATCHED AND delete_condition THEN DELETE`` (only if
    ``delete_condition`` is set), ``WHEN MATCHED [AND update_condition] THEN UPDATE SET *``
    (only if ``update``), ``WHEN NOT MATCHED [AND insert_condition] THEN INSERT *`` (only if
    ``insert``). ``SET *``/``INSERT *`` take every target column from the source column of the
    same name; ``exclude_columns`` names source columns that are only used in conditions and
    are not written. With ``merge_schema`` new source columns are added to the target.
    """

    on: str
    update: bool = True
    update_condition: str | None = None
    delete_condition: str | None = None
    insert: bool = True
    insert_condition: str | None = None
    exclude_columns: tuple[str, ...] = ()
    merge_schema: bool = False


@dataclass(frozen=True)
class WriteMetrics:
    """What a write did. Counts a backend cannot know are ``None``."""

    version: int
    rows_inserted: int | None = None
    rows_updated: int | None = None
    rows_deleted: int | None = None
    files_added: int | None = None
    files_removed: int | None = None
    files_scanned: int | None = None
    files_skipped: int | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class FileStats:
    """One data file of a snapshot with its per-column statistics (``None`` where absent)."""

    path: str
    size_bytes: int
    num_records: int | None
    min_values: Mapping[str, Any]
    max_values: Mapping[str, Any]
    null_counts: Mapping[str, Any] = field(default_factory=dict)
    #: Rows of the file a deletion vector removes (not counted in ``num_records``).
    deleted_rows: int = 0


@runtime_checkable
class Storage(Protocol):
    """The narrow seam between a run and its Delta tables."""

    name: str
    spark: SparkSession
    #: Whether :meth:`replace_keys` marks the rows it deletes (deletion vectors) instead of
    #: rewriting the files that hold them: then it is cheaper than a MERGE of the same keys.
    replaces_keys_in_place: bool

    def exists(self, path: str) -> bool: ...

    def create(
        self,
        path: str,
        schema: StructType,
        *,
        cdf: bool = True,
        properties: Mapping[str, str] | None = None,
    ) -> bool: ...

    def version(self, path: str) -> int: ...

    def schema(self, path: str) -> StructType: ...

    def read(
        self, path: str, version: int | None = None, files: Sequence[str] | None = None
    ) -> DataFrame: ...

    def read_arrow(
        self, path: str, columns: Sequence[str] | None = None, files: Sequence[str] | None = None
    ) -> pa.Table: ...

    def read_rows(
        self,
        path: str,
        column: str,
        values: Sequence[Any],
        version: int | None = None,
        files: Sequence[str] | None = None,
        *,
        columns: Sequence[str] | None = None,
    ) -> pa.Table | None: ...

    def files(self, path: str, version: int | None = None) -> list[FileStats]: ...

    def read_changes(self, path: str, start_version: int, end_version: int | None = None) -> DataFrame: ...

    def append(
        self,
        path: str,
        df: Rows,
        *,
        merge_schema: bool = False,
        expected_version: int | None = None,
        note: str | None = None,
    ) -> WriteMetrics: ...

    def overwrite(
        self,
        path: str,
        df: Rows,
        *,
        expected_version: int | None = None,
        replace_schema: bool = False,
        note: str | None = None,
    ) -> WriteMetrics: ...

    def merge(
        self,
        path: str,
        source: Rows,
        spec: MergeSpec,
        *,
        expected_version: int | None = None,
        note: str | None = None,
    ) -> WriteMetrics: ...

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
        """In one commit, delete every row whose ``columns`` equal one of ``keys``' rows and
        append ``rows`` (each of whose keys must be among ``keys``; the write fails otherwise).
        ``keys`` must be :func:`cdc_join.storage.keyed.nameable`. A key ``keys`` names and
        ``rows`` lacks ends deleted."""
        ...

    def delete(self, path: str, predicate: str | None = None) -> WriteMetrics: ...

    def evolve(self, path: str, schema: StructType) -> bool: ...

    def set_properties(self, path: str, properties: Mapping[str, str]) -> bool: ...

    def optimize(
        self,
        path: str,
        zorder_by: Sequence[str] | None = None,
        target_size: int | None = None,
        *,
        purge: bool = False,
    ) -> WriteMetrics: ...

    def history(self, path: str, limit: int | None = None) -> list[dict[str, Any]]: ...


def rows_matching(dataset: Any, column: str, values: Sequence[Any]) -> pa.Table:
    """The rows of a pyarrow dataset whose ``column`` equals one of ``values`` (a null matches
    nothing), streamed from each file in batches of :data:`KEYED_BATCH_ROWS` rows.

    Arrow's dataset scanner decodes a whole row group before it filters (Spark writes 128 MB
    files of one or two row groups): a keyed read of 6,000 orders from a 15 M-row state table
    peaked at 4.2–4.6 GB of driver memory with Arrow's default readahead and 1.6 GB scanning
    one file and one batch ahead. Streamed, it peaks at ~0.3 GB and takes 2.0–2.6 s instead of
    3.5–4.7 s (benchmarks/CHANGELOG.md, 2026-11-28). A file the stream cannot read as the
    dataset's schema (a partition, a type Arrow cannot cast to the table's) is scanned as before.
    """
    wanted = pa.array([v for v in values if v is not None], dataset.schema.field(column).type)
    batches: list[pa.RecordBatch] = []
    for fragment in dataset.get_fragments():
        if fragment.partition_expression.equals(pc.scalar(True)):  # no partition value to add
            try:
                batches.extend(list(_streamed_matches(dataset, fragment, column, wanted)))
                continue
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
                pass  # a type Arrow cannot cast to the table's: the scanner reads the file
        batches.extend(_scanned(dataset, fragment, column, wanted).to_batches())
    return pa.Table.from_batches(batches, schema=dataset.schema)


def _scanned(dataset: Any, fragment: Any, column: str, wanted: pa.Array) -> pa.Table:
    """The matching rows of one fragment, by Arrow's dataset scanner.

    A file delta-rs rewrote (a delete, a merge) may store text as ``string_view``; the scanner
    then cannot compare the file's statistics (delta-rs gives them as the fragment's guarantee)
    with the filter, and fails. Such a file is read whole and filtered after its cast."""
    one = ds.FileSystemDataset([fragment], dataset.schema, dataset.format, dataset.filesystem)
    try:
        return one.to_table(filter=pc.field(column).isin(wanted), batch_readahead=1)
    except pa.ArrowNotImplementedError:
        whole = one.to_table(batch_readahead=1)
        return whole.filter(pc.is_in(whole.column(column), value_set=wanted))


SMALL_READ_BYTES = 4 * 1024 * 1024
"""The most bytes of data files of a local snapshot that :meth:`Storage.read` reads on the
driver, as Arrow with a Spark frame over it (both backends): no Delta snapshot computation or
file scan, and keys and counts of it without a Spark job."""

#: Rows per batch of a streamed keyed read (:func:`rows_matching`): 32,768 rows of a wide
#: state table are a few MB; 8,192 saved little memory and cost a fifth more time.
KEYED_BATCH_ROWS = 32_768


def _streamed_matches(dataset: Any, fragment: Any, column: str, wanted: pa.Array) -> Any:
    """The matching rows of one parquet file, batch by batch, as the dataset's schema (columns
    the file lacks are null, ``from_arrays`` casts the others to the schema's types, or raises
    where Arrow cannot)."""
    options = getattr(dataset.format, "read_options", None)
    unit = getattr(options, "coerce_int96_timestamp_unit", None) or "ns"
    schema = dataset.schema
    with dataset.filesystem.open_input_file(fragment.path) as source:
        parquet = pq.ParquetFile(
            source, pre_buffer=False, buffer_size=1 << 20, coerce_int96_timestamp_unit=unit
        )
        present = [name for name in schema.names if name in parquet.schema_arrow.names]
        for batch in parquet.iter_batches(batch_size=KEYED_BATCH_ROWS, columns=present):
            arrays = [
                batch.column(f.name) if f.name in present else pa.nulls(batch.num_rows, f.type)
                for f in schema
            ]
            rows = pa.RecordBatch.from_arrays(arrays, schema=schema)
            keep = pc.is_in(rows.column(column), value_set=wanted)
            if pc.any(keep).as_py():
                yield rows.filter(keep)


def normalize_history_entry(entry: Mapping[str, Any]) -> dict[str, Any]:
    """One commit of :meth:`Storage.history` in the backend-independent shape.

    Keys: ``version`` (int), ``timestamp`` (aware UTC ``datetime``), ``operation`` (str),
    ``operationParameters`` (dict of str), ``operationMetrics`` (dict; integer-valued metrics
    as ``int``), ``userMetadata`` (str or ``None``). Metric names are the backend's own
    (delta-rs: ``num_target_rows_inserted``, delta-spark: ``numTargetRowsInserted``).
    """
    ts = entry.get("timestamp")
    if isinstance(ts, (int, float)):
        when: datetime | None = datetime.fromtimestamp(ts / 1000, tz=timezone.utc)
    elif isinstance(ts, datetime):
        when = ts if ts.tzinfo else ts.replace(tzinfo=timezone.utc)
    else:
        when = None
    params = {
        str(k): v if isinstance(v, str) else json.dumps(v)
        for k, v in (entry.get("operationParameters") or {}).items()
    }
    metrics: dict[str, Any] = {}
    for key, value in (entry.get("operationMetrics") or {}).items():
        as_int = _int(value) if isinstance(value, (int, str)) and not isinstance(value, bool) else None
        metrics[str(key)] = as_int if as_int is not None else value
    return {
        "version": int(entry["version"]),
        "timestamp": when,
        "operation": entry.get("operation"),
        "operationParameters": params,
        "operationMetrics": metrics,
        "userMetadata": entry.get("userMetadata"),
    }


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def other_files(path: str) -> list[str]:
    """The names in the local folder ``path`` other than a ``_delta_log`` (none for a folder not
    there yet, or a path on another file system)."""
    local = local_path(path)
    if local is None or not os.path.isdir(local):
        return []
    return sorted(name for name in os.listdir(local) if name != "_delta_log")


def refuse_other_files(path: str) -> None:
    """Refuse to create a table in a local folder that holds files of its own (a typo'd path, or
    another tool's data): a table would be written among them, or Delta would refuse later."""
    found = other_files(path)
    if found:
        shown = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
        raise StorageError(
            f"Cannot create the Delta table at {path}: the folder is not empty and holds no Delta "
            f"table ({shown}); point the table at an empty or new folder"
        )


_ALREADY_THERE = re.compile(r"already exists|ALREADY_EXISTS", re.IGNORECASE)


def lost_create(
    exists: Callable[[str], bool],
    path: str,
    error: StorageError | ConcurrentRunError,
    wait: float = 30.0,
    *,
    being_created: bool = False,
) -> bool:
    """After a ``CREATE`` at ``path`` failed: ``False`` once the table another writer was creating
    is there (this call did not create it). A failure that says the table already exists (or, with
    ``being_created``, that another writer's unfinished log is there) while none shows up within
    ``wait`` seconds is :class:`ConcurrentRunError` (another run is creating it); any other failure
    (a lost commit among them) is re-raised."""
    said_exists = being_created or bool(_ALREADY_THERE.search(str(error)))
    deadline = time.monotonic() + wait
    while not exists(path):
        if not said_exists or time.monotonic() > deadline:
            if said_exists and isinstance(error, StorageError):
                raise ConcurrentRunError(
                    f"could not create the Delta table at {path}: another run is creating it"
                ) from error
            raise error
        time.sleep(0.2)
    return False
