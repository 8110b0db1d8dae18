"""The left-value hash of KIP-213, computed with Spark built-ins and reproducible in Python.

A response carries the hash of the left row it was computed for; resolve compares it with the
hash of the current left row and drops the response when they differ ("stale and should be
discarded"). Both sides must therefore agree on a canonical byte encoding of a row:

    for each column, in order of name, whose value is not null:
        uint32_be(len(name)) || name || uint32_be(len(text)) || text

where ``text`` is the UTF-8 of the value's canonical text (see :func:`canonical_text`). A null
column contributes nothing, and the column name is part of the encoding, so ``(a=null, b='x')``
and ``(a='x', b=null)`` differ, and adding a column that is null everywhere (schema evolution)
changes no existing hash. The hash is Spark's ``xxhash64`` of those bytes, which equals
``xxhash.xxh64_intdigest(encoding, seed=42)`` read as a signed 64-bit integer.

Silver rows carry a hash of their own, of the values of their ``select`` columns
(:func:`values_hash`): the silver MERGE compares it, one column, instead of every column, to
tell a changed row from one sent again. It is never recomputed outside Spark, so it hashes the
values themselves rather than a text encoding.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

import xxhash
from pyspark.sql import Column
from pyspark.sql import functions as F
from pyspark.sql.types import ArrayType, BinaryType, DataType, MapType, StructField, StructType, VariantType

from cdc_join.schemas import exact_json, quote

SPARK_XXHASH_SEED = 42


def canonical_text_sql(value: str, data_type: DataType) -> str:
    """SQL: the canonical text of a value: hex for binary, JSON for nested types, else CAST AS STRING."""
    if isinstance(data_type, BinaryType):
        return f"hex({value})"
    if isinstance(data_type, (StructType, ArrayType, MapType)):
        return f"to_json({value})"
    return f"CAST({value} AS STRING)"


def encoding_sql(fields: Sequence[StructField], prefix: str = "") -> str:
    """SQL: the canonical null-aware byte encoding of a row made of ``fields`` (a BINARY).

    Built as SQL text: one expression, one round trip to the JVM however many columns.
    """
    parts = []
    for f in sorted(fields, key=lambda f: f.name):
        value = prefix + "`" + f.name.replace("`", "``") + "`"
        text = canonical_text_sql(value, f.dataType)
        name = f.name.encode("utf-8")
        header = struct.pack(">I", len(name)) + name
        length = f"unhex(lpad(hex(octet_length({text})), 8, '0'))"
        part = f"concat(X'{header.hex()}', {length}, encode({text}, 'UTF-8'))"
        parts.append(f"CASE WHEN {value} IS NOT NULL THEN {part} ELSE X'' END")
    return f"concat({', '.join(parts)})" if parts else "X''"


def encoding(fields: Sequence[StructField], prefix: str = "") -> Column:
    """The canonical null-aware byte encoding of a row made of ``fields`` (a BINARY column)."""
    return F.expr(encoding_sql(fields, prefix))


def row_hash_sql(fields: Sequence[StructField], prefix: str = "") -> str:
    """SQL: xxHash64 (signed, seed 42) of :func:`encoding_sql` — the value hash of a row."""
    return f"xxhash64({encoding_sql(fields, prefix)})"


def row_hash(fields: Sequence[StructField], prefix: str = "") -> Column:
    """xxHash64 (signed, seed 42) of :func:`encoding` — the value hash stored with every row."""
    return F.expr(row_hash_sql(fields, prefix))


def python_encoding(row: Mapping[str, Any]) -> bytes:
    """The same encoding as :func:`encoding`, for rows whose values are already canonical text.

    Values must be given as the text Spark's canonical form produces (``str(int)``, the string
    itself, ...); ``None`` means null.
    """
    out = bytearray()
    for name in sorted(row):
        value = row[name]
        if value is None:
            continue
        name_b = name.encode("utf-8")
        text_b = str(value).encode("utf-8")
        out += struct.pack(">I", len(name_b)) + name_b + struct.pack(">I", len(text_b)) + text_b
    return bytes(out)


def python_row_hash(row: Mapping[str, Any]) -> int:
    """xxHash64 of :func:`python_encoding`, as the signed 64-bit integer Spark returns."""
    unsigned = xxhash.xxh64_intdigest(python_encoding(row), seed=SPARK_XXHASH_SEED)
    return unsigned - (1 << 64) if unsigned >= 1 << 63 else unsigned


def value_arguments(columns: Sequence[str], types: Mapping[str, DataType]) -> list[Column]:
    """What hashing the values of ``columns`` hashes: each value, then whether it is NULL.

    Spark's hashes skip a NULL, so without the flag ``(NULL, 'x')`` and ``('x', NULL)`` would
    hash alike. A nested value is hashed as its JSON text (:func:`~cdc_join.schemas.exact_json`),
    which spells out the NULLs inside it too (the hashes would skip those as well).
    """
    found: list[Column] = []
    for c in columns:
        value = F.col(quote(c))
        nested = isinstance(types[c], (ArrayType, MapType, StructType, VariantType))
        found += [exact_json(value) if nested else value, value.isNull()]
    return found


def values_hash(columns: Sequence[str], types: Mapping[str, DataType]) -> Column:
    """xxHash64 of the values of ``columns`` (typed as ``types``): silver's ``_values_hash``.

    Two rows whose values differ get the same hash with a chance of about 2^-64; a value held
    in another type (a column widened since) gives another hash, which costs a MERGE an update
    of a row that did not change, never a change missed.
    """
    return F.xxhash64(*value_arguments(columns, types))
