"""Change sets: Spark rows collected to Arrow and back."""

from __future__ import annotations

import pyarrow as pa

from cdc_join.changeset import materialize, materialize_all


def test_nested_void_columns_survive_collection(spark):
    """``array<void>`` holding ``[null]`` (a column whose arrays held only nulls so far) makes
    Spark's own ``toArrow()`` fail validation; the rows must come back intact."""
    df = spark.sql(
        "SELECT * FROM VALUES "
        "(1, array(null, null), named_struct('x', 1L, 'y', null)), "
        "(2, array(), null), "
        "(3, CAST(NULL AS ARRAY<VOID>), named_struct('x', null, 'y', null)) AS t(id, ar, st)"
    )
    assert str(df.schema["ar"].dataType) == "ArrayType(NullType(), True)"
    table = materialize(df).table.sort_by("id")
    assert table.column("ar").to_pylist() == [[None, None], [], None]
    assert table.column("st").to_pylist() == [{"x": 1, "y": None}, None, {"x": None, "y": None}]
    assert table.schema.field("ar").type == pa.list_(pa.null())
    both = materialize_all([df, df.select("id")])
    assert both[0].table.sort_by("id").column("ar").to_pylist() == [[None, None], [], None]
    assert materialize(both[0].frame).table.sort_by("id").column("ar").to_pylist() == [[None, None], [], None]
