"""How the Delta (Spark) backend stores a void under an array or a map, and reads it back."""

from __future__ import annotations

from pyspark.sql.types import (
    ArrayType,
    DateType,
    IntegerType,
    MapType,
    NullType,
    StringType,
    StructField,
    StructType,
)

from cdc_join.storage.untyped import MARK, has_untyped, logical_schema, stored_schema

ELEMENT = StructType([StructField("x", NullType()), StructField("y", IntegerType())])
LOGICAL = StructType(
    [
        StructField("v", NullType()),  # outside arrays and maps: Delta keeps it, stays void
        StructField("ar", ArrayType(NullType())),
        StructField("nested", ArrayType(ArrayType(NullType()))),
        StructField("m", MapType(StringType(), NullType())),
        StructField(
            "s", StructType([StructField("in", ArrayType(NullType())), StructField("w", NullType())])
        ),
        StructField("xs", ArrayType(ELEMENT)),
        StructField("typed", ArrayType(IntegerType())),
    ]
)


def _void_under_a_collection(dtype, under=False) -> bool:
    if isinstance(dtype, NullType):
        return under
    if isinstance(dtype, ArrayType):
        return _void_under_a_collection(dtype.elementType, True)
    if isinstance(dtype, MapType):
        return _void_under_a_collection(dtype.valueType, True)
    if isinstance(dtype, StructType):
        return any(_void_under_a_collection(f.dataType, under) for f in dtype.fields)
    return False


def test_a_void_under_an_array_or_a_map_is_stored_as_a_commented_string():
    stored = stored_schema(LOGICAL)
    assert not _void_under_a_collection(stored)
    assert {f.name: f.metadata.get("comment") for f in stored.fields} == {
        "v": None,
        "ar": f"{MARK} element",
        "nested": f"{MARK} element.element",
        "m": f"{MARK} value",
        "s": None,
        "xs": None,
        "typed": None,
    }
    assert stored["s"].dataType["in"].metadata["comment"] == f"{MARK} element"
    assert stored["s"].dataType["w"].dataType == NullType()
    assert stored["xs"].dataType.elementType["x"].metadata["comment"] == MARK
    assert stored["xs"].dataType.elementType["x"].dataType == StringType()
    assert has_untyped(LOGICAL) and not has_untyped(StructType([LOGICAL["typed"], LOGICAL["v"]]))


def test_a_stored_schema_reads_back_as_it_was_written():
    assert logical_schema(stored_schema(LOGICAL)) == LOGICAL


def test_a_comment_left_behind_by_a_type_that_arrived_since_keeps_the_type():
    stale = StructType(
        [
            StructField("ar", ArrayType(IntegerType()), metadata={"comment": f"{MARK} element"}),
            StructField("d", ArrayType(DateType()), metadata={"comment": f"{MARK} value"}),
        ]
    )
    assert logical_schema(stale) == StructType(
        [StructField("ar", ArrayType(IntegerType())), StructField("d", ArrayType(DateType()))]
    )


def test_a_struct_holding_only_voids_stores_them_as_commented_strings():
    # Parquet has no empty group: Delta on Spark refuses a struct whose fields are all void
    # (DELTA_CANNOT_WRITE_EMPTY_SCHEMA), nested or not; a struct with one typed leaf keeps its voids.
    only_voids = StructType(
        [StructField("a", NullType()), StructField("b", StructType([StructField("c", NullType())]))]
    )
    logical = StructType(
        [
            StructField("st", only_voids),
            StructField("image", StructType([StructField("k", StringType()), StructField("st", only_voids)])),
            StructField("mixed", StructType([StructField("a", NullType()), StructField("n", IntegerType())])),
        ]
    )
    stored = stored_schema(logical)
    for st in (stored["st"].dataType, stored["image"].dataType["st"].dataType):
        assert st["a"].dataType == StringType() and st["a"].metadata["comment"] == MARK
        assert (
            st["b"].dataType["c"].dataType == StringType()
            and st["b"].dataType["c"].metadata["comment"] == MARK
        )
    assert stored["mixed"].dataType["a"].dataType == NullType()
    assert has_untyped(logical) and logical_schema(stored) == logical
