"""A guarded append on Delta-on-Spark as one Delta transaction (cdc_join.storage.delta_txn).

The racing-writers contract test (tests/contract) covers two guarded appends checked at once;
these cover the cases only this path has: a writer whose version check passed before another
writer committed, a data-frame guarded write meeting this path's commit, and rows this path
leaves to the data-frame writer. Rows already on the driver (change sets) are added as a data
file written here (cdc_join.storage.arrow_files), in the same transaction, without a Spark job.
"""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pytest
from pyspark.sql.types import LongType, StringType, StructField, StructType

from cdc_join.changeset import arrow_schema, from_arrow
from cdc_join.errors import ConcurrentRunError, StorageError
from cdc_join.report import SparkJobs
from cdc_join.storage import delta_txn
from cdc_join.storage.delta_spark import DeltaSparkStorage

KV = StructType([StructField("id", LongType(), False), StructField("v", StringType(), True)])
KV_DDL = "id long, v string"


@pytest.fixture
def store(spark) -> DeltaSparkStorage:
    return DeltaSparkStorage(spark)


def _spy(monkeypatch, name: str) -> list:
    """What each call of ``delta_txn.<name>`` returned, in order."""
    returned: list = []
    real = getattr(delta_txn, name)

    def spy(*args, **kwargs):
        returned.append(real(*args, **kwargs))
        return returned[-1]

    monkeypatch.setattr(delta_txn, name, spy)
    return returned


@pytest.fixture
def transactions(monkeypatch) -> list[int]:
    """The versions each guarded append committed through Delta's own transaction."""
    return _spy(monkeypatch, "append_at")


def _table(store: DeltaSparkStorage, spark, path: str) -> int:
    store.create(path, KV)
    store.append(path, spark.createDataFrame([(1, "a")], KV_DDL))
    return store.version(path)


def _ids(store: DeltaSparkStorage, path: str) -> list[int]:
    return sorted(r["id"] for r in store.read(path).collect())


def test_a_guarded_append_is_one_delta_transaction_with_the_write_s_token_and_metrics(
    store, spark, tmp_path, transactions
):
    path = str(tmp_path / "t")
    seen = _table(store, spark, path)
    written = store.append(
        path, spark.createDataFrame([(2, "b"), (3, None)], KV_DDL), expected_version=seen, note="run 7"
    )
    assert transactions == [seen + 1]
    assert written.version == seen + 1 and written.rows_inserted == 2 and written.files_added > 0
    last = store.history(path, 1)[0]
    assert last["operation"] == "WRITE" and last["userMetadata"].startswith("run 7:")
    assert _ids(store, path) == [1, 2, 3]


def test_a_guarded_append_whose_check_passed_before_another_commit_does_not_land(
    store, spark, tmp_path, transactions, monkeypatch
):
    # The version check came before the other writer's commit, the transaction after it: the
    # transaction starts at a later version than the write expects, so it writes nothing.
    path = str(tmp_path / "t")
    seen = _table(store, spark, path)
    store.append(path, spark.createDataFrame([(2, "winner")], KV_DDL), expected_version=seen)
    monkeypatch.setattr(DeltaSparkStorage, "_check_version", lambda *_: None)
    with pytest.raises(ConcurrentRunError, match="moved past version"):
        store.append(path, spark.createDataFrame([(3, "late")], KV_DDL), expected_version=seen)
    assert _ids(store, path) == [1, 2]
    assert store.version(path) == seen + 1


def test_a_data_frame_guarded_write_of_a_version_this_path_committed_is_skipped(
    store, spark, tmp_path, transactions, monkeypatch
):
    # Over Spark Connect (or with rows of other types) the same guard is the data-frame
    # writer's transaction id; the commit here carries it, so such a writer skips and loses.
    path = str(tmp_path / "t")
    seen = _table(store, spark, path)
    store.append(path, spark.createDataFrame([(2, "jvm")], KV_DDL), expected_version=seen)
    assert transactions == [seen + 1]
    monkeypatch.setattr(DeltaSparkStorage, "_check_version", lambda *_: None)
    monkeypatch.setattr(DeltaSparkStorage, "_appends_in_jvm", lambda *_: False)
    with pytest.raises(ConcurrentRunError):
        store.append(path, spark.createDataFrame([(3, "frame")], KV_DDL), expected_version=seen)
    assert _ids(store, path) == [1, 2]


def test_rows_of_other_types_or_unguarded_appends_take_the_data_frame_writer(
    store, spark, tmp_path, transactions
):
    path = str(tmp_path / "t")
    seen = _table(store, spark, path)
    store.append(path, spark.createDataFrame([("b", 2)], "v string, id long"), expected_version=seen)
    store.append(path, spark.createDataFrame([(3, "c")], KV_DDL))
    assert transactions == []
    assert _ids(store, path) == [1, 2, 3]
    assert store.read(path).schema["id"].dataType == LongType()


class _Remote:
    """A session whose JVM is elsewhere (Spark Connect): it has no ``_jvm`` here."""

    @property
    def _jvm(self):
        raise AttributeError("_jvm is not supported in Spark Connect")


def test_a_session_without_a_jvm_here_or_on_databricks_keeps_the_data_frame_writer(spark, monkeypatch):
    assert delta_txn.delta_log_class(_Remote()) is None
    assert delta_txn.delta_log_class(spark) is not None
    monkeypatch.setenv("DATABRICKS_RUNTIME_VERSION", "17.3")
    assert delta_txn.delta_log_class(spark) is None


class _OtherDelta:
    """A JVM whose Delta has other classes or constructors (another release)."""

    class _View:
        def __getattr__(self, name):
            from py4j.protocol import Py4JError

            raise Py4JError(f"{name} does not exist in the JVM")

    _jvm = _View()


def test_a_delta_release_with_another_api_is_told_before_anything_is_written():
    with pytest.raises(delta_txn.Unsupported, match="does not exist"):
        delta_txn.append_at(_OtherDelta(), "/nowhere", None, 0, "cdc_join", "token")


def test_where_the_transaction_is_unsupported_the_data_frame_writer_appends(
    store, spark, tmp_path, monkeypatch
):
    def unsupported(*_args, **_kwargs):
        raise delta_txn.Unsupported("no DeltaOperations$Write of this shape")

    monkeypatch.setattr(delta_txn, "append_at", unsupported)
    path = str(tmp_path / "t")
    seen = _table(store, spark, path)
    written = store.append(path, spark.createDataFrame([(2, "b")], KV_DDL), expected_version=seen)
    assert written.version == seen + 1 and _ids(store, path) == [1, 2]
    assert store._delta_log is False  # not tried again


# --------------------------------------------------------------------------- rows on the driver


@pytest.fixture
def files(monkeypatch) -> list[int | None]:
    """What each append of rows on the driver got from the transaction that adds a file written
    here (``None``: the table takes no such file)."""
    return _spy(monkeypatch, "append_file")


NULLABLE_KV = StructType([StructField(f.name, f.dataType, True) for f in KV.fields])


def _driver_rows(spark, data: list[tuple], schema: StructType = KV):
    rows = [dict(zip(schema.names, row, strict=True)) for row in data]
    return from_arrow(spark, schema, pa.Table.from_pylist(rows, arrow_schema(schema)))


def _data_files(path: str) -> set[str]:
    return {name for name in os.listdir(path) if name.endswith(".parquet")}


def test_rows_on_the_driver_are_one_file_written_here_with_delta_s_statistics_and_no_spark_job(
    store, spark, tmp_path, files, transactions
):
    path = str(tmp_path / "t")
    seen = _table(store, spark, path)
    jobs = SparkJobs(spark)
    with jobs.group("append") as count:
        written = store.append(
            path, _driver_rows(spark, [(2, "b"), (3, None)]), expected_version=seen, note="run 7"
        )
        store.append(path, _driver_rows(spark, [(4, "d")]), note="ingest log")
        assert count() == 0
    assert files == [seen + 1, seen + 2] and transactions == []
    assert (written.version, written.rows_inserted, written.files_added) == (seen + 1, 2, 1)
    newest, guarded = store.history(path, 2)
    assert newest["userMetadata"] == "ingest log" and guarded["userMetadata"].startswith("run 7:")
    assert guarded["operation"] == "WRITE" and guarded["operationMetrics"]["numOutputRows"] == 2
    assert _ids(store, path) == [1, 2, 3, 4]
    # Delta skips files on the statistics the file was added with: ids 1, 2-3 and 4
    table = spark.read.format("delta").load(path)
    assert [len(table.where(f"id = {n}").inputFiles()) for n in (1, 3, 4, 9)] == [1, 1, 1, 0]


def test_a_driver_append_whose_check_passed_before_another_commit_does_not_land(
    store, spark, tmp_path, files, monkeypatch
):
    path = str(tmp_path / "t")
    seen = _table(store, spark, path)
    store.append(path, _driver_rows(spark, [(2, "winner")]), expected_version=seen)
    before = _data_files(path)
    monkeypatch.setattr(DeltaSparkStorage, "_check_version", lambda *_: None)
    with pytest.raises(ConcurrentRunError, match="moved past version"):
        store.append(path, _driver_rows(spark, [(3, "late")]), expected_version=seen)
    assert _ids(store, path) == [1, 2] and store.version(path) == seen + 1
    assert _data_files(path) == before  # refused before it wrote a file


def test_tables_that_take_no_such_file_and_nulls_in_not_null_columns_take_spark_s_writer(
    store, spark, tmp_path, files
):
    path = str(tmp_path / "t")
    seen = _table(store, spark, path)
    with pytest.raises(StorageError):  # Delta's writer refuses the null, as it did before
        store.append(path, _driver_rows(spark, [(None, "no id")], NULLABLE_KV), expected_version=seen)
    store.set_properties(path, {"delta.enableRowTracking": "true"})
    at = store.version(path)
    store.append(path, _driver_rows(spark, [(2, "tracked")]), expected_version=at)
    assert files == [None, None]
    assert _ids(store, path) == [1, 2] and store.version(path) == at + 1


@pytest.fixture
def rewrites(monkeypatch) -> list[int | None]:
    """What each keyed replace of a small table on the driver committed (``None``: nothing)."""
    return _spy(monkeypatch, "rewrite_files")


def test_a_keyed_replace_of_rows_on_the_driver_rewrites_a_small_table_here_without_a_spark_job(
    store, spark, tmp_path, rewrites
):
    path = str(tmp_path / "t")
    seen = _table(store, spark, path)
    store.append(path, spark.createDataFrame([(2, "b"), (3, "c")], KV_DDL))
    keys = pa.table({"id": pa.array([2, 3], pa.int64())})
    before = len(spark.read.format("delta").load(path).inputFiles())
    jobs = SparkJobs(spark)
    with jobs.group("replace") as count:
        m = store.replace_keys(
            path, _driver_rows(spark, [(2, "b2")]), ["id"], keys, expected_version=seen + 1
        )
        assert count() == 0
    assert rewrites == [seen + 2] and m.version == seen + 2
    assert (m.rows_inserted, m.rows_deleted, m.files_added, m.files_removed) == (1, 2, 1, before)
    assert sorted((r["id"], r["v"]) for r in store.read(path).collect()) == [(1, "a"), (2, "b2")]
    commit = store.history(path, 1)[0]
    assert commit["operationParameters"]["predicate"] == "`id` IN (2, 3)"
    assert commit["operationMetrics"]["numAddedChangeFiles"] == 1
    assert len(spark.read.format("delta").load(path).inputFiles()) == 1  # the table is one file now


def _commit(path: str, version: int) -> list[dict]:
    with open(os.path.join(path, "_delta_log", f"{version:020d}.json"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_an_overwrite_of_rows_on_the_driver_rewrites_a_small_table_here_without_a_spark_job(
    store, spark, tmp_path, rewrites
):
    path = str(tmp_path / "t")
    seen = _table(store, spark, path)
    store.append(path, spark.createDataFrame([(2, "b"), (3, "c")], KV_DDL))
    before = len(spark.read.format("delta").load(path).inputFiles())
    jobs = SparkJobs(spark)
    with jobs.group("overwrite") as count:
        guarded = store.overwrite(
            path, _driver_rows(spark, [(7, "g")]), expected_version=seen + 1, note="run 3"
        )
        unguarded = store.overwrite(path, _driver_rows(spark, [(8, "u"), (9, None)]), note="rebuild")
        assert count() == 0
    assert rewrites == [seen + 2, seen + 3]
    assert (guarded.rows_inserted, guarded.rows_deleted, guarded.files_removed) == (1, 3, before)
    assert (unguarded.rows_inserted, unguarded.rows_deleted, unguarded.files_removed) == (2, 1, 1)
    assert _ids(store, path) == [8, 9]
    for version, note, guard in ((seen + 2, "run 3:", True), (seen + 3, "rebuild", False)):
        commit = store.history(path, 10)[seen + 3 - version]
        assert commit["operation"] == "WRITE" and commit["userMetadata"].startswith(note)
        assert commit["operationParameters"]["mode"] == "Overwrite"
        assert (
            "predicate" not in commit["operationParameters"] or not commit["operationParameters"]["predicate"]
        )
        assert any("txn" in a for a in _commit(path, version)) is guard  # a guard's identifier only


def test_an_overwrite_that_replaces_the_schema_or_of_a_lazy_frame_is_spark_s(
    store, spark, tmp_path, rewrites
):
    path = str(tmp_path / "t")
    _table(store, spark, path)
    store.overwrite(path, spark.createDataFrame([(2, "b")], KV_DDL))
    store.overwrite(path, _driver_rows(spark, [(3, "c")]), replace_schema=True)
    assert rewrites == [] and _ids(store, path) == [3]


def test_a_table_over_the_size_or_without_its_file_list_is_replaced_by_spark(
    store, spark, tmp_path, rewrites, monkeypatch
):
    path = str(tmp_path / "t")
    seen = _table(store, spark, path)
    keys = pa.table({"id": pa.array([1], pa.int64())})
    monkeypatch.setattr("cdc_join.storage.delta_spark.SMALL_REWRITE_BYTES", 100)
    store.replace_keys(path, _driver_rows(spark, [(1, "a2")]), ["id"], keys, expected_version=seen)
    monkeypatch.undo()
    os.remove(os.path.join(path, "_delta_log", f"{seen + 1:020d}.crc"))
    store.replace_keys(path, _driver_rows(spark, [(1, "a3")]), ["id"], keys, expected_version=seen + 1)
    assert rewrites == []
    assert [(r["id"], r["v"]) for r in store.read(path).collect()] == [(1, "a3")]
