"""Idempotent MERGE of joined rows into the silver table (KIP-213's output KTable).

Silver is keyed by the left primary key (``_pk_*`` metadata columns, so the key is there even
when the select list does not carry it). A row is inserted when new, updated only when one of
its data columns differs (lineage columns alone do not cause a rewrite), and deleted when the
resolve step says so. Applying the same rows twice changes nothing, which is what a rerun after
a crash does. Change Data Feed is on, so downstream jobs can read silver incrementally.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import MapType

from cdc_join.config import PipelineConfig
from cdc_join.maintenance import table_properties
from cdc_join.resolve import ACTION, output_columns, silver_key_columns
from cdc_join.storage import MergeSpec, Storage


@dataclass(frozen=True)
class SilverReport:
    """What a silver MERGE did."""

    inserted: int
    updated: int
    deleted: int
    files_added: int | None
    files_removed: int | None
    version: int
    rows_written: int | None = None
    """Rows in the data files the MERGE wrote: inserted and updated rows, plus the unchanged
    rows copied out of every file it rewrote (Delta rewrites whole files; ``None`` if unknown)."""


def merge_into_silver(storage: Storage, config: PipelineConfig, rows: DataFrame) -> SilverReport:
    """Apply :func:`cdc_join.resolve.build_rows` output to silver (created on first use).

    Args:
        storage: the storage seam.
        config: the pipeline.
        rows: upserts and deletes with an ``_action`` column.

    Returns:
        Row and file counts of the MERGE.
    """
    path = config.silver_path
    if not storage.create(path, rows.drop(ACTION).schema, cdf=True, properties=table_properties("silver")):
        storage.evolve(path, rows.drop(ACTION).schema)
    keys = silver_key_columns(config)
    changed = " OR ".join(f"(t.`{c}` IS DISTINCT FROM s.`{c}`)" for c in output_columns(config))
    metrics = storage.merge(
        path,
        rows,
        MergeSpec(
            on=" AND ".join(f"t.`{c}` = s.`{c}`" for c in keys),
            delete_condition=f"s.{ACTION} = 'delete'",
            update_condition=f"s.{ACTION} = 'upsert' AND ({changed})",
            insert_condition=f"s.{ACTION} = 'upsert'",
            exclude_columns=(ACTION,),
            merge_schema=True,
        ),
    )
    raw = metrics.extra.get("metrics") or {}
    # delta-rs and delta-spark name the copied-rows metric differently.
    copied = raw.get("num_target_rows_copied", raw.get("numTargetRowsCopied"))
    inserted, updated = metrics.rows_inserted or 0, metrics.rows_updated or 0
    return SilverReport(
        inserted=inserted,
        updated=updated,
        deleted=metrics.rows_deleted or 0,
        files_added=metrics.files_added,
        files_removed=metrics.files_removed,
        version=metrics.version,
        rows_written=None if copied is None else inserted + updated + int(copied),
    )


def only_changes(storage: Storage, config: PipelineConfig, rows: DataFrame) -> DataFrame:
    """The rows of ``rows`` that change silver: new or different upserts, deletes of present keys.

    A recompute builds a row for every left key; MERGEing them all would make the MERGE join and
    rewrite the whole table for every run. Comparing with silver in Spark first (one join on
    the key) leaves a MERGE of the real changes only. The kept rows are exactly those the
    MERGE of :func:`merge_into_silver` would act on, so the result is the same.

    Falls back to ``rows`` unchanged when silver does not exist yet, lacks one of the output
    columns (the select list grew), or has a map column (maps cannot be compared in Spark).
    """
    path = config.silver_path
    if not storage.exists(path):
        return rows
    silver = storage.read(path)
    keys, columns = silver_key_columns(config), output_columns(config)
    have = {f.name: f.dataType for f in silver.schema.fields}
    if any(c not in have or isinstance(have[c], MapType) for c in columns):
        return rows
    current = silver.select(
        *[F.col(f"`{k}`") for k in keys],
        F.lit(True).alias("__present"),
        *[F.col(f"`{c}`").alias(f"__silver_{i}") for i, c in enumerate(columns)],
    )
    joined = rows.join(current, keys, "left")
    present = F.col("__present").isNotNull()
    differs = functools.reduce(
        operator.or_,
        [~F.col(f"`{c}`").eqNullSafe(F.col(f"__silver_{i}")) for i, c in enumerate(columns)],
        F.lit(False),
    )
    keep = F.when(F.col(ACTION) == "delete", present).otherwise(~present | differs)
    return joined.filter(keep).select(*[F.col(f"`{c}`") for c in rows.columns])
