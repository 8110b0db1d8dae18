"""The left-value hash: Spark built-ins and Python xxhash agree; nulls are position-aware."""

from __future__ import annotations

from datetime import datetime

import xxhash
from pyspark.sql import Row
from pyspark.sql.types import LongType, StringType, StructField, StructType

from cdc_join.join.hashing import encoding, python_encoding, python_row_hash, row_hash, values_hash

SCHEMA = StructType(
    [StructField("a", StringType()), StructField("b", StringType()), StructField("n", LongType())]
)


def _spark_hashes(spark, rows):
    df = spark.createDataFrame(rows, SCHEMA)
    out = df.select(row_hash(SCHEMA.fields).alias("h"), encoding(SCHEMA.fields).alias("e")).collect()
    return [(r.h, bytes(r.e)) for r in out]


def test_spark_hash_equals_python_xxhash_on_the_same_encoding(spark):
    rows = [Row(a="x", b="héllo", n=42), Row(a=None, b="", n=-7), Row(a="", b=None, n=None)]
    for row, (spark_hash, spark_bytes) in zip(rows, _spark_hashes(spark, rows), strict=True):
        as_text = {k: (None if v is None else str(v)) for k, v in row.asDict().items()}
        assert spark_bytes == python_encoding(as_text)
        assert spark_hash == python_row_hash(as_text)
        unsigned = xxhash.xxh64_intdigest(spark_bytes, seed=42)
        assert spark_hash == (unsigned - (1 << 64) if unsigned >= 1 << 63 else unsigned)


def test_moving_a_null_between_columns_changes_the_hash(spark):
    (h1, _), (h2, _) = _spark_hashes(spark, [Row(a=None, b="x", n=1), Row(a="x", b=None, n=1)])
    assert h1 != h2


def test_empty_string_and_null_hash_differently(spark):
    (h1, _), (h2, _) = _spark_hashes(spark, [Row(a="", b="x", n=1), Row(a=None, b="x", n=1)])
    assert h1 != h2


def test_value_boundaries_are_unambiguous():
    # "ab" + "c" must not collide with "a" + "bc": lengths are part of the encoding.
    assert python_encoding({"a": "ab", "b": "c"}) != python_encoding({"a": "a", "b": "bc"})


def test_a_column_that_is_null_everywhere_does_not_change_existing_hashes():
    assert python_row_hash({"a": "x"}) == python_row_hash({"a": "x", "added_later": None})


VALUES = (
    "k string, n long, s string, ev struct<t: timestamp, note: string>, tags map<string, timestamp>, "
    "xs array<double>"
)


def test_silver_values_hash_tells_every_changed_value_from_a_row_sent_again(spark):
    """``_values_hash``, which the silver MERGE compares instead of every column: equal values
    hash alike; a changed value, a NULL, a NULL inside a nested value and a nested timestamp
    moved by a microsecond each change the hash."""
    t0, t1 = datetime(2026, 1, 2, 3, 4, 5, 123456), datetime(2026, 1, 2, 3, 4, 5, 123457)
    base = ("base", 1, "x", {"t": t0, "note": "a"}, {"m": t0}, [1.0, 2.0])
    variants = [
        ("same", 1, "x", {"t": t0, "note": "a"}, {"m": t0}, [1.0, 2.0]),
        ("number", 2, "x", {"t": t0, "note": "a"}, {"m": t0}, [1.0, 2.0]),
        ("null", None, "x", {"t": t0, "note": "a"}, {"m": t0}, [1.0, 2.0]),
        ("nested-null", 1, "x", {"t": t0, "note": None}, {"m": t0}, [1.0, 2.0]),
        ("struct-micro", 1, "x", {"t": t1, "note": "a"}, {"m": t0}, [1.0, 2.0]),
        ("map-micro", 1, "x", {"t": t0, "note": "a"}, {"m": t1}, [1.0, 2.0]),
        ("array", 1, "x", {"t": t0, "note": "a"}, {"m": t0}, [1.0, 2.5]),
        ("all-null", None, None, None, None, None),
    ]
    df = spark.createDataFrame([base, *variants], VALUES)
    columns = ["n", "s", "ev", "tags", "xs"]
    types = {f.name: f.dataType for f in df.schema.fields}
    hashes = {r["k"]: r["h"] for r in df.select("k", values_hash(columns, types).alias("h")).collect()}
    assert hashes["same"] == hashes["base"]
    changed = [k for k in hashes if k not in ("base", "same")]
    assert len({hashes[k] for k in changed} | {hashes["base"]}) == len(changed) + 1
