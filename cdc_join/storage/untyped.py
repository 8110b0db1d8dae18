"""Columns with no type yet, as the Delta (Spark) backend stores them.

A source column that has so far held only ``[]``, ``[null]`` or a map of nulls is
``array<void>`` (``map<k, void>``; a struct field that has held only nulls inside an array is
``void`` too): its element type comes with the first value (:mod:`cdc_join.schemas`). delta-rs
writes such a column; Delta on Spark refuses to write any void under an array or a map
(``DELTA_COMPLEX_TYPE_COLUMN_CONTAINS_NULL_TYPE``), in a MERGE as in an append, and a struct
whose fields are all void (``DELTA_CANNOT_WRITE_EMPTY_SCHEMA``: Parquet has no empty group).

So on that backend such a void (each void of such a struct) is *stored* as a string that is
always null, and the field holding it says so in its comment: ``cdc_join void: element`` (the
steps from the field to the void, ``element`` of an array and ``value`` of a map; nothing after
the colon for the field itself). Reads give the void back (:func:`to_logical`,
:func:`logical_schema`): both backends hold the same rows and report the same schema. Any other
void outside arrays and maps stays void: Delta keeps it in the schema and writes no data for it.

A comment names one path through arrays and maps, so a field holds at most one such void;
struct fields inside carry their own. A comment left behind by a type that has since arrived is
harmless: only a string at its path reads as void, and a table whose marked void gets a type is
rewritten with the new comments (``DeltaSparkStorage.evolve``).
"""

from __future__ import annotations

import itertools

from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import ArrayType, DataType, MapType, NullType, StringType, StructField, StructType

from cdc_join.schemas import conform_sql, quote, same_type, widens_to

MARK = "cdc_join void:"


def stored_schema(schema: StructType) -> StructType:
    """``schema`` as the table stores it: each void under an array or a map a string, and the
    field that holds it commented (:data:`MARK`)."""
    result = _stored(schema, under=False)
    assert isinstance(result, StructType)
    return result


def logical_schema(schema: StructType) -> StructType:
    """A stored schema as cdc_join knows it: each commented string back to void, the comment
    dropped."""
    result = _logical(schema)
    assert isinstance(result, StructType)
    return result


def needs_storing(dtype: DataType) -> bool:
    """Whether ``dtype`` has a void under an array or a map (Delta on Spark cannot write it)."""
    return _stored(dtype, under=False) != dtype


def has_untyped(schema: StructType) -> bool:
    """Whether a column of ``schema`` has a void under an array or a map."""
    return any(needs_storing(f.dataType) for f in schema.fields)


def is_marked(stored: StructType | StructField) -> bool:
    """Whether a stored schema (or one field of it) has a commented field (a void stored as a
    string)."""
    return MARK in stored.json()


def to_stored(df: DataFrame, table: StructType | None = None) -> DataFrame:
    """``df`` with each column that has a void under an array or a map cast to how the table
    stores it: the table's type (``table``, its logical schema) where ``df``'s fits it, else
    ``df``'s own with its voids stored as strings. Other columns are left as they are."""
    have = {f.name: f.dataType for f in table.fields} if table is not None else {}
    lambdas = itertools.count()
    columns: dict[str, object] = {}
    for field in df.schema.fields:
        if not needs_storing(field.dataType):
            continue
        known = have.get(field.name)
        logical = known if known is not None and widens_to(field.dataType, known) else field.dataType
        stored = _stored(logical, under=False)
        sql = conform_sql(quote(field.name), field.dataType, stored, lambdas)
        columns[field.name] = (F.expr(sql).cast(stored), _stored_field(field, False).metadata)
    if not columns:
        return df
    out = df.withColumns({name: col for name, (col, _) in columns.items()})
    for name, (_, metadata) in columns.items():
        if metadata:
            out = out.withMetadata(name, metadata)
    return out


def to_logical(df: DataFrame) -> DataFrame:
    """``df`` read from a table: each stored void back to void (its values are all null)."""
    if not is_marked(df.schema):
        return df
    logical = logical_schema(df.schema)
    lambdas = itertools.count()
    columns = {
        s.name: F.expr(conform_sql(quote(s.name), s.dataType, f.dataType, lambdas))
        for s, f in zip(df.schema.fields, logical.fields, strict=True)
        if not same_type(s.dataType, f.dataType)
    }
    out = df.withColumns(columns) if columns else df
    for s in df.schema.fields:  # the comments go with the stored type
        if MARK in str(s.metadata.get("comment", "")):
            out = out.withMetadata(s.name, {k: v for k, v in s.metadata.items() if k != "comment"})
    return out


def _stored(dtype: DataType, under: bool) -> DataType:
    if isinstance(dtype, NullType):
        return StringType() if under else dtype
    if isinstance(dtype, ArrayType):
        return ArrayType(_stored(dtype.elementType, True), dtype.containsNull)
    if isinstance(dtype, MapType):
        return MapType(dtype.keyType, _stored(dtype.valueType, True), dtype.valueContainsNull)
    if isinstance(dtype, StructType):
        # A struct with nothing but voids in it would be an empty group in Parquet, which Delta
        # on Spark refuses to write (DELTA_CANNOT_WRITE_EMPTY_SCHEMA): its voids are stored too.
        inner = under or not _holds_a_type(dtype)
        return StructType([_stored_field(f, inner) for f in dtype.fields])
    return dtype


def _holds_a_type(dtype: DataType) -> bool:
    """Whether a value of ``dtype`` outside arrays and maps has a leaf that is not void."""
    if isinstance(dtype, StructType):
        return any(_holds_a_type(f.dataType) for f in dtype.fields)
    return not isinstance(dtype, NullType)


def _stored_field(field: StructField, under: bool) -> StructField:
    path = _void_path(field.dataType, under)
    metadata = dict(field.metadata)
    if path is not None:
        metadata["comment"] = f"{MARK} {path}".rstrip()
    return StructField(field.name, _stored(field.dataType, under), field.nullable, metadata)


def _void_path(dtype: DataType, under: bool) -> str | None:
    """The steps from a field of ``dtype`` through arrays and maps to a void stored as a string."""
    steps: list[str] = []
    while True:
        if isinstance(dtype, NullType):
            return ".".join(steps) if under or steps else None
        if isinstance(dtype, ArrayType):
            steps.append("element")
            dtype = dtype.elementType
        elif isinstance(dtype, MapType):
            steps.append("value")
            dtype = dtype.valueType
        else:
            return None


def _logical(dtype: DataType) -> DataType:
    if isinstance(dtype, ArrayType):
        return ArrayType(_logical(dtype.elementType), dtype.containsNull)
    if isinstance(dtype, MapType):
        return MapType(dtype.keyType, _logical(dtype.valueType), dtype.valueContainsNull)
    if isinstance(dtype, StructType):
        return StructType([_logical_field(f) for f in dtype.fields])
    return dtype


def _logical_field(field: StructField) -> StructField:
    dtype = _logical(field.dataType)
    metadata = field.metadata
    comment = metadata.get("comment")
    if isinstance(comment, str) and comment.startswith(MARK):
        path = comment[len(MARK) :].strip()
        dtype = _void_at(dtype, path.split(".") if path else [])
        metadata = {k: v for k, v in metadata.items() if k != "comment"}
    return StructField(field.name, dtype, field.nullable, metadata)


def _void_at(dtype: DataType, steps: list[str]) -> DataType:
    if not steps:
        return NullType() if isinstance(dtype, StringType) else dtype
    step, rest = steps[0], steps[1:]
    if step == "element" and isinstance(dtype, ArrayType):
        return ArrayType(_void_at(dtype.elementType, rest), dtype.containsNull)
    if step == "value" and isinstance(dtype, MapType):
        return MapType(dtype.keyType, _void_at(dtype.valueType, rest), dtype.valueContainsNull)
    return dtype
