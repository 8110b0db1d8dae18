"""Spark types of Debezium row images, and how a column's type may change over time.

A row image decodes into a struct whose column types come from the Kafka Connect schema of the
event (:func:`connect_type`) or, for payload-only events, from Spark's inference over the batch
(:func:`inferred_row_type`: integers → bigint, other numbers → double, mixed JSON types →
string, as Spark's JSON reader picks; a column holding only JSON nulls so far is ``void``, and
takes the type of its first value).

Types are stable across batches: the type a column already has in bronze (``known``) wins,
except that a column *widens* when new events need a wider type and Delta's type-widening rules
allow it (:func:`cdc_join.schemas.wider_type`): byte → short → int → bigint, float → double, byte/short/int →
double, an integer or decimal → a decimal with room for every digit, date → timestamp_ntz. A
change that cannot widen (bigint → string, bigint → double, a narrower decimal) keeps the known
type, and the values that do not fit it are quarantined with their reason.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    ByteType,
    DataType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    MapType,
    NullType,
    ShortType,
    StringType,
    StructField,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from cdc_join.schemas import MAX_PRECISION, merge_schemas

VARIABLE_SCALE_DECIMAL_TYPE = DecimalType(38, 10)  # io.debezium.data.VariableScaleDecimal


def merge_row_types(known: StructType, new: StructType) -> StructType:
    """``known`` with the columns of ``new`` it lacks appended, widened where ``new`` needs.

    See :func:`cdc_join.schemas.merge_schemas`: a column whose new type cannot widen keeps its
    known type, and the values that do not fit it are quarantined.
    """
    return merge_schemas(known, new)


# -- inference of payload-only events ---------------------------------------------------------

_TYPE_TOKEN = re.compile(r"\s*(`(?:[^`]|``)*`|[<>(),:]|[^\s<>(),:]+)")


def inferred_row_type(text: str | None) -> StructType:
    """The row type ``schema_of_variant_agg`` inferred (e.g. ``OBJECT<id: BIGINT>``)."""
    if not text:
        return StructType([])
    parsed, _ = _parse_variant_type(_TYPE_TOKEN.findall(text), 0)
    return parsed if isinstance(parsed, StructType) else StructType([])


def _parse_variant_type(tokens: list[str], i: int) -> tuple[DataType | None, int]:
    """Parse the type at ``tokens[i]``; ``None`` for a type no value has shown yet."""
    word = tokens[i].upper()
    if word == "OBJECT":
        fields, i = [], i + 2
        while tokens[i] != ">":
            name = tokens[i][1:-1].replace("``", "`") if tokens[i].startswith("`") else tokens[i]
            dtype, i = _parse_variant_type(tokens, i + 2)
            if dtype is not None:
                fields.append(StructField(name, dtype))
            i += 1 if tokens[i] == "," else 0
        return (StructType(fields) if fields else None), i + 1
    if word == "ARRAY":
        element, i = _parse_variant_type(tokens, i + 2)
        return (ArrayType(element) if element is not None else None), i + 1
    if word == "DECIMAL":
        precision, scale = int(tokens[i + 2]), int(tokens[i + 4])
        # An integer past bigint's range (MySQL BIGINT UNSIGNED, 2^63 and up, has 19 or 20
        # digits) stays an exact decimal, as Spark's JSON reader infers it; a double would drop
        # its last digits. Other decimals become doubles, as the JSON reader infers them. A
        # variant stores 2.0 as DECIMAL(1,0), so a batch mixing 3 and 2.0 (DECIMAL(20,0)) also
        # reads as decimal(38,0): its values fit exactly, and a later fraction is quarantined
        # by name rather than rounded.
        wide_integer = scale == 0 and precision >= 19
        return (DecimalType(MAX_PRECISION, 0) if wide_integer else DoubleType()), i + 6
    return _VARIANT_SCALARS.get(word, StringType()), i + 1


_VARIANT_SCALARS: dict[str, DataType | None] = {
    "BIGINT": LongType(),
    "DOUBLE": DoubleType(),
    "FLOAT": DoubleType(),
    "BOOLEAN": BooleanType(),
    "STRING": StringType(),
    "VARIANT": StringType(),  # values of several JSON types: kept as JSON text
    "VOID": NullType(),  # only JSON nulls so far: a void column, typed by its first value
}


def in_key_order(row: StructType, first_line: str | None) -> StructType:
    """Order inferred columns as the batch's first event lists them (inference sorts by name)."""
    try:
        doc = json.loads(first_line) if first_line else {}
    except ValueError:
        doc = {}
    payload = doc.get("payload", doc) if isinstance(doc, dict) and "op" not in doc else doc
    rank: dict[str, int] = {}
    for image in ("after", "before"):
        value = payload.get(image) if isinstance(payload, dict) else None
        for name in value if isinstance(value, dict) else ():
            rank.setdefault(name, len(rank))
    return StructType(sorted(row.fields, key=lambda f: (rank.get(f.name, len(rank)), f.name)))


# -- Kafka Connect schemas -------------------------------------------------------------------

_CONNECT_PRIMITIVES: dict[str, DataType] = {
    "int8": ByteType(),
    "int16": ShortType(),
    "int32": IntegerType(),
    "int64": LongType(),
    "float": FloatType(),
    "float32": FloatType(),
    "double": DoubleType(),
    "float64": DoubleType(),
    "boolean": BooleanType(),
    "string": StringType(),
    "bytes": BinaryType(),
}
DECIMAL = "org.apache.kafka.connect.data.Decimal"
VARIABLE_SCALE_DECIMAL = "io.debezium.data.VariableScaleDecimal"
DATES = frozenset({"org.apache.kafka.connect.data.Date", "io.debezium.time.Date"})
# Units per second. Timestamps of columns without a zone are wall-clock → timestamp_ntz.
TIMESTAMPS = {
    "org.apache.kafka.connect.data.Timestamp": 1_000,
    "io.debezium.time.Timestamp": 1_000,
    "io.debezium.time.MicroTimestamp": 1_000_000,
    "io.debezium.time.NanoTimestamp": 1_000_000_000,
}
# Units per second. Delta has no TIME type, so times of day become "HH:MM:SS[.fff]".
TIMES = {
    "org.apache.kafka.connect.data.Time": 1_000,
    "io.debezium.time.Time": 1_000,
    "io.debezium.time.MicroTime": 1_000_000,
    "io.debezium.time.NanoTime": 1_000_000_000,
}
ZONED_TIMESTAMP = "io.debezium.time.ZonedTimestamp"
MIN_MICROS, MAX_MICROS = -62_135_596_800_000_000, 253_402_300_799_999_999  # years 0001-9999
MIN_DAY, MAX_DAY = -719_162, 2_932_896


def connect_type(field: Mapping[str, Any]) -> DataType:
    """The Spark type a Kafka Connect field schema decodes to.

    Decimal → ``decimal(connect.decimal.precision or 38, scale)``, precision capped at 38;
    VariableScaleDecimal → ``decimal(38,10)`` (values rounded half-up to 10 places); Date →
    date; Timestamp, MicroTimestamp, NanoTimestamp → timestamp_ntz (wall clock; nanoseconds
    truncated to microseconds); ZonedTimestamp → timestamp (UTC instant); Time, MicroTime,
    NanoTime → string ``HH:MM:SS[.fff]``; maps with non-string keys → their JSON text; every
    other logical type (ZonedTime, Uuid, Json, Enum, Bits, Year, geometry, …) → its base type.
    """
    kind = field.get("type")
    logical = _logical_type(field)
    if logical is not None:
        return logical
    if kind == "struct":
        return StructType([StructField(f["field"], connect_type(f)) for f in field.get("fields", [])])
    if kind == "array":
        return ArrayType(connect_type(field["items"]))
    if kind == "map" and field.get("keys", {}).get("type") == "string":
        return MapType(StringType(), connect_type(field["values"]))
    return _CONNECT_PRIMITIVES.get(str(kind), StringType())


def _logical_type(field: Mapping[str, Any]) -> DataType | None:
    name = field.get("name")
    if name == DECIMAL:
        params = field.get("parameters") or {}
        scale = min(int(params.get("scale", 0)), MAX_PRECISION)
        precision = min(int(params.get("connect.decimal.precision", MAX_PRECISION)), MAX_PRECISION)
        return DecimalType(max(precision, scale), scale)
    if name == VARIABLE_SCALE_DECIMAL:
        return VARIABLE_SCALE_DECIMAL_TYPE
    if name in DATES:
        return DateType()
    if name in TIMESTAMPS:
        return TimestampNTZType()
    if name in TIMES:
        return StringType()
    if name == ZONED_TIMESTAMP:
        return TimestampType()
    return None
