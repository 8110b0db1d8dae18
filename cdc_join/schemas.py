"""How a table's schema may change, and how rows are made to fit a changed schema.

Every table of a pipeline only ever *grows* its schema: a column is added (also nested inside a
struct, an array of structs or a map of structs), or a column's type *widens* by Delta's
type-widening rules (:func:`wider_type`):

- byte → short → int → bigint; byte/short/int → double; float → double;
- an integer or a decimal → a decimal with room for every digit of both
  (``decimal(p, s)`` → ``decimal(p + k1, s + k2)`` with ``k1 >= k2 >= 0``);
- date → timestamp_ntz;
- void (a column that so far held only nulls) → any type.

Nothing else changes a type: bigint → double would round large integers, anything → string
would change what the column means. Such a change is refused where it is detected (the
Debezium parser quarantines the values, a select change is reported as a config error).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator, Sequence

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
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

MAX_PRECISION = 38
_INTEGRAL_DIGITS = {ByteType: 3, ShortType: 5, IntegerType: 10, LongType: 20}
_DOUBLE_EXACT = (ByteType, ShortType, IntegerType, FloatType)  # every value exact in a double


def wider_type(known: DataType, new: DataType) -> DataType | None:
    """The narrowest type ``known`` widens to that holds every value of ``new``.

    ``known`` itself when ``new``'s values already fit in it; ``None`` when there is no such
    type. Scalars only; nested types merge field by field (:func:`merge_schemas`).
    """
    if known == new:
        return known
    if isinstance(known, NullType):  # a column without a value yet takes the first type it sees
        return new
    if isinstance(new, NullType):
        return known
    k, n = type(known), type(new)
    if k in _INTEGRAL_DIGITS and n in _INTEGRAL_DIGITS:
        return known if _INTEGRAL_DIGITS[k] >= _INTEGRAL_DIGITS[n] else new
    if isinstance(known, DoubleType) and n in _DOUBLE_EXACT:
        return known
    if isinstance(new, DoubleType) and k in _DOUBLE_EXACT:
        return new
    if isinstance(known, DateType) and isinstance(new, TimestampNTZType):
        return new
    if isinstance(known, TimestampNTZType) and isinstance(new, DateType):
        return known
    if not (isinstance(known, DecimalType) or isinstance(new, DecimalType)):
        return None
    known_digits, new_digits = _as_decimal(known), _as_decimal(new)
    if known_digits is None or new_digits is None:
        return None
    (kp, ks), (np_, ns) = known_digits, new_digits
    scale = max(ks, ns)
    precision = max(kp - ks, np_ - ns) + scale
    return DecimalType(precision, scale) if precision <= MAX_PRECISION else None


def _as_decimal(dtype: DataType) -> tuple[int, int] | None:
    """(precision, scale) of a decimal, or of the decimal an integer type widens to."""
    if isinstance(dtype, DecimalType):
        return dtype.precision, dtype.scale
    digits = _INTEGRAL_DIGITS.get(type(dtype))
    return None if digits is None else (digits, 0)


def widens_to(narrow: DataType, wide: DataType) -> bool:
    """Whether every value of ``narrow`` fits ``wide`` unchanged (equal, or a widening).

    Nested types compare field by field; a field that ``wide`` lacks does not fit.
    """
    if isinstance(narrow, StructType) and isinstance(wide, StructType):
        fields = {f.name: f.dataType for f in wide.fields}
        return all(f.name in fields and widens_to(f.dataType, fields[f.name]) for f in narrow.fields)
    if isinstance(narrow, ArrayType) and isinstance(wide, ArrayType):
        return widens_to(narrow.elementType, wide.elementType)
    if isinstance(narrow, MapType) and isinstance(wide, MapType):
        return narrow.keyType == wide.keyType and widens_to(narrow.valueType, wide.valueType)
    return wider_type(wide, narrow) == wide


def merge_schemas(known: StructType, new: StructType) -> StructType:
    """``known`` with ``new``'s extra fields appended, widened where ``new`` needs and may.

    Structs (also inside arrays and maps) merge field by field. A field whose new type cannot
    widen keeps its known type; nullability of known fields is kept, added fields are nullable.
    """
    names = set(known.fieldNames())
    merged = [
        StructField(f.name, _merge(f.dataType, new[f.name].dataType), f.nullable, f.metadata)
        if f.name in new.names
        else f
        for f in known.fields
    ]
    added = [StructField(f.name, f.dataType, True, f.metadata) for f in new.fields if f.name not in names]
    return StructType(merged + added)


def _merge(known: DataType, new: DataType) -> DataType:
    if isinstance(known, StructType) and isinstance(new, StructType):
        return merge_schemas(known, new)
    if isinstance(known, ArrayType) and isinstance(new, ArrayType):
        return ArrayType(_merge(known.elementType, new.elementType), known.containsNull)
    if isinstance(known, MapType) and isinstance(new, MapType) and known.keyType == new.keyType:
        return MapType(known.keyType, _merge(known.valueType, new.valueType), known.valueContainsNull)
    return wider_type(known, new) or known


def nullable(data_type: DataType) -> DataType:
    """``data_type`` with every field, element and value nullable."""
    if isinstance(data_type, StructType):
        return StructType(
            [StructField(f.name, nullable(f.dataType), True, f.metadata) for f in data_type.fields]
        )
    if isinstance(data_type, ArrayType):
        return ArrayType(nullable(data_type.elementType), True)
    if isinstance(data_type, MapType):
        return MapType(nullable(data_type.keyType), nullable(data_type.valueType), True)
    return data_type


def changed_types(
    current: StructType, target: StructType, prefix: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], DataType]]:
    """``current``'s fields (nested in structs too) whose type ``target`` changes: path, new type."""
    fields = {f.name: f.dataType for f in target.fields}
    changed: list[tuple[tuple[str, ...], DataType]] = []
    for f in current.fields:
        if f.name not in fields:
            continue
        path, old, new = (*prefix, f.name), _strip(f.dataType), fields[f.name]
        if isinstance(old, StructType) and isinstance(new, StructType):
            changed += changed_types(old, new, path)
        elif old != _strip(new):
            changed.append((path, new))
    return changed


def same_type(a: DataType, b: DataType) -> bool:
    """Whether ``a`` and ``b`` are one type, nullability flags and field metadata aside."""
    return _strip(a) == _strip(b)


def _strip(dtype: DataType) -> DataType:
    """``dtype`` with nullability flags dropped, for comparing types only."""
    if isinstance(dtype, StructType):
        return StructType([StructField(f.name, _strip(f.dataType)) for f in dtype.fields])
    if isinstance(dtype, ArrayType):
        return ArrayType(_strip(dtype.elementType))
    if isinstance(dtype, MapType):
        return MapType(_strip(dtype.keyType), _strip(dtype.valueType))
    return dtype


def conform(df: DataFrame, target: StructType) -> DataFrame:
    """``df``'s rows in ``target``'s shape: columns in its order, types cast, missing ones null.

    Structs are rebuilt by field name (Spark casts structs by position), so a widened or added
    nested field lands where ``target`` has it. ``df`` itself when it has that shape already.
    The projection is SQL text: one round trip to a classic session's JVM, where building it
    from ``Column`` objects costs several per column.
    """
    if conforms(df.schema, target):
        return df
    have = {f.name: f.dataType for f in df.schema.fields}
    lambdas = itertools.count()
    return df.selectExpr(
        *[
            f"{conform_sql(quote(f.name), have[f.name], f.dataType, lambdas)} AS {quote(f.name)}"
            if f.name in have
            else f"CAST(NULL AS {ddl(f.dataType)}) AS {quote(f.name)}"
            for f in target.fields
        ]
    )


def conforms(schema: StructType, target: StructType) -> bool:
    """Whether rows of ``schema`` have ``target``'s shape already (nullability aside), so
    :func:`conform` would leave them as they are."""
    have = {f.name: f.dataType for f in schema.fields}
    return list(have) == target.names and all(
        _strip(have[f.name]) == _strip(f.dataType) for f in target.fields
    )


def conform_sql(value: str, current: DataType, target: DataType, lambdas: Iterator[int]) -> str:
    """SQL of ``value`` (a column or field reference of type ``current``) in the shape of
    ``target``; see :func:`conform`. ``lambdas`` numbers the lambda variables it introduces."""
    if _strip(current) == _strip(target):
        return value
    if isinstance(target, NullType):  # a void column holds only nulls (see cdc_join.storage.untyped)
        return "NULL"
    if isinstance(current, StructType) and isinstance(target, StructType):
        have = {f.name: f.dataType for f in current.fields}
        parts = ", ".join(
            f"{sql_string(f.name)}, "
            + (
                conform_sql(f"{value}.{quote(f.name)}", have[f.name], f.dataType, lambdas)
                if f.name in have
                else f"CAST(NULL AS {ddl(f.dataType)})"
            )
            for f in target.fields
        )
        return f"CASE WHEN {value} IS NOT NULL THEN {f'named_struct({parts})' if parts else 'struct()'} END"
    if isinstance(current, ArrayType) and isinstance(target, ArrayType):
        e = f"__e{next(lambdas)}"
        body = conform_sql(e, current.elementType, target.elementType, lambdas)
        return f"transform({value}, {e} -> {body})"
    if isinstance(current, MapType) and isinstance(target, MapType):
        k, v = f"__k{next(lambdas)}", f"__v{next(lambdas)}"
        body = conform_sql(v, current.valueType, target.valueType, lambdas)
        return f"transform_values({value}, ({k}, {v}) -> {body})"
    return f"CAST({value} AS {ddl(target)})"


def sql_string(text: str) -> str:
    """A Spark SQL string literal of ``text`` that reads the same whatever the session's settings.

    Quoted as it is when it holds no backslash, quote or ``${``; otherwise its UTF-8 bytes as a
    binary literal cast to a string. A backslash escape reads otherwise with
    ``spark.sql.parser.escapedStringLiterals`` on, and Spark replaces ``${name}`` in SQL text
    before parsing it, inside quotes too (``spark.sql.variable.substitute``, on by default:
    ``${env:HOME}`` would become a folder). Either way a key, a column name or a path in the SQL
    would silently read as another.
    """
    if "\\" not in text and "'" not in text and "${" not in text:
        return f"'{text}'"
    try:
        return f"CAST(X'{text.encode('utf-8').hex().upper()}' AS STRING)"
    except UnicodeEncodeError:  # a lone surrogate, which no Spark string holds
        return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


#: ``to_json`` options that spell out a timestamp to the microsecond: by default ``to_json``
#: writes one inside a struct, array or map to the millisecond, and two values that differ
#: below one would compare as the same text.
EXACT_JSON = {
    "timestampFormat": "yyyy-MM-dd'T'HH:mm:ss.SSSSSSXXX",
    "timestampNTZFormat": "yyyy-MM-dd'T'HH:mm:ss.SSSSSS",
}


def exact_json(column: Column) -> Column:
    """The JSON text of a nested value (struct, array, map, variant) as comparisons need it:
    every value in full, timestamps to the microsecond (:data:`EXACT_JSON`)."""
    return F.to_json(column, EXACT_JSON)


def ddl(data_type: DataType) -> str:
    """The SQL type of ``data_type``, field names quoted (``simpleString`` does not quote them)."""
    if isinstance(data_type, StructType):
        return "STRUCT<" + ", ".join(f"{quote(f.name)}: {ddl(f.dataType)}" for f in data_type.fields) + ">"
    if isinstance(data_type, ArrayType):
        return f"ARRAY<{ddl(data_type.elementType)}>"
    if isinstance(data_type, MapType):
        return f"MAP<{ddl(data_type.keyType)}, {ddl(data_type.valueType)}>"
    if isinstance(data_type, TimestampType):
        # Plain TIMESTAMP means TIMESTAMP_NTZ in a session with spark.sql.timestampType so set.
        return "TIMESTAMP_LTZ"
    return data_type.simpleString()


def quote(name: str) -> str:
    """A column name as a backtick-quoted Spark SQL identifier."""
    return "`" + name.replace("`", "``") + "`"


def quoted(names: Sequence[str]) -> list[str]:
    """:func:`quote` of each name."""
    return [quote(n) for n in names]


_SIMPLE_TYPES: dict[str, DataType] = {
    "string": StringType(),
    "boolean": BooleanType(),
    "tinyint": ByteType(),
    "byte": ByteType(),
    "smallint": ShortType(),
    "short": ShortType(),
    "int": IntegerType(),
    "integer": IntegerType(),
    "bigint": LongType(),
    "long": LongType(),
    "float": FloatType(),
    "double": DoubleType(),
    "date": DateType(),
    "timestamp": TimestampType(),
    "timestamp_ntz": TimestampNTZType(),
    "binary": BinaryType(),
}
_TYPE_TOKENS = re.compile(r"\s*(`(?:[^`]|``)+`|[<>(),:]|[A-Za-z_][A-Za-z0-9_]*|\d+)")


def parse_type(text: str) -> DataType:
    """A Spark SQL type name (``bigint``, ``decimal(10,2)``, ``array<string>``,
    ``struct<a: int, b: string>``, ``map<string, double>``) as a Spark type, without Spark.

    Raises:
        ValueError: the text is not such a type; the message says where it stops making sense.
    """
    tokens, at = [], 0
    while text[at:].strip():
        match = _TYPE_TOKENS.match(text, at)
        if match is None:
            raise ValueError(f"{text!r} is not a type name (at {text[at:].strip()!r})")
        tokens.append(match.group(1))
        at = match.end()
    parsed, end = _parse(tokens, 0, text)
    if end != len(tokens):
        raise ValueError(f"{text!r}: unexpected {tokens[end]!r} after the type")
    return parsed


def _parse(tokens: list[str], i: int, text: str) -> tuple[DataType, int]:
    def expect(token: str, at: int) -> int:
        if at >= len(tokens) or tokens[at] != token:
            raise ValueError(f"{text!r}: expected {token!r}")
        return at + 1

    if i >= len(tokens):
        raise ValueError(f"{text!r} ends before its type does")
    word = tokens[i].lower()
    if word in _SIMPLE_TYPES:
        return _SIMPLE_TYPES[word], i + 1
    if word in ("decimal", "numeric", "dec"):
        if i + 1 < len(tokens) and tokens[i + 1] == "(":
            precision = int(tokens[i + 2])
            scale = 0
            i += 3
            if tokens[i] == ",":
                scale, i = int(tokens[i + 1]), i + 2
            i = expect(")", i)
            if not 0 < precision <= MAX_PRECISION or not 0 <= scale <= precision:
                raise ValueError(f"{text!r}: decimal({precision},{scale}) is out of range")
            return DecimalType(precision, scale), i
        return DecimalType(10, 0), i + 1
    if word == "array":
        element, i = _parse(tokens, expect("<", i + 1), text)
        return ArrayType(element), expect(">", i)
    if word == "map":
        key, i = _parse(tokens, expect("<", i + 1), text)
        value, i = _parse(tokens, expect(",", i), text)
        return MapType(key, value), expect(">", i)
    if word == "struct":
        i = expect("<", i + 1)
        fields = []
        while tokens[i] != ">":
            name = tokens[i][1:-1].replace("``", "`") if tokens[i].startswith("`") else tokens[i]
            field_type, i = _parse(tokens, expect(":", i + 1), text)
            fields.append(StructField(name, field_type))
            if tokens[i] == ",":
                i += 1
        return StructType(fields), i + 1
    raise ValueError(f"{text!r}: unknown type {tokens[i]!r}")
