"""A source's state rebuilt from its whole bronze table (a full refresh, a first run over many
rows): per key its newest event, as a tombstone when that is a delete or a later truncate
removed it; the table overwritten in key order in one commit, noted as a rebuild
(:mod:`cdc_join.storage.commits`), so a rebuild that did not commit is finished by the next run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import (
    StructField,
    StructType,
)

from cdc_join.changeset import arrow_of, as_read
from cdc_join.columns import (
    DELETED,
    FILE,
    LINE,
    OP,
    RUN,
    SEQ,
    table_properties,
)
from cdc_join.config import PipelineConfig, SourceConfig
from cdc_join.join.state import event_rows, newest, state_schema
from cdc_join.report import Step
from cdc_join.schemas import conform, quote, quoted
from cdc_join.storage import Storage, commits

if TYPE_CHECKING:
    pass


def rebuild_all(
    storage: Storage, config: PipelineConfig, versions: Mapping[str, int], run_id: int, step: Step
) -> tuple[dict[str, int], dict[str, str]]:
    """Every state table rebuilt from its bronze snapshot; the new versions and watermarks."""
    pinned, watermarks = {}, {}
    for name in config.sources:
        with step(f"state:{name}") as counts:
            events = storage.read(config.bronze_path(name), versions[name])
            rows, watermark = rebuild(storage, config.state_path(name), config.sources[name], events, run_id)
            pinned[name] = storage.version(config.state_path(name))
            counts.update(rebuilt=rows)
            if watermark:
                watermarks[name] = watermark
    return pinned, watermarks


def from_events(events: DataFrame, source: SourceConfig, schema: StructType, run_id: int) -> DataFrame:
    """The state a source's complete event history implies: per key its newest event, as a
    tombstone when that is a delete or when a later truncate removed it (lazy).

    Args:
        events: every bronze event of the source (a snapshot of its bronze table).
        schema: the state table's schema (the rows are conformed to it).
        run_id: written to ``_cdc_run``.
    """
    key = list(source.primary_key)
    rows = conform(event_rows(events, source, run_id), schema)
    changes = rows.filter(F.col(OP) != "t")
    arrow = arrow_of(events)
    if arrow is not None and not len(_truncates(arrow)):
        # Events read on the driver, none a truncate: the newest event of each key is its state,
        # folded in one partition (no shuffle, no watermark to apply).
        return newest(changes, key, on_driver=arrow.num_rows)
    truncates = rows.filter(F.col(OP) == "t").select(F.col(SEQ).alias("__w"))
    watermark = truncates.agg(F.max("__w").alias("__w"))
    latest = newest(changes, key).crossJoin(F.broadcast(watermark))
    older = F.col("__w").isNotNull() & ~F.col(DELETED) & (F.col(SEQ) < F.col("__w"))
    return latest.select(
        *[
            F.when(older, _truncated_value(f, key, run_id)).otherwise(F.col(quote(f.name))).alias(f.name)
            for f in schema.fields
        ]
    )


def rebuild(
    storage: Storage, path: str, source: SourceConfig, events: DataFrame, run_id: int
) -> tuple[int, str | None]:
    """Overwrite the state table with :func:`from_events` of a bronze snapshot, in key order:
    one commit, so readers see the old table or the new one.

    Returns the rows written and the watermark (the greatest truncate sequence).
    """
    row_type = events.schema["_after"].dataType
    assert isinstance(row_type, StructType)
    schema = state_schema(row_type)
    if not storage.create(path, schema, cdf=False, properties=table_properties("state")):
        storage.evolve(path, schema)
    schema = storage.schema(path)
    rows = from_events(events, source, schema, run_id)
    ordered = as_read(rows.orderBy(*quoted(source.primary_key)), events)
    written = storage.overwrite(path, ordered, note=commits.REBUILD)
    return written.rows_inserted or 0, _watermark(events)


def _watermark(events: DataFrame) -> str | None:
    """The greatest truncate sequence of a bronze snapshot: from its rows on the driver where
    the storage read them there (no Spark job), else one job."""
    arrow = arrow_of(events)
    if arrow is not None:
        truncates = _truncates(arrow)
        return pc.max(truncates).as_py() if len(truncates) else None
    found = events.filter(F.col("_op") == "t").agg(F.max("_seq").alias("w")).first()
    return found["w"] if found is not None else None


def _truncates(events: pa.Table) -> pa.ChunkedArray:
    """The sequences of the truncates among bronze events on the driver."""
    return events.filter(pc.fill_null(pc.equal(events.column("_op"), "t"), False)).column("_seq")


def _truncated_value(field: StructField, key: list[str], run_id: int) -> Column:
    """One column of the tombstone a truncate at ``__w`` leaves (see :func:`_tombstone`)."""
    meta: dict[str, Column] = {
        SEQ: F.col("__w"),
        FILE: F.lit(""),
        LINE: F.lit(0),
        OP: F.lit("t"),
        DELETED: F.lit(True),
        RUN: F.lit(run_id),
    }
    if field.name in meta:
        return meta[field.name].cast(field.dataType)
    if field.name in key:
        return F.col(quote(field.name))
    return F.lit(None).cast(field.dataType)
