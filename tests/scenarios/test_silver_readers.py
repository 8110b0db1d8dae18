"""Silver written by the delta-spark backend, with deletion vectors, read by the tools users read
it with: Spark, delta-rs (its QueryBuilder; its pyarrow dataset refuses deletion vectors),
Polars, and DuckDB's Delta extension. Each must see exactly the rows Spark sees.
"""

from __future__ import annotations

import os

import pytest

from cdc_join.storage import get_storage
from tests.support import make_pipeline

COLUMNS = ["key", "fk", "v", "value"]


@pytest.fixture(scope="module")
def silver_with_deletion_vectors(tmp_path_factory, spark):
    """A silver table whose one file has rows updated and deleted through deletion vectors."""
    root = tmp_path_factory.mktemp("readers")
    pipeline, w = make_pipeline(root, spark, get_storage(spark, "delta-spark"), join_type="left")
    w.write("rhs", [w.upsert("rhs", {"id": i, "value": f"r{i}"}, i) for i in (1, 2)])
    w.write("lhs", [w.upsert("lhs", {"id": f"k{n}", "fk": 1 + n % 2, "v": n}, 10 + n) for n in range(8)])
    pipeline.run()
    path = pipeline.config.silver_path
    pipeline.storage.optimize(path)  # one file of eight rows
    w.write("lhs", [w.upsert("lhs", {"id": "k1", "fk": 2, "v": 100}, 30)])
    w.write("lhs", [w.delete("lhs", {"id": "k2", "fk": 1, "v": 2}, 31)])
    with pytest.MonkeyPatch.context() as patch:  # written as a silver over 4 MB is: not on the driver
        patch.setattr("cdc_join.storage.delta_spark.SMALL_REWRITE_BYTES", 0)
        pipeline.run()
    (replaced,) = pipeline.storage.history(path, 1)
    assert replaced["operation"] == "WRITE"  # silver's keyed replace (cdc_join.silver.table)
    assert sum(f.deleted_rows for f in pipeline.storage.files(path)) == 2  # k1's old row and k2
    expected = sorted(tuple(r) for r in pipeline.storage.read(path).select(*COLUMNS).collect())
    assert len(expected) == 7 and ("k1", 2, 100, "r2") in expected
    return path, expected


def _sorted(rows) -> list[tuple]:
    return sorted(tuple(r) for r in rows)


def test_delta_rs_query_builder_reads_silver_with_deletion_vectors(silver_with_deletion_vectors):
    from deltalake import DeltaTable, QueryBuilder

    path, expected = silver_with_deletion_vectors
    import pyarrow as pa

    query = QueryBuilder().register("silver", DeltaTable(path))
    table = pa.table(query.execute(f"SELECT {', '.join(COLUMNS)} FROM silver").read_all())
    assert _sorted(zip(*table.to_pydict().values(), strict=True)) == expected


def test_delta_rs_pyarrow_dataset_refuses_deletion_vectors(silver_with_deletion_vectors):
    from deltalake import DeltaTable

    path, _ = silver_with_deletion_vectors
    with pytest.raises(Exception, match="deletionVectors"):
        DeltaTable(path).to_pyarrow_dataset()


def test_polars_reads_silver_with_deletion_vectors(silver_with_deletion_vectors):
    import polars

    path, expected = silver_with_deletion_vectors
    frame = polars.read_delta(path).select(COLUMNS)
    assert _sorted(frame.iter_rows()) == expected


def test_duckdb_delta_extension_reads_silver_with_deletion_vectors(silver_with_deletion_vectors):
    import duckdb
    import duckdb_extension_delta as extension

    path, expected = silver_with_deletion_vectors
    folder = os.path.join(os.path.dirname(extension.__file__), "extensions", f"v{duckdb.__version__}")
    connection = duckdb.connect()
    connection.sql(f"LOAD '{os.path.join(folder, 'delta.duckdb_extension')}'")
    found = connection.sql(f"SELECT {', '.join(COLUMNS)} FROM delta_scan('{path}')").fetchall()
    assert _sorted(found) == expected
