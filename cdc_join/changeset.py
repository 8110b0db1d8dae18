"""Change sets materialized once per step: an Arrow copy on the driver and a Spark frame over it.

Every step of a run builds on the previous step's DataFrame. Left lazy, the silver MERGE
source's plan would hold every read, join and filter of the run: Catalyst re-analyses and
re-optimizes that whole tree for each action, and each action re-runs the reads.
Materializing at step boundaries keeps every plan small and every read single. The Arrow copy
also gives counts and the key values that drive file skipping without another Spark job, and
the delta-rs backend writes it as is instead of collecting the frame again.

Only change-set-sized data goes through here (changed keys, instructions, responses, the rows
a run writes), never a whole table; that is what keeps a run's memory bounded by its changes.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import from_arrow_type
from pyspark.sql.pandas.types import to_arrow_schema as _to_arrow_schema
from pyspark.sql.types import ArrayType, DataType, MapType, NullType, StringType, StructField, StructType

from cdc_join.schemas import ddl, nullable, quote, sql_string

#: Attribute under which a frame carries its Arrow copy (read by the delta-rs backend, which
#: would otherwise collect the frame to Arrow a second time).
ARROW_ATTRIBUTE = "_cdc_join_arrow"


class ChangeSet:
    """A small DataFrame's rows, held on the driver as Arrow, and a Spark frame over them.

    The frame is built on first use, so a change set only counted or inspected on the driver
    never pays for ``createDataFrame``.
    """

    def __init__(self, spark: SparkSession, schema: StructType, table: pa.Table) -> None:
        self.spark = spark
        self.schema = schema
        self.table = table
        self._frame: DataFrame | None = None

    @property
    def frame(self) -> DataFrame:
        if self._frame is None:
            frame = spark_frame(self.spark, self.table, self.schema)
            setattr(frame, ARROW_ATTRIBUTE, self.table)
            self._frame = frame
        return self._frame

    @property
    def rows(self) -> int:
        return self.table.num_rows

    def distinct(self, columns: Sequence[str]) -> ChangeSet:
        """The distinct rows of some columns, as a change set of their own."""
        schema = StructType([self.schema[c] for c in columns])
        return ChangeSet(self.spark, schema, distinct_rows(self.table, columns))

    def filtered(self, mask: pa.ChunkedArray | pa.Array) -> ChangeSet:
        """The rows where ``mask`` is true."""
        return ChangeSet(self.spark, self.schema, self.table.filter(mask))

    def with_column(self, name: str, values: pa.Array, *, nullable: bool = True) -> ChangeSet:
        """The same rows with one more column (its Spark type from its Arrow type)."""
        field = StructField(name, from_arrow_type(values.type), nullable)
        return ChangeSet(
            self.spark, StructType([*self.schema.fields, field]), self.table.append_column(name, values)
        )

    def renamed(self, names: Mapping[str, str]) -> ChangeSet:
        """The same rows with columns renamed (``old → new``)."""
        schema = StructType(
            [StructField(names.get(f.name, f.name), f.dataType, f.nullable) for f in self.schema.fields]
        )
        return ChangeSet(
            self.spark, schema, self.table.rename_columns([names.get(c, c) for c in self.table.column_names])
        )

    def values(self, column: str) -> list[Any]:
        """Distinct non-null values of one column (e.g. the keys that drive file skipping)."""
        return [v for v in pc.unique(self.table[column]).to_pylist() if v is not None]

    def value_counts(self, column: str) -> dict[Any, int]:
        """Rows per value of one column."""
        counts = pc.value_counts(self.table[column]).to_pylist()
        return {c["values"]: c["counts"] for c in counts}

    def count_true(self, column: str) -> int:
        """Rows whose boolean ``column`` is true."""
        return int(pc.sum(pc.cast(pc.fill_null(self.table[column], False), pa.int64())).as_py() or 0)

    @staticmethod
    def concat(parts: Sequence[ChangeSet], columns: Sequence[str]) -> ChangeSet:
        """The distinct rows of ``columns`` over several change sets (types of the first)."""
        first = parts[0]
        schema = StructType([first.schema[c] for c in columns])
        arrays = {}
        for c in columns:
            target = first.table.column(c).type
            chunks = [k.cast(target) for p in parts for k in p.table.column(c).chunks]
            arrays[c] = pa.chunked_array(chunks, target)
        return ChangeSet(first.spark, schema, distinct_rows(pa.table(arrays), columns))


#: Rows on the driver up to this many are worked on in one partition (:func:`one_partition`).
ONE_PARTITION_ROWS = 100_000


def one_partition(frame: DataFrame, rows: int | None) -> DataFrame:
    """``frame`` in a single partition when it holds ``rows`` rows already read to the driver
    (``None``: not on the driver) and they are few (:data:`ONE_PARTITION_ROWS`).

    Spark then folds and joins it without a shuffle. Each shuffle of a query costs a Spark job
    of its own (a query stage), whatever the few rows it moves; in one partition the query is
    one job. Larger or unknown inputs keep their partitions, and their parallelism.
    """
    return frame.coalesce(1) if rows is not None and rows <= ONE_PARTITION_ROWS else frame


#: What a write takes: a lazy frame, or a change set, whose rows are on the driver already (the
#: delta-rs backend writes those as they are, without a Spark frame over them).
Rows = DataFrame | ChangeSet


def frame_of(rows: Rows) -> DataFrame:
    """A Spark frame of ``rows``."""
    return rows.frame if isinstance(rows, ChangeSet) else rows


def spark_frame(spark: SparkSession, table: pa.Table, schema: StructType) -> DataFrame:
    """A Spark frame over the rows of an Arrow table.

    Chunks without rows are dropped first: PySpark 4.2 hands the JVM one record batch per
    chunk, and the rows of every chunk after an empty one went missing (a keyed read that
    skipped row groups came back with 26 of its 2,074 rows). Spark cannot take a table
    without chunks either; an empty one is just its schema.
    """
    if not table.num_rows:
        return spark.createDataFrame([], schema=schema)
    batches = table.to_batches()
    if any(b.num_rows == 0 for b in batches):
        table = pa.Table.from_batches([b for b in batches if b.num_rows], table.schema)
    if any(_holds_null_list(f.type) for f in table.schema):
        # createDataFrame casts the table to the schema's Arrow types, and pyarrow's cast of
        # list<null> to list<null> is broken (see cast_table); from large_list<null> it is not.
        large = pa.schema([f.with_type(_large_null_lists(f.type)).with_nullable(True) for f in table.schema])
        table = cast_table(table, large)
    return spark.createDataFrame(table, schema=schema)


def materialize(df: DataFrame) -> ChangeSet:
    """Run ``df`` once (one Spark job) and return its rows as a :class:`ChangeSet`."""
    return ChangeSet(df.sparkSession, df.schema, to_arrow(df))


def to_arrow(df: DataFrame) -> pa.Table:
    """``df.toArrow()``, safe for void types nested in arrays, structs and maps.

    A column that so far held only ``[]`` or ``[null]`` is ``array<void>``; Spark's Arrow
    writer emits list offsets past the end of a null child for it, and the table fails
    validation. Such columns travel as strings (all null) and are given back their void type
    on the driver.
    """
    if not any(_nested_void(f.dataType) for f in df.schema.fields):
        return df.toArrow()
    safe = df.select(
        *[
            F.col(quote(f.name)).cast(_without_void(f.dataType)).alias(f.name)
            if _nested_void(f.dataType)
            else F.col(quote(f.name))
            for f in df.schema.fields
        ]
    )
    table = safe.toArrow()
    target = arrow_schema(df.schema)
    columns = [_with_type(c.combine_chunks(), t.type) for c, t in zip(table.columns, target, strict=True)]
    return pa.Table.from_arrays(columns, schema=target)


def _has_void(dtype: DataType) -> bool:
    return isinstance(dtype, NullType) or _nested_void(dtype)


def _nested_void(dtype: DataType) -> bool:
    if isinstance(dtype, ArrayType):
        return _has_void(dtype.elementType)
    if isinstance(dtype, MapType):
        return _has_void(dtype.valueType)
    if isinstance(dtype, StructType):
        return any(_has_void(f.dataType) for f in dtype.fields)
    return False


def _without_void(dtype: DataType) -> DataType:
    if isinstance(dtype, NullType):
        return StringType()
    if isinstance(dtype, ArrayType):
        return ArrayType(_without_void(dtype.elementType), True)
    if isinstance(dtype, MapType):
        return MapType(dtype.keyType, _without_void(dtype.valueType), True)
    if isinstance(dtype, StructType):
        return StructType([StructField(f.name, _without_void(f.dataType), True) for f in dtype.fields])
    return dtype


def _with_type(array: pa.Array, target: pa.DataType) -> pa.Array:
    """``array`` rebuilt as ``target``, whose null-typed parts hold only nulls in ``array``.

    Lists and maps are rebuilt from offsets that start at 0 (a slice's offsets do not, and
    pyarrow refuses a validity mask next to them); leaves are cast.
    """
    if pa.types.is_null(target):
        return pa.nulls(len(array))
    mask = array.is_null() if array.null_count else None
    if pa.types.is_list(target) or pa.types.is_large_list(target) or pa.types.is_map(target):
        offsets = array.offsets
        start, end = (offsets[0].as_py(), offsets[-1].as_py()) if len(offsets) else (0, 0)
        rebased = pc.subtract(offsets, pa.scalar(start, offsets.type))
        if pa.types.is_map(target):
            keys = array.keys.slice(start, end - start)
            items = _with_type(array.items.slice(start, end - start), target.item_type)
            return pa.MapArray.from_arrays(rebased, keys, items, type=target, mask=mask)
        values = _with_type(array.values.slice(start, end - start), target.value_type)
        if pa.types.is_large_list(target):
            return pa.LargeListArray.from_arrays(rebased.cast(pa.int64()), values, type=target, mask=mask)
        return pa.ListArray.from_arrays(rebased.cast(pa.int32()), values, type=target, mask=mask)
    if pa.types.is_struct(target):
        children = [_with_type(array.field(i), target.field(i).type) for i in range(target.num_fields)]
        return pa.StructArray.from_arrays(children, fields=list(target), mask=mask)
    return array.cast(target)


def _holds_null_list(data_type: pa.DataType) -> bool:
    """Whether a list (or map) of null-typed values is part of ``data_type``."""
    if pa.types.is_list(data_type) or pa.types.is_large_list(data_type):
        return pa.types.is_null(data_type.value_type) or _holds_null_list(data_type.value_type)
    if pa.types.is_map(data_type):
        return pa.types.is_null(data_type.item_type) or _holds_null_list(data_type.item_type)
    if pa.types.is_struct(data_type):
        return any(_holds_null_list(data_type.field(i).type) for i in range(data_type.num_fields))
    return False


def _large_null_lists(data_type: pa.DataType) -> pa.DataType:
    """``data_type`` with every ``list<null>`` made a ``large_list<null>`` and every nested
    field nullable (Spark's schema, not the table's, says what may be null)."""
    if pa.types.is_list(data_type) or pa.types.is_large_list(data_type):
        if pa.types.is_null(data_type.value_type):
            return pa.large_list(data_type.value_field.with_nullable(True))
        inner = data_type.value_field.with_type(_large_null_lists(data_type.value_type)).with_nullable(True)
        return pa.large_list(inner) if pa.types.is_large_list(data_type) else pa.list_(inner)
    if pa.types.is_map(data_type):
        item = data_type.item_field.with_type(_large_null_lists(data_type.item_type)).with_nullable(True)
        return pa.map_(data_type.key_field, item)
    if pa.types.is_struct(data_type):
        return pa.struct([f.with_type(_large_null_lists(f.type)).with_nullable(True) for f in data_type])
    return data_type


def plain_types(table: pa.Table) -> pa.Table:
    """``table`` with Arrow view types (which pyarrow compute does not all take) made plain."""

    def plain(t: pa.DataType) -> pa.DataType:
        if t == pa.string_view():
            return pa.string()
        if t == pa.binary_view():
            return pa.binary()
        if pa.types.is_struct(t):
            return pa.struct([f.with_type(plain(f.type)) for f in t])
        if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_list_view(t):
            return pa.list_(plain(t.value_type))
        if pa.types.is_map(t):
            return pa.map_(plain(t.key_type), plain(t.item_type))
        return t

    return cast_table(table, pa.schema([f.with_type(plain(f.type)) for f in table.schema]))


def cast_table(rows: Any, schema: pa.Schema) -> Any:
    """``rows.cast(schema)`` for a table or record batch, safe for lists of null-typed values.

    pyarrow 26's cast of ``list<null>`` (even to ``list<null>``) keeps the offsets and shortens
    the values to one per list: an invalid array, which failed the ingest of a batch whose
    array column held only ``[null, null]`` so far. Such columns are rebuilt instead.
    """
    if not any(_holds_null_list(f.type) for f in schema):
        return rows.cast(schema)
    columns = []
    for field in schema:
        column = rows.column(field.name)
        if not _holds_null_list(field.type):
            columns.append(column.cast(field.type))
        elif isinstance(column, pa.ChunkedArray):
            columns.append(pa.chunked_array([_with_type(c, field.type) for c in column.chunks], field.type))
        else:
            columns.append(_with_type(column, field.type))
    if isinstance(rows, pa.RecordBatch):
        return pa.RecordBatch.from_arrays(columns, schema=schema)
    return pa.Table.from_arrays(columns, schema=schema)


def materialize_all(frames: Sequence[DataFrame]) -> list[ChangeSet]:
    """Run several frames as one Spark action and return each one's rows.

    Each frame's columns are packed into a struct column of its own, the frames are unioned
    with a tag saying which one a row belongs to, and the union is collected once; the rows are
    split again on the driver. A step with several outputs (instructions, checked responses,
    silver rows) so pays for one job, not one per output.
    """
    if len(frames) == 1:
        return [materialize(frames[0])]
    # Every field nullable: a row of one frame holds nulls in the other frames' columns. SQL
    # text, so a projection is one round trip to a classic session's JVM, not several a column.
    types = [nullable(f.schema) for f in frames]
    packed = [nullable_struct_sql(f.schema) for f in frames]
    parts = [
        frame.selectExpr(
            f"{i} AS __part",
            *[
                f"{packed[j] if j == i else f'CAST(NULL AS {ddl(types[j])})'} AS __p{j}"
                for j in range(len(frames))
            ],
        )
        for i, frame in enumerate(frames)
    ]
    table = to_arrow(functools.reduce(DataFrame.unionAll, parts))
    out = []
    for i, frame in enumerate(frames):
        mine = table.filter(pc.equal(table.column("__part"), i))
        out.append(
            ChangeSet(frame.sparkSession, frame.schema, rows_of_struct(mine, f"__p{i}", schema=frame.schema))
        )
    return out


def nullable_struct_sql(schema: StructType) -> str:
    """SQL of a struct of every column of ``schema``, each field nullable all the way down:
    ``CASE WHEN`` without ``ELSE`` is nullable (a literal condition would be folded away), and
    the cast to a type without ``NOT NULL`` makes nested fields nullable too."""
    fields = ", ".join(
        f"{sql_string(f.name)}, CASE WHEN {quote(f.name)} IS NOT NULL "
        f"THEN CAST({quote(f.name)} AS {ddl(f.dataType)}) END"
        for f in schema.fields
    )
    return f"named_struct({fields})" if fields else "struct()"


def from_arrow(spark: SparkSession, schema: StructType, table: pa.Table) -> ChangeSet:
    """A :class:`ChangeSet` over ``table``, whose columns are those of ``schema``."""
    return ChangeSet(spark, schema, table)


def arrow_schema(schema: StructType) -> pa.Schema:
    """The Arrow schema of rows of a Spark schema (timestamps as UTC instants)."""
    return _to_arrow_schema(schema, timezone="UTC")


def empty(spark: SparkSession, schema: StructType) -> ChangeSet:
    """A change set without rows."""
    return ChangeSet(spark, schema, arrow_schema(schema).empty_table())


def collect(df: DataFrame) -> pa.Table:
    """Run ``df`` once and keep its rows on it, for a write that is its only other use.

    Unlike :func:`materialize` no new frame is built: ``df`` stays lazy, and the delta-rs
    backend writes the attached rows.
    """
    table = to_arrow(df)
    setattr(df, ARROW_ATTRIBUTE, table)
    return table


def same_values(a: Any, b: Any) -> Any:
    """Per row: the values are equal, as Spark compares keys (NaN equals NaN); null where
    either is null."""
    equal = pc.equal(a, b)
    if pa.types.is_floating(a.type) and pa.types.is_floating(b.type):
        equal = pc.or_(equal, pc.and_(pc.is_nan(a), pc.is_nan(b)))
    return equal


def found_in(table: pa.Table, keys: pa.Table, columns: Sequence[str]) -> pa.Array:
    """Per row of ``table``: whether its ``columns`` equal those of a row of ``keys`` (a null
    part matches nothing)."""
    columns = list(columns)
    numbered = table.select(columns).append_column("__row", pa.array(range(table.num_rows), pa.int64()))
    hits = numbered.join(
        keys.select(columns).cast(numbered.select(columns).schema), keys=columns, join_type="left semi"
    )
    return pc.is_in(
        pa.array(range(table.num_rows), pa.int64()), value_set=hits.column("__row").combine_chunks()
    )


def distinct_rows(table: pa.Table, columns: Sequence[str]) -> pa.Table:
    """The distinct rows of ``table[columns]``."""
    return table.select(list(columns)).group_by(list(columns), use_threads=False).aggregate([])


def rows_of_struct(
    table: pa.Table, column: str, *, where: str | None = None, schema: StructType | None = None
) -> pa.Table:
    """The fields of a struct column as a table of their own, of the rows where ``where`` holds."""
    if where is not None:
        table = table.filter(pc.fill_null(table.column(where), False))
    structs = table.column(column).combine_chunks()
    if len(structs) == 0:
        arrow = arrow_schema(schema) if schema is not None else pa.schema(list(structs.type))
        return arrow.empty_table()
    return pa.Table.from_struct_array(structs)


def as_read(rows: DataFrame, source: DataFrame) -> Rows:
    """``rows``, computed from ``source``, run once onto the driver (:func:`materialize`) where
    ``source`` was read there (a small table: ``Storage.read``), so that the storage can write
    them as a file of its own instead of a Spark query; else ``rows`` as they are."""
    return materialize(rows) if arrow_of(source) is not None else rows


def arrow_of(df: DataFrame) -> pa.Table | None:
    """The Arrow copy a materialized frame carries, or ``None``."""
    table = df.__dict__.get(ARROW_ATTRIBUTE)
    return table if isinstance(table, pa.Table) else None
