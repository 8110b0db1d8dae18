"""A lake written by one storage backend, run by the other.

delta-rs writes tables delta-spark reads and writes, so a lake can move to delta-spark (to
Databricks) at any point. delta-spark creates its tables with deletion vectors enabled, and its
MERGEs leave them in silver. delta-rs's MERGE applies them, but its reads of a table's files
cannot: a read of such a table (verify, a recompute) is refused with an error naming deletion
vectors and the backend to use.
"""

from __future__ import annotations

import pytest

from cdc_join.errors import StorageError
from cdc_join.run.pipeline import Pipeline
from cdc_join.storage import get_storage
from tests.support import make_pipeline, silver_rows


def _on(pipeline: Pipeline, backend: str) -> Pipeline:
    return Pipeline(pipeline.config, pipeline.spark, get_storage(pipeline.spark, backend))


def test_a_lake_written_by_delta_rs_goes_on_with_delta_spark(tmp_path, spark):
    first, w = make_pipeline(tmp_path, spark, get_storage(spark, "delta-rs"), join_type="left")
    w.write("rhs", [w.upsert("rhs", {"id": i, "value": f"r{i}"}, i) for i in (1, 2)])
    w.write("lhs", [w.upsert("lhs", {"id": k, "fk": 1, "v": n}, 10 + n) for n, k in enumerate("ab")])
    first.run()
    then = _on(first, "delta-spark")
    w.write("lhs", [w.upsert("lhs", {"id": "a", "fk": 2, "v": 5}, 20)])
    w.write("rhs", [w.upsert("rhs", {"id": 1, "value": "r1*"}, 21)])
    then.run()
    assert silver_rows(then) == {("a", 2, 5, "r2"), ("b", 1, 1, "r1*")}
    assert then.verify().ok
    then.full_refresh()
    assert silver_rows(then) == {("a", 2, 5, "r2"), ("b", 1, 1, "r1*")}


def test_delta_rs_refuses_to_read_a_table_with_deletion_vectors_naming_them(tmp_path, spark, monkeypatch):
    # Silver as one over 4 MB is written (a smaller one is rewritten on the driver, without vectors).
    monkeypatch.setattr("cdc_join.storage.delta_spark.SMALL_REWRITE_BYTES", 0)
    first, w = make_pipeline(tmp_path, spark, get_storage(spark, "delta-spark"), join_type="left")
    w.write("rhs", [w.upsert("rhs", {"id": 1, "value": "r1"}, 1)])
    w.write("lhs", [w.upsert("lhs", {"id": k, "fk": 1, "v": 0}, 2 + n) for n, k in enumerate("abcd")])
    first.run()
    silver = first.config.silver_path
    first.storage.optimize(silver)  # one file of four rows
    # An update of one row of that file: delta-spark marks the old row deleted in a deletion
    # vector instead of rewriting the file.
    w.write("lhs", [w.upsert("lhs", {"id": "a", "fk": 1, "v": 1}, 10)])
    first.run()
    (replaced,) = first.storage.history(silver, 1)
    assert replaced["operation"] == "WRITE" and int(replaced["operationMetrics"]["numDeletedRows"]) == 1
    assert sum(f.deleted_rows for f in first.storage.files(silver)) == 1
    # delta-rs reads files without applying deletion vectors: it refuses to read silver ...
    back = _on(first, "delta-rs")
    with pytest.raises(StorageError) as refused:
        back.verify()
    assert "deletion vectors" in str(refused.value) and "delta-spark" in str(refused.value)
    # ... while its MERGE applies them (and rewrites the file without one), so runs go on right.
    w.write("lhs", [w.upsert("lhs", {"id": "b", "fk": 1, "v": 2}, 11)])
    back.run()
    want = {("a", 1, 1, "r1"), ("b", 1, 2, "r1"), ("c", 1, 0, "r1"), ("d", 1, 0, "r1")}
    assert silver_rows(first) == want
    assert first.verify().ok


def test_an_array_without_an_element_type_yet_moves_to_delta_spark(tmp_path, spark):
    # delta-rs writes array<void> as it is; Delta on Spark cannot write into such a column
    # until the table stores it its own way (cdc_join.storage.untyped).
    tables = {
        "lhs": {"id": "string", "fk": "int64", "v": "int32", "ar": "array<int32>"},
        "rhs": {"id": "int64", "value": "string"},
    }
    select = {"key": "lhs.id", "fk": "lhs.fk", "v": "lhs.v", "ar": "lhs.ar", "value": "rhs.value"}
    first, w = make_pipeline(
        tmp_path, spark, get_storage(spark, "delta-rs"), tables=tables, join_type="left", select=select
    )
    w.payload_only = {"lhs"}
    w.write("rhs", [w.upsert("rhs", {"id": 1, "value": "one"}, 1)])
    w.write("lhs", [w.upsert("lhs", {"id": "k", "fk": 1, "v": None, "ar": []}, 2, op="c")])
    first.run()
    then = _on(first, "delta-spark")
    w.write("lhs", [w.upsert("lhs", {"id": "m", "fk": 1, "v": 5, "ar": [None]}, 3)])
    then.run()
    silver = then.storage.read(then.config.silver_path).select("key", "v", "ar").collect()
    assert sorted((key, v, ar) for key, v, ar in silver) == [("k", None, []), ("m", 5, [None])]
    assert then.storage.schema(then.config.silver_path)["ar"].dataType.simpleString() == "array<void>"
    assert then.verify().ok
