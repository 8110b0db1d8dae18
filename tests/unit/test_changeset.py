"""Change sets: Spark rows collected to Arrow and back."""

from __future__ import annotations

from datetime import date, datetime, timezone
from decimal import Decimal

import pyarrow as pa
from pyspark.sql.types import LongType, StringType, StructField, StructType

from cdc_join.changeset import ChangeSet, cast_table, found_in, materialize, materialize_all, spark_frame


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


def test_a_frame_over_arrow_chunks_keeps_the_rows_after_an_empty_chunk(spark):
    """A keyed read that skips row groups returns empty chunks between full ones; PySpark
    passes one record batch per chunk, and lost every row after the first empty one."""
    schema = pa.schema([("k", pa.int64()), ("v", pa.string())])
    chunks = [
        pa.record_batch([pa.array([1, 2]), pa.array(["a", None])], schema=schema),
        pa.record_batch([pa.array([], pa.int64()), pa.array([], pa.string())], schema=schema),
        pa.record_batch([pa.array([3]), pa.array(["c"])], schema=schema),
        pa.record_batch([pa.array([], pa.int64()), pa.array([], pa.string())], schema=schema),
        pa.record_batch([pa.array([4, 5]), pa.array(["d", "e"])], schema=schema),
    ]
    table = pa.Table.from_batches(chunks, schema)
    frame = ChangeSet(
        spark, StructType([StructField("k", LongType()), StructField("v", StringType())]), table
    ).frame
    assert sorted(r["k"] for r in frame.collect()) == [1, 2, 3, 4, 5]
    assert spark_frame(spark, table.slice(0, 0), frame.schema).collect() == []


def test_lists_of_nulls_survive_casts_and_the_trip_to_spark(spark):
    """pyarrow 26 casts ``list<null>`` to ``list<null>`` into an invalid array (offsets past
    its values); an array column that held only ``[null, null]`` so far failed its batch's
    ingest. Casts and frames over Arrow rebuild such columns instead."""
    nulls = pa.list_(pa.null())
    row = pa.struct([("s", pa.string()), ("ar", nulls), ("m", pa.map_(pa.string(), pa.null()))])
    values = [
        {"s": "a", "ar": [None, None], "m": [("k", None)]},
        None,
        {"s": "c", "ar": [None], "m": None},
        {"s": "d", "ar": None, "m": []},
    ]
    table = pa.table({"r": pa.array(values, row), "l": pa.array([[None], [None, None], None, []], nulls)})
    for rows in (table, table.slice(1), pa.Table.from_batches(table.to_batches(max_chunksize=2))):
        cast = cast_table(rows, table.schema)
        for column in cast.columns:
            column.validate(full=True)
        assert cast.to_pylist() == rows.to_pylist()
    schema = StructType(
        [
            StructField(
                "r",
                spark.createDataFrame([], "r struct<s:string,ar:array<void>,m:map<string,void>>")
                .schema["r"]
                .dataType,
            ),
            StructField("l", spark.createDataFrame([], "l array<void>").schema["l"].dataType),
        ]
    )
    back = materialize(ChangeSet(spark, schema, table).frame).table
    assert back.column("r").to_pylist() == [
        {"s": "a", "ar": [None, None], "m": [("k", None)]},
        None,
        {"s": "c", "ar": [None], "m": None},
        {"s": "d", "ar": None, "m": []},
    ]
    assert back.column("l").to_pylist() == [[None], [None, None], None, []]


def test_a_frame_over_lists_of_nulls_whose_nullability_spark_changes(spark):
    """createDataFrame casts the table to Spark's Arrow types; a struct field Spark declares
    nullable where the table does not made that a real cast of ``list<null>``, which failed."""
    row = pa.struct([pa.field("s", pa.string(), nullable=False), ("ar", pa.list_(pa.null()))])
    table = pa.table({"r": pa.array([{"s": "a", "ar": [None, None]}, {"s": "b", "ar": [None]}], row)})
    schema = spark.createDataFrame([], "r struct<s:string,ar:array<void>>").schema
    back = materialize(ChangeSet(spark, schema, table).frame).table
    assert back.column("r").to_pylist() == [{"s": "a", "ar": [None, None]}, {"s": "b", "ar": [None]}]


def test_several_frames_collected_in_one_job_keep_their_rows_names_and_types(spark):
    """Names that need quoting and types whose SQL spelling is easy to get wrong survive
    :func:`materialize_all`, each frame's rows exactly as :func:`materialize` gives them."""
    first = spark.sql(
        "SELECT * FROM VALUES "
        "(1, 'a', 1.50BD, TIMESTAMP_NTZ'2024-01-02 03:04:05.123456', DATE'2024-01-02', X'00FF', "
        "map('k', named_struct('x', 1)), named_struct('in`ner', array(1, null))), "
        "(2, NULL, NULL, NULL, NULL, NULL, NULL, named_struct('in`ner', CAST(NULL AS ARRAY<INT>))) "
        "AS t(`id`, `odd name`, `dotted.name`, ts_ntz, d, bin, m, `st``ruct`)"
    ).selectExpr("*", "CASE WHEN id = 1 THEN TIMESTAMP_LTZ'2024-01-02 03:04:05Z' END AS ts_ltz")
    second = spark.sql("SELECT 7L AS id, 'only' AS `odd name`")
    both = materialize_all([first, second])
    for frame, got in zip([first, second], both, strict=True):
        want = materialize(frame)
        assert got.schema == frame.schema
        assert got.table.sort_by("id").to_pylist() == want.table.sort_by("id").to_pylist()
    row = both[0].table.sort_by("id").to_pylist()[0]
    assert row["dotted.name"] == Decimal("1.50") and row["bin"] == b"\x00\xff"
    assert row["ts_ntz"] == datetime(2024, 1, 2, 3, 4, 5, 123456) and row["d"] == date(2024, 1, 2)
    assert row["ts_ltz"] == datetime(2024, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    assert row["st`ruct"] == {"in`ner": [1, None]} and row["m"] == [("k", {"x": 1})]


def test_found_in_marks_rows_whose_columns_match_a_key_row_and_a_null_part_matches_nothing():
    rows = pa.table({"a": [1, 1, 2, None, 3], "b": ["x", "y", "x", "x", None], "v": [10, 11, 12, 13, 14]})
    keys = pa.table({"a": pa.array([1, 2, None, 3], pa.int32()), "b": ["x", "x", "x", None]})
    assert found_in(rows, keys, ["a", "b"]).to_pylist() == [True, False, True, False, False]
    assert found_in(rows, keys.slice(0, 0), ["a", "b"]).to_pylist() == [False] * 5
