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

from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import StructField, StructType

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
            # Spark cannot take an Arrow table without chunks; an empty one is just its schema.
            rows = self.table if self.table.num_rows else []
            frame = self.spark.createDataFrame(rows, schema=self.schema)
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


def materialize(df: DataFrame) -> ChangeSet:
    """Run ``df`` once (one Spark job) and return its rows as a :class:`ChangeSet`."""
    return ChangeSet(df.sparkSession, df.schema, df.toArrow())


def from_arrow(spark: SparkSession, schema: StructType, table: pa.Table) -> ChangeSet:
    """A :class:`ChangeSet` over ``table``, whose columns are those of ``schema``."""
    return ChangeSet(spark, schema, table)


def empty(spark: SparkSession, schema: StructType) -> ChangeSet:
    """A change set without rows."""
    return ChangeSet(spark, schema, to_arrow_schema(schema).empty_table())


def collect(df: DataFrame) -> pa.Table:
    """Run ``df`` once and keep its rows on it, for a write that is its only other use.

    Unlike :func:`materialize` no new frame is built: ``df`` stays lazy, and the delta-rs
    backend writes the attached rows.
    """
    table = df.toArrow()
    setattr(df, ARROW_ATTRIBUTE, table)
    return table


def distinct_rows(table: pa.Table, columns: Sequence[str]) -> pa.Table:
    """The distinct rows of ``table[columns]``."""
    return table.select(list(columns)).group_by(list(columns), use_threads=False).aggregate([])


def rows_of_struct(table: pa.Table, column: str, *, where: str | None = None) -> pa.Table:
    """The fields of a struct column as a table of their own, of the rows where ``where`` holds."""
    if where is not None:
        table = table.filter(pc.fill_null(table.column(where), False))
    structs = table.column(column).combine_chunks()
    if len(structs) == 0:
        return pa.Table.from_batches([], pa.schema(list(structs.type)))
    return pa.Table.from_struct_array(structs)


def arrow_of(df: DataFrame) -> pa.Table | None:
    """The Arrow copy a materialized frame carries, or ``None``."""
    table = df.__dict__.get(ARROW_ATTRIBUTE)
    return table if isinstance(table, pa.Table) else None
