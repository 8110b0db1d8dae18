"""Rows made to fit a grown schema: columns reordered, added, widened, nested fields by name."""

from __future__ import annotations

from decimal import Decimal

from pyspark.sql.types import (
    ArrayType,
    DecimalType,
    DoubleType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
)

from cdc_join.schemas import conform

INNER = StructType([StructField("b", IntegerType()), StructField("a", StringType())])
BEFORE = StructType(
    [
        StructField("id", IntegerType(), False),
        StructField("odd name`.x", StringType()),
        StructField("s", INNER),
        StructField("items", ArrayType(INNER)),
        StructField("by", MapType(StringType(), INNER)),
        StructField("amount", DecimalType(10, 2)),
    ]
)
# Columns in another order, a column added, types widened, a nested field added in each of a
# struct, an array of structs and a map of structs (their fields reordered, too).
WIDER = StructType(
    [StructField("a", StringType()), StructField("c", DoubleType()), StructField("b", LongType())]
)
AFTER = StructType(
    [
        StructField("added", StringType()),
        StructField("id", LongType(), False),
        StructField("s", WIDER),
        StructField("items", ArrayType(WIDER)),
        StructField("by", MapType(StringType(), WIDER)),
        StructField("amount", DecimalType(12, 2)),
        StructField("odd name`.x", StringType()),
    ]
)


def test_rows_take_the_target_shape_with_nested_fields_matched_by_name(spark):
    rows = spark.createDataFrame(
        [
            (1, "x", (7, "s"), [(8, "i"), None], {"k": (9, "m"), "n": None}, Decimal("1.25")),
            (2, None, None, None, None, None),
        ],
        BEFORE,
    )
    got = sorted(conform(rows, AFTER).collect(), key=lambda r: r["id"])
    assert conform(rows, AFTER).columns == AFTER.names
    assert [f.dataType for f in conform(rows, AFTER).schema.fields] == [f.dataType for f in AFTER.fields]
    first, second = (r.asDict(recursive=True) for r in got)
    assert first == {
        "added": None,
        "id": 1,
        "s": {"a": "s", "c": None, "b": 7},
        "items": [{"a": "i", "c": None, "b": 8}, None],
        "by": {"k": {"a": "m", "c": None, "b": 9}, "n": None},
        "amount": Decimal("1.25"),
        "odd name`.x": "x",
    }
    # A null struct stays null: it does not become a struct of nulls.
    assert second == {
        "added": None,
        "id": 2,
        "s": None,
        "items": None,
        "by": None,
        "amount": None,
        "odd name`.x": None,
    }


def test_rows_of_the_target_shape_are_returned_as_they_are(spark):
    rows = spark.createDataFrame([(1, "x", None, None, None, None)], BEFORE)
    assert conform(rows, BEFORE) is rows
