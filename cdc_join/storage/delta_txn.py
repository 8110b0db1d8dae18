"""A guarded append on Delta-on-Spark as one Delta transaction at the version the caller read.

A write that must find its table at version V (``expected_version``, see
:mod:`cdc_join.run.fence`) goes through ``DataFrameWriter`` with a transaction identifier
(``txnAppId``/``txnVersion``): Delta then reads the table's set transactions, which Delta 4.4
keeps only in the state it rebuilds from the log (three Spark jobs and a fourth to aggregate
them, 0.9 s a write against 0.3 s unguarded on a small table, measured 2026-12-06). A run makes
three such appends (state, subscriptions, the run log).

Where this process's Spark session runs open-source Delta in its own JVM (a local or classic
session: not Spark Connect, not Databricks, whose Delta has other classes), the same append is
one transaction of Delta's own API, with no state to rebuild:

- ``DeltaLog.startTransaction()`` reads the latest snapshot; unless it is version V the write
  fails before it writes a file (another writer committed first);
- ``readWholeTable()`` marks the transaction as depending on every row, so a data-changing
  commit that lands after V (another guarded append, which is not a blind append for the same
  reason, or the data-frame path's guarded write) makes Delta refuse this commit
  (``ConcurrentAppendException``) instead of committing it on top. So does a compaction
  committed in that moment (Delta counts any removed file against a transaction that read the
  whole table: ``ConcurrentDeleteReadException``), a lost race as a compaction committed after
  the run read the table already is (a metadata change stops any Delta transaction);
- ``writeFiles`` writes the rows as Delta's own writer does (statistics, invariants, column
  mapping), and ``commit`` commits them with the transaction identifier's ``SetTransaction``
  (so a data-frame guarded write of the same version still finds it and skips) and the guard's
  token as the commit's user metadata.

Rows already on the driver (change sets) need no Spark query at all: :func:`append_file`
writes them here as one data file (:mod:`cdc_join.storage.arrow_files`) and adds it in the
same transaction, or in a blind one for an unguarded append. A commit that loses leaves that
file unreferenced, as Spark's writer leaves its own; ``VACUUM`` removes it.

A small table's keyed replace (silver's, :func:`rewrite_files`) is such a transaction too: it
removes every file of the table and adds one written here with the rows that stay and the new
ones, plus a change data file of the rows deleted and inserted, so that the change feed shows
the keys that changed and nothing of the rows only copied.

The rows must have exactly the table's columns and types (the data-frame path checks and
casts them; this path leaves every other case to it). Measured on a table of a few rows:
0.35 s a guarded append against 0.89 s (medians of 32, one session).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.types import StructType

from cdc_join.errors import ConcurrentRunError, first_line
from cdc_join.storage import arrow_files


def delta_log_class(spark: SparkSession) -> Any | None:
    """Open-source Delta's ``DeltaLog`` in this session's JVM; ``None`` over Spark Connect,
    on Databricks, or where the class is not on the classpath."""
    if os.environ.get("DATABRICKS_RUNTIME_VERSION"):
        return None
    try:
        jvm = spark._jvm  # type: ignore[attr-defined]
    except Exception:  # a Connect session has no JVM here
        return None
    if jvm is None:
        return None
    from py4j.java_gateway import JavaClass

    found = jvm.org.apache.spark.sql.delta.DeltaLog
    return found if isinstance(found, JavaClass) else None


def same_columns(rows: StructType, table: StructType) -> bool:
    """Whether ``rows`` has the table's columns, in its order, with its types."""
    return [(f.name, f.dataType) for f in rows.fields] == [(f.name, f.dataType) for f in table.fields]


class Unsupported(Exception):
    """This JVM's Delta lacks a class or constructor the transaction needs (another release):
    the caller writes through the data-frame writer instead. Nothing was written."""


def append_at(
    spark: SparkSession, location: str, rows: DataFrame, expected: int, app_id: str, token: str
) -> int:
    """Append ``rows`` to the Delta table at ``location`` as the commit right after
    ``expected``; the version committed.

    Raises:
        Unsupported: before anything is written, where this Delta release's API differs.
        ConcurrentRunError: the table is past ``expected`` (checked when the transaction
            starts); a commit that changed data since is Delta's ``ConcurrentAppendException``,
            which the caller's error mapping turns into the same.
    """
    jvm = spark._jvm  # type: ignore[attr-defined]
    delta, operation = _api(jvm, token)
    try:
        actions = jvm.java.util.ArrayList()
        now = jvm.scala.Some(int(time.time() * 1000))
        actions.add(delta.actions.SetTransaction(app_id, expected + 1, now))
    except _py4j_error() as exc:
        raise Unsupported(first_line(exc)) from exc
    txn = _started_at(spark, delta, location, expected)
    written = txn.writeFiles(rows._jdf).iterator()
    while written.hasNext():
        actions.add(written.next())
    return int(txn.commit(jvm.scala.jdk.javaapi.CollectionConverters.asScala(actions).toList(), operation))


def append_file(
    spark: SparkSession,
    location: str,
    folder: str,
    table: pa.Table,
    expected: int | None,
    app_id: str,
    note: str | None,
) -> int | None:
    """Add ``table`` (rows on the driver, in the table's columns and Arrow types) to the Delta
    table at ``location``, whose folder on this machine is ``folder``, as one data file written
    here (:mod:`cdc_join.storage.arrow_files`), in one transaction: at ``expected`` as
    :func:`append_at` commits, or without it as a blind append. ``note`` is the commit's user
    metadata. The version committed; ``None``, with nothing written, where the table takes no
    such file or a NOT NULL column of it would get a null (Spark's writer then writes, or
    refuses, the rows).

    Raises:
        Unsupported: before anything is written, where this Delta release's API differs.
        ConcurrentRunError: as :func:`append_at`.
    """
    jvm = spark._jvm  # type: ignore[attr-defined]
    delta, operation = _api(jvm, note)
    txn = _started_at(spark, delta, location, expected)
    try:
        action = delta.actions.Action.fromJson
        metadata = json.loads(txn.metadata().json())["metaData"]
        protocol = json.loads(txn.protocol().json())["protocol"]
    except _py4j_error() as exc:
        raise Unsupported(first_line(exc)) from exc
    schema = json.loads(metadata.get("schemaString") or "{}")
    if arrow_files.refused(protocol, metadata) or arrow_files.nulls_where_refused(table, schema):
        return None
    written = arrow_files.write(table, folder)
    actions = jvm.java.util.ArrayList()
    if expected is not None:
        lines = {"appId": app_id, "version": expected + 1, "lastUpdated": int(time.time() * 1000)}
        actions.add(action(json.dumps({"txn": lines})))
    actions.add(action(written.add_action()))
    _metrics(spark, txn, {"numFiles": 1, "numOutputRows": written.rows, "numOutputBytes": written.size})
    return int(txn.commit(jvm.scala.jdk.javaapi.CollectionConverters.asScala(actions).toList(), operation))


def rewrite_files(
    spark: SparkSession,
    location: str,
    folder: str,
    files: Sequence[Mapping[str, Any]],
    table: pa.Table,
    changes: pa.Table | None,
    rewrite: Rewrite,
) -> int | None:
    """Replace ``files`` (every data file of the table at ``rewrite.expected``, as its ``add``
    actions) with one data file holding ``table`` (none when it is empty), in one transaction
    at ``rewrite.expected`` as :func:`append_at` commits; ``changes`` (the table's columns and
    ``_change_type``) as its change data file, which is then what a change-feed reader reads
    of the commit (Delta's ``CDCReader``: a commit's change files, where it has any, are its
    changes). The version committed; ``None``, with nothing committed, where the table takes
    no such file (:func:`append_file`).

    Raises:
        Unsupported: before anything is written, where this Delta release's API differs.
        ConcurrentRunError: as :func:`append_at`.
    """
    jvm = spark._jvm  # type: ignore[attr-defined]
    delta, operation = _api(jvm, rewrite.note, rewrite.predicate, overwrite=True)
    txn = _started_at(spark, delta, location, rewrite.expected)
    try:
        action = delta.actions.Action.fromJson
        metadata = json.loads(txn.metadata().json())["metaData"]
        protocol = json.loads(txn.protocol().json())["protocol"]
        now = int(time.time() * 1000)
        removed = [action(json.dumps({"add": f})).removeWithTimestamp(now, True) for f in files]
    except _py4j_error() as exc:
        raise Unsupported(first_line(exc)) from exc
    schema = json.loads(metadata.get("schemaString") or "{}")
    if arrow_files.refused(protocol, metadata) or arrow_files.nulls_where_refused(table, schema):
        return None
    actions = jvm.java.util.ArrayList()
    if rewrite.app_id is not None:
        lines = {"appId": rewrite.app_id, "version": rewrite.expected + 1, "lastUpdated": now}
        actions.add(action(json.dumps({"txn": lines})))
    for remove in removed:
        actions.add(remove)
    if table.num_rows:
        actions.add(action(arrow_files.write(table, folder).add_action()))
    if changes is not None and changes.num_rows:
        actions.add(action(arrow_files.write(changes, folder, changes=True).cdc_action()))
    _metrics(spark, txn, rewrite.metrics(len(files), table.num_rows, changes))
    return int(txn.commit(jvm.scala.jdk.javaapi.CollectionConverters.asScala(actions).toList(), operation))


@dataclass(frozen=True)
class Rewrite:
    """What :func:`rewrite_files` commits besides its files: the version it must find, the
    transaction identifier's app id (``None``: a write that carries none, an unguarded
    overwrite), the commit's user metadata, the predicate its history shows (``None``: an
    overwrite of every row), and the rows it deletes and inserts (for the history's metrics)."""

    expected: int
    app_id: str | None
    note: str | None
    predicate: str | None
    deleted: int
    inserted: int

    def metrics(self, removed: int, rows: int, changes: pa.Table | None) -> dict[str, int]:
        return {
            "numFiles": 1 if rows else 0,
            "numOutputRows": self.inserted,
            "numRemovedFiles": removed,
            "numDeletedRows": self.deleted,
            "numCopiedRows": rows - self.inserted,
            "numAddedChangeFiles": 1 if changes is not None and changes.num_rows else 0,
        }


def _api(
    jvm: Any, note: str | None, predicate: str | None = None, *, overwrite: bool = False
) -> tuple[Any, Any]:
    """Delta's package in this JVM, and the ``WRITE`` operation of an append with ``note`` as
    its user metadata (with ``overwrite``: of an overwrite, of the rows ``predicate`` names as
    a ``replaceWhere`` records it, or of every row)."""
    try:
        delta = jvm.org.apache.spark.sql.delta
        none = getattr(getattr(jvm.scala, "None$"), "MODULE$")
        metadata = none if note is None else jvm.scala.Some(note)
        modes = jvm.org.apache.spark.sql.SaveMode
        mode = modes.Overwrite if overwrite else modes.Append
        where = none if predicate is None else jvm.scala.Some(predicate)
        # DeltaOperations.Write(mode, partitionBy, predicate, userMetadata, five more options)
        write = getattr(delta, "DeltaOperations$Write")(mode, none, where, metadata, *[none] * 5)
    except _py4j_error() as exc:
        raise Unsupported(first_line(exc)) from exc
    return delta, write


def _started_at(spark: SparkSession, delta: Any, location: str, expected: int | None) -> Any:
    """A transaction on the table's latest snapshot, which must be ``expected`` (if given); it
    then depends on every row of the table (see the module docstring)."""
    txn = delta.DeltaLog.forTable(spark._jsparkSession, location).startTransaction()  # type: ignore[attr-defined]
    if expected is None:
        return txn
    if txn.readVersion() != expected:
        raise ConcurrentRunError(
            f"the Delta table at {location} moved past version {expected}: another writer "
            "committed to it first"
        )
    txn.readWholeTable()
    return txn


def _metrics(spark: SparkSession, txn: Any, values: dict[str, int]) -> None:
    """Give the commit the operation metrics Delta's writer records (its history shows them);
    where this Delta cannot take them, the commit has none."""
    jvm = spark._jvm  # type: ignore[attr-defined]
    try:
        create = jvm.org.apache.spark.sql.execution.metric.SQLMetrics.createMetric
        found = jvm.java.util.HashMap()
        for name, value in values.items():
            metric = create(spark.sparkContext._jsc.sc(), name)
            metric.add(value)
            found.put(name, metric)
        scala = jvm.scala.jdk.javaapi.CollectionConverters.asScala(found)
        maps = getattr(getattr(jvm.scala.collection.immutable, "Map$"), "MODULE$")
        txn.registerSQLMetrics(spark._jsparkSession, getattr(maps, "from")(scala))
    except _py4j_error():  # the history shows no metrics
        return


def _py4j_error() -> type[Exception]:
    from py4j.protocol import Py4JError  # not in a Spark Connect client's install

    return Py4JError
