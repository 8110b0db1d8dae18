"""Change sets materialized once per step: an Arrow copy on the driver and a Spark frame over it.

Every step of a run builds on the previous step's DataFrame. Left lazy, the silver MERGE
source's plan would hold every read, join and filter of the run: Catalyst re-analyses and
re-optimizes that whole tree for each action (seconds per action once a run has a few dozen
joins, whatever the data size), and each action re-runs the reads. Materializing at step
boundaries keeps every plan small and every read single. The Arrow copy also gives counts,
per-value counts and the key lists that drive file pruning without another Spark job, and
the delta-rs backend MERGEs it as is instead of collecting the frame again.

Only change-set-sized data goes through here (changed keys, instructions, responses, the rows
a run writes), never a whole table; that is what keeps a run's memory bounded by its changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame

#: Attribute under which a materialized frame carries its Arrow copy (read by the delta-rs
#: backend, which would otherwise collect the frame to Arrow a second time).
ARROW_ATTRIBUTE = "_cdc_join_arrow"


class ChangeSet:
    """A small DataFrame's rows, held on the driver as Arrow, and a Spark frame over them.

    The frame is built on first use, so a change set only counted or inspected on the driver
    never pays for ``createDataFrame``.
    """

    def __init__(self, like: DataFrame, table: pa.Table) -> None:
        self._like = like
        self.table = table
        self._frame: DataFrame | None = None

    @property
    def frame(self) -> DataFrame:
        if self._frame is None:
            frame = self._like.sparkSession.createDataFrame(self.table, schema=self._like.schema)
            setattr(frame, ARROW_ATTRIBUTE, self.table)
            self._frame = frame
        return self._frame

    @property
    def rows(self) -> int:
        return self.table.num_rows

    def distinct(self, columns: Sequence[str]) -> ChangeSet:
        """The distinct rows of some columns, as a change set of their own."""
        return ChangeSet(self._like.select(*columns), distinct_rows(self.table, columns))

    def values(self, column: str) -> list[Any]:
        """Distinct non-null values of one column (e.g. the keys that drive file pruning)."""
        return [v for v in pc.unique(self.table[column]).to_pylist() if v is not None]

    def value_counts(self, column: str) -> dict[Any, int]:
        """Rows per value of one column."""
        counts = pc.value_counts(self.table[column]).to_pylist()
        return {c["values"]: c["counts"] for c in counts}

    def count_true(self, column: str) -> int:
        """Rows whose boolean ``column`` is true."""
        return int(pc.sum(pc.cast(pc.fill_null(self.table[column], False), pa.int64())).as_py() or 0)


def materialize(df: DataFrame) -> ChangeSet:
    """Run ``df`` once (one Spark job) and return its rows as a :class:`ChangeSet`."""
    return from_arrow(df, df.toArrow())


def collect(df: DataFrame) -> pa.Table:
    """Run ``df`` once and keep its rows on it, for a MERGE that is its only other use.

    Unlike :func:`materialize` no new frame is built (``createDataFrame`` costs seconds per
    million rows): ``df`` stays lazy, and the delta-rs backend MERGEs the attached rows.
    """
    table = df.toArrow()
    setattr(df, ARROW_ATTRIBUTE, table)
    return table


def from_arrow(like: DataFrame, table: pa.Table) -> ChangeSet:
    """A :class:`ChangeSet` over ``table``, whose columns are those of ``like``."""
    return ChangeSet(like, table)


def distinct_rows(table: pa.Table, columns: Sequence[str]) -> pa.Table:
    """The distinct rows of ``table[columns]``."""
    return table.select(list(columns)).group_by(list(columns)).aggregate([])


def arrow_of(df: DataFrame) -> pa.Table | None:
    """The Arrow copy a materialized frame carries, or ``None``."""
    table = df.__dict__.get(ARROW_ATTRIBUTE)
    return table if isinstance(table, pa.Table) else None
