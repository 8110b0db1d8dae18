"""Row images → typed values, with SQL built from Spark built-ins (no Python UDF).

Each event's ``before``/``after`` object is decoded column by column into the batch's row type
(see :mod:`cdc_join.landing.debezium.types`), by the rule of its schema group:

- a Kafka Connect schema decodes by its types and logical types (:func:`decode_connect_sql`):
  base64 or NUMERIC decimals exact to 38 digits, epoch days/millis/micros/nanos, times of day;
- payload-only JSON decodes strictly by JSON kind (:func:`decode_json_sql`): a string never
  becomes a number, a fraction never an integer, a decimal column takes a number only when no
  digit is lost; an integer in a date column is days since 1970 (Debezium's date encoding);
  any value fits a string column (non-strings as their JSON text).

A JSON ``null`` (and a missing field) decodes to SQL NULL in every type, never to the text
``"null"``. A value that does not survive decoding — it does not fit the column, or its schema
type changed in a way that cannot widen — makes :func:`fits_sql` false and the line is
quarantined with a reason naming the column, the value and the types.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pyspark.sql import DataFrame
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
)

import cdc_join.landing.debezium.types as T
from cdc_join.landing.debezium.sql import (
    Names,
    absent,
    as_type,
    ddl,
    get,
    ident,
    is_number_kind,
    is_object,
    json_text,
    key,
    kind,
    lit,
)
from cdc_join.schemas import widens_to

#: How Kafka's JsonConverter spells the doubles JSON has no number for.
NON_FINITE = ("NaN", "Infinity", "-Infinity")


@dataclass(frozen=True)
class SchemaGroup:
    """The events of one Kafka Connect schema; ``sid`` None for the events without a schema."""

    sid: str | None
    schema: Mapping[str, Any] | None
    inferred: StructType | None


# -- Kafka Connect schemas -------------------------------------------------------------------


def decode_connect_sql(x: str, field: Mapping[str, Any], target: DataType, names: Names) -> str:
    """SQL decoding the variant ``x`` of a Connect field into ``target`` (NULL if it cannot)."""
    natural = T.connect_type(field)
    if isinstance(natural, StructType) and isinstance(target, StructType):
        subfields = {f["field"]: f for f in field.get("fields", [])}
        return _struct_sql(x, target, lambda v, f: _connect_sub(v, subfields.get(f.name), f.dataType, names))
    if isinstance(natural, ArrayType) and isinstance(target, ArrayType):
        e = names("e")
        body = decode_connect_sql(e, field["items"], target.elementType, names)
        return f"transform({as_type(x, 'array<variant>')}, {e} -> {body})"
    if isinstance(natural, MapType) and isinstance(target, MapType):
        k, v = names("k"), names("v")
        body = decode_connect_sql(v, field["values"], target.valueType, names)
        return f"transform_values({as_type(x, 'map<string,variant>')}, ({k}, {v}) -> {body})"
    if isinstance(natural, (StructType, ArrayType, MapType)):
        value = decode_connect_sql(x, field, natural, names)
    else:
        value = _connect_scalar_sql(x, field, natural)
    if natural == target:
        return value
    if isinstance(target, StringType) and (
        field.get("name") == T.ZONED_TIMESTAMP or isinstance(natural, BinaryType)
    ):
        # A text column (payload-only events typed it): the JSON text those events stored, the
        # zoned timestamp with its offset and bytes in base64, not Spark's CAST text of them.
        return _text_sql(x)
    if isinstance(target, StringType) or widens_to(natural, target):
        return f"try_cast({value} AS {ddl(target)})"
    # The schema's type changed in a way that cannot widen: nothing decodes, so the line is
    # quarantined (fits_sql) instead of casting, which would truncate or mangle the value.
    return f"CAST(NULL AS {ddl(target)})"


def _connect_sub(v: str, field: Mapping[str, Any] | None, target: DataType, names: Names) -> str:
    return (
        decode_connect_sql(v, field, target, names) if field is not None else f"CAST(NULL AS {ddl(target)})"
    )


def _connect_scalar_sql(x: str, field: Mapping[str, Any], natural: DataType) -> str:
    name = field.get("name")
    if name == T.DECIMAL:
        return _decimal_sql(x, natural)
    if name == T.VARIABLE_SCALE_DECIMAL:
        unscaled = _unscaled_sql(f"try_variant_get({x}, '$.value', 'string')")
        return _scaled_sql(unscaled, f"try_variant_get({x}, '$.scale', 'int')", natural)
    if name in T.DATES:
        return _epoch_date_sql(as_type(x, "int"))
    if name in T.TIMESTAMPS:
        return _epoch_timestamp_sql(as_type(x, "bigint"), T.TIMESTAMPS[name])
    if name in T.TIMES:
        return _time_of_day_sql(as_type(x, "bigint"), T.TIMES[name])
    if name == T.ZONED_TIMESTAMP:
        return f"try_cast({as_type(x, 'string')} AS TIMESTAMP)"
    if isinstance(natural, BinaryType):
        return f"try_to_binary({as_type(x, 'string')}, 'base64')"
    if isinstance(natural, StringType):
        return _text_sql(x)
    return as_type(x, natural.simpleString())


def _text_sql(x: str) -> str:
    """A JSON value as text: a string as itself, NULL for a JSON null, anything else as JSON."""
    text = as_type(x, "string")
    return f"CASE WHEN {absent(x)} THEN NULL WHEN {kind(x)} = 'STRING' THEN {text} ELSE to_json({x}) END"


def _struct_sql(x: str, target: StructType, decode: Any) -> str:
    """A struct of ``target``'s fields decoded from the JSON object ``x``; NULL if not an object."""
    if not target.fields:
        return f"CAST(NULL AS {ddl(target)})"
    args = ", ".join(f"{lit(f.name)}, {decode(get(x, key(f.name)), f)}" for f in target.fields)
    return f"CASE WHEN {is_object(x)} THEN named_struct({args}) END"


# -- logical types with built-in expressions only --------------------------------------------


def _decimal_sql(x: str, dtype: DataType) -> str:
    """Base64 two's-complement unscaled bytes, or a JSON number (``decimal.format=NUMERIC``).

    The variant holds a JSON number's exact digits, so the number path never touches float64.
    """
    assert isinstance(dtype, DecimalType)
    from_bytes = _scaled_sql(_unscaled_sql(as_type(x, "string")), str(dtype.scale), dtype)
    return f"CASE WHEN {kind(x)} = 'STRING' THEN {from_bytes} ELSE {as_type(x, dtype.simpleString())} END"


def _unscaled_sql(base64: str) -> str:
    """The signed big-endian integer in base64 bytes, as decimal(38,0); NULL past 38 digits.

    Bytes (``conv`` of each byte's hex) fold most significant first: acc * 256 + byte. The
    first byte's top bit marks a negative number, whose inverted bytes fold to ~x; then
    x = -1 - ~x, one subtraction (Spark's unary minus rounds 38-digit decimals to 34 digits).
    """
    raw = f"try_to_binary({base64}, 'base64')"
    octet = f"CAST(conv(hex(substr({raw}, i, 1)), 16, 10) AS INT)"
    octets = f"transform(sequence(1, octet_length({raw})), i -> {octet})"
    start = "named_struct('negative', CAST(NULL AS BOOLEAN), 'folded', CAST(0 AS DECIMAL(38,0)))"
    negative = "coalesce(s.negative, o >= 128)"
    folded = f"try_add(try_multiply(s.folded, 256), CASE WHEN {negative} THEN 255 - o ELSE o END)"
    step = f"(s, o) -> named_struct('negative', {negative}, 'folded', CAST({folded} AS DECIMAL(38,0)))"
    finish = (
        "s -> CASE WHEN s.negative THEN try_subtract(CAST(-1 AS DECIMAL(38,0)), s.folded) ELSE s.folded END"
    )
    return f"CASE WHEN octet_length({raw}) > 0 THEN aggregate({octets}, {start}, {step}, {finish}) END"


def _scaled_sql(unscaled: str, scale: str, dtype: DataType) -> str:
    """``unscaled × 10^-scale`` as ``dtype``: the digits with an exponent, cast exactly."""
    return f"try_cast(concat(CAST({unscaled} AS STRING), 'E', CAST(-({scale}) AS STRING)) AS {ddl(dtype)})"


def _epoch_date_sql(days: str) -> str:
    return f"CASE WHEN {days} BETWEEN {T.MIN_DAY} AND {T.MAX_DAY} THEN date_add(DATE'1970-01-01', {days}) END"


def _epoch_timestamp_sql(count: str, per_second: int) -> str:
    if per_second <= 1_000_000:
        micros = f"try_multiply({count}, {1_000_000 // per_second})"
    else:  # nanoseconds: Spark keeps microseconds; floor division drops the rest
        unit = per_second // 1_000_000
        # floor division without overflow: truncate, then step down for negative remainders
        micros = (
            f"(({count} div {unit}) - CASE WHEN {count} < 0 AND pmod({count}, {unit}) != 0 THEN 1 ELSE 0 END)"
        )
    timestamp = f"timestampadd(MICROSECOND, {micros}, TIMESTAMP_NTZ'1970-01-01 00:00:00')"
    return f"CASE WHEN {micros} BETWEEN {T.MIN_MICROS} AND {T.MAX_MICROS} THEN {timestamp} END"


def _time_of_day_sql(count: str, per_second: int) -> str:
    """``[-]HH:MM:SS`` plus ``.f`` (3, 6 or 9 digits by precision) when the fraction is not 0.

    MySQL TIME may be negative or past 24h, so hours are not wrapped.
    """
    digits = len(str(per_second)) - 1
    magnitude = f"abs({count})"
    seconds = f"({magnitude} div {per_second})"
    fraction = f"pmod({magnitude}, {per_second})"
    clock = (
        f"format_string('%s%02d:%02d:%02d', CASE WHEN {count} < 0 THEN '-' ELSE '' END, "
        f"{seconds} div 3600, pmod({seconds} div 60, 60), pmod({seconds}, 60))"
    )
    decimals = f"CASE WHEN {fraction} != 0 THEN format_string('.%0{digits}d', {fraction}) ELSE '' END"
    text = f"concat({clock}, {decimals})"
    return f"CASE WHEN {count} BETWEEN {-(10**18)} AND {10**18} THEN {text} END"


# -- schemaless JSON → the row type ----------------------------------------------------------


def decode_json_sql(x: str, target: DataType, names: Names) -> str:
    """SQL reading the schemaless JSON value ``x`` as ``target`` (NULL when it does not fit).

    Strict on JSON kinds: a string never becomes a number and a fraction never an integer.
    Any value fits a string column (non-strings as their JSON text).
    """
    if isinstance(target, StructType):
        return _struct_sql(x, target, lambda v, f: decode_json_sql(v, f.dataType, names))
    if isinstance(target, ArrayType):
        e = names("e")
        element = decode_json_sql(e, target.elementType, names)
        return f"transform({as_type(x, 'array<variant>')}, {e} -> {element})"
    if isinstance(target, MapType):
        k, v = names("k"), names("v")
        body = decode_json_sql(v, target.valueType, names)
        return f"transform_values({as_type(x, 'map<string,variant>')}, ({k}, {v}) -> {body})"
    if isinstance(target, NullType):  # no value has shown this column's type yet
        return "CAST(NULL AS VOID)"
    json_kind, read = kind(x), as_type(x, target.simpleString())
    if isinstance(target, StringType):
        return _text_sql(x)
    if isinstance(target, BinaryType):  # Debezium writes bytes as base64
        return f"CASE WHEN {json_kind} = 'STRING' THEN try_to_binary({as_type(x, 'string')}, 'base64') END"
    if isinstance(target, (ByteType, ShortType, IntegerType, LongType)):
        return f"CASE WHEN {json_kind} = 'BIGINT' THEN {read} END"
    if isinstance(target, DecimalType):
        return _exact_decimal_sql(x, target)
    if isinstance(target, (FloatType, DoubleType)):
        # Kafka's JsonConverter (Jackson) writes NaN and the infinities as strings.
        text = as_type(x, "string")
        special = f"{json_kind} = 'STRING' AND {text} IN ({', '.join(map(lit, NON_FINITE))})"
        number = is_number_kind(json_kind)
        return f"CASE WHEN {number} THEN {read} WHEN {special} THEN CAST({text} AS {ddl(target)}) END"
    if isinstance(target, BooleanType):
        return f"CASE WHEN {json_kind} = 'BOOLEAN' THEN {read} END"
    if isinstance(target, DateType):  # Debezium writes a date as days since 1970 (io.debezium.time.Date)
        return f"CASE WHEN {json_kind} = 'BIGINT' THEN {_epoch_date_sql(as_type(x, 'int'))} ELSE {read} END"
    return read


def _exact_decimal_sql(x: str, target: DecimalType) -> str:
    """A JSON number as ``target`` only when no digit is lost (a cast would round 2.5 to 3).

    An integer always fits if it is in range (out of range reads as NULL); a decimal when its
    scale is at most the column's; a double (exponent notation) when it reads back equal.
    """
    json_kind, read = kind(x), as_type(x, target.simpleString())
    scale = f"CAST(substring_index(substring_index({json_kind}, ',', -1), ')', 1) AS INT)"
    return (
        f"CASE WHEN {json_kind} = 'BIGINT' THEN {read} "
        f"WHEN {json_kind} LIKE 'DECIMAL(%' AND {scale} <= {target.scale} THEN {read} "
        f"WHEN {json_kind} IN ('DOUBLE', 'FLOAT') AND CAST({read} AS DOUBLE) = {as_type(x, 'double')} "
        f"THEN {read} END"
    )


def fits_sql(raw: str, decoded: str, target: DataType, names: Names) -> str:
    """SQL: true when ``decoded`` kept every value of ``raw`` (absent, or decoded all the way)."""
    inner = ""
    if isinstance(target, StructType):
        checks = [
            fits_sql(get(raw, key(f.name)), f"{decoded}.{ident(f.name)}", f.dataType, names) for f in target
        ]
        inner = " AND ".join(checks)
    elif isinstance(target, (ArrayType, MapType)):
        r, d = names("r"), names("d")
        element = target.elementType if isinstance(target, ArrayType) else target.valueType
        raws = (
            as_type(raw, "array<variant>")
            if isinstance(target, ArrayType)
            else f"map_values({as_type(raw, 'map<string,variant>')})"
        )
        values = decoded if isinstance(target, ArrayType) else f"map_values({decoded})"
        pairs = f"zip_with({raws}, {values}, ({r}, {d}) -> {fits_sql(r, d, element, names)})"
        inner = f"coalesce(forall({pairs}, ok -> ok), false)"
    complete = f" AND {inner}" if inner else ""
    return f"({absent(raw)} OR ({decoded} IS NOT NULL{complete}))"


# -- decoding the images ---------------------------------------------------------------------


@dataclass(frozen=True)
class Decoder:
    """How one group's images decode, and how a column that failed is reported."""

    connect_fields: Mapping[str, Mapping[str, Any]] | None  # None: schemaless JSON

    def decode(self, raw: str, field: StructField, names: Names) -> str:
        if self.connect_fields is None:
            return decode_json_sql(raw, field.dataType, names)
        return _connect_sub(raw, self.connect_fields.get(field.name), field.dataType, names)

    def message(self, raw: str, field: StructField) -> str:
        expected = field.dataType.simpleString()
        if self.connect_fields is None:
            return f"concat({lit(f'column {field.name}: expected {expected}, got ')}, {json_text(raw)})"
        spec = self.connect_fields.get(field.name)
        if spec is not None:
            natural = T.connect_type(spec)
            if natural != field.dataType and not (
                isinstance(field.dataType, StringType) or widens_to(natural, field.dataType)
            ):
                prefix = f"column {field.name}: type changed from {expected} to {natural.simpleString()}, "
                prefix += "which does not widen; value "
                return f"concat({lit(prefix)}, {json_text(raw)})"
        logical = (spec or {}).get("name") or (spec or {}).get("type") or "a column its schema lacks"
        prefix, suffix = f"column {field.name}: cannot decode ", f" ({logical}) as {expected}"
        return f"concat({lit(prefix)}, {json_text(raw)}, {lit(suffix)})"


def plan_rows(
    groups: Sequence[SchemaGroup], known: StructType
) -> tuple[StructType, dict[str | None, Decoder]]:
    """The batch's row type and a decoder per schema group.

    The row type is ``known`` (bronze's) with the batch's new columns appended in order of
    appearance, and its columns widened where the batch's types need it and may.
    """
    row = known
    decoders: dict[str | None, Decoder] = {}
    for group in groups:
        if group.sid is None:
            row = T.merge_row_types(row, group.inferred or StructType([]))
            decoders[None] = Decoder(None)
            continue
        fields = _connect_row_fields(group.schema or {})
        row = T.merge_row_types(
            row, StructType([StructField(n, T.connect_type(f)) for n, f in fields.items()])
        )
        decoders[group.sid] = Decoder(fields)
    return row, decoders


def _connect_row_fields(schema: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """The row's Connect field schemas by name, from the envelope's ``after`` then ``before``."""
    images = [f for f in schema.get("fields", []) if f.get("field") in ("after", "before")]
    fields: dict[str, Mapping[str, Any]] = {}
    for image in sorted(images, key=lambda f: f.get("field") != "after"):
        for f in image.get("fields", []) if image.get("type") == "struct" else []:
            fields.setdefault(f["field"], f)
    return fields


IMAGES = (("a", "after"), ("b", "before"))


def decode_images(
    staged: DataFrame,
    decoders: Mapping[str | None, Decoder],
    row: StructType,
    images: Sequence[tuple[str, str]],
) -> DataFrame:
    """Add ``__after``/``__before`` (typed rows) and ``__decode_reason``, in three stages.

    Raw field values, decoded values, then structs and checks are separate projections: each
    decoded value is read twice (struct and check), which keeps Spark from inlining it twice.
    """
    names = Names()
    raw = [
        f"{get('__p', '.' + image + key(f.name))} AS __r{tag}{i}"
        for tag, image in images
        for i, f in enumerate(row)
    ]
    decoded = [_decoded_column(decoders, tag, i, f, names) for tag, _ in images for i, f in enumerate(row)]
    built = {image: _image_sql(tag, image, row) for tag, image in images}
    structs = [f"{built.get(image, f'CAST(NULL AS {ddl(row)})')} AS __{image}" for _, image in IMAGES]
    reason = f"{_decode_reason_sql(decoders, row, images, names)} AS __decode_reason"
    return staged.selectExpr("*", *raw).selectExpr("*", *decoded).selectExpr("*", *structs, reason)


def _decoded_column(
    decoders: Mapping[str | None, Decoder], tag: str, i: int, f: StructField, names: Names
) -> str:
    by_sid = {sid: d.decode(f"__r{tag}{i}", f, names) for sid, d in decoders.items()}
    return f"{_by_group(by_sid)} AS __d{tag}{i}"


def _image_sql(tag: str, image: str, row: StructType) -> str:
    if not row.fields:
        return f"CAST(NULL AS {ddl(row)})"
    args = ", ".join(f"{lit(f.name)}, __d{tag}{i}" for i, f in enumerate(row))
    return f"CASE WHEN __event AND {is_object('__p', '.' + image)} THEN named_struct({args}) END"


def _decode_reason_sql(
    decoders: Mapping[str | None, Decoder], row: StructType, images: Sequence[tuple[str, str]], names: Names
) -> str:
    """The first column, ``after`` then ``before``, whose JSON value did not survive decoding."""
    checks = []
    for tag, _ in images:
        for i, f in enumerate(row):
            raw, decoded = f"__r{tag}{i}", f"__d{tag}{i}"
            message = _by_group({sid: d.message(raw, f) for sid, d in decoders.items()})
            checks.append(f"CASE WHEN NOT {fits_sql(raw, decoded, f.dataType, names)} THEN {message} END")
    if not checks:
        return "CAST(NULL AS STRING)"
    return f"coalesce({', '.join(checks)})" if len(checks) > 1 else checks[0]


def _by_group(by_sid: Mapping[str | None, str]) -> str:
    """Pick the expression of the event's schema group; NULL for lines that are not events."""
    if not by_sid:
        return "NULL"
    branches = " ".join(
        f"WHEN {'__sid IS NULL' if sid is None else '__sid = ' + lit(sid)} THEN {sql}"
        for sid, sql in by_sid.items()
    )
    return f"CASE WHEN NOT __event THEN NULL {branches} END"
