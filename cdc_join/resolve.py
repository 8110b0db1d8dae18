"""Responses → the left keys to recompute, after the KIP-213 stale check; keys → silver rows.

A response was computed for some left value (its fk and lhs hash). It counts only if that is
still the current left value: the left row is live, its foreign key equals the response's and
its hash equals the response's. Anything else is stale — a left row that moved on after the
subscription was read, a leftover subscription of a crashed run — and is dropped and counted;
the current left value has (or will get) its own response. A ``DELETE_KEY_AND_PROPAGATE``
response is current when the left row is gone. Foreign keys compare in normalized form
(:func:`cdc_join.subscription.normalized_fk`), so a key with a null part is "no key" on both
sides.

Rows are then built (:func:`build_rows`) for the affected keys from the current left row and,
per join, the current right row its foreign key names: the same builder makes every silver row,
whether a run recomputes a few keys or the whole join.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Mapping
from dataclasses import dataclass

import pyarrow.compute as pc
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from cdc_join import lookup, state
from cdc_join.changeset import ChangeSet, collect, materialize
from cdc_join.config import JoinConfig, JoinType, PipelineConfig
from cdc_join.lookup import ORIGIN, PROPAGATES, RIGHT, RIGHT_SEQ
from cdc_join.schemas import quote, quoted
from cdc_join.state import value_fields
from cdc_join.storage import Storage
from cdc_join.subscription import INSTRUCTION, Instruction, normalized_fk
from cdc_join.tables import (
    ACTION,
    DELETED,
    HASH,
    LHS_HASH,
    RUN_ID,
    SEQ,
    fk_columns,
    lineage_column,
    pk_columns,
)

STALE = "_stale"
ORPHAN = "_orphan"


def check(responses: DataFrame, left_rows: DataFrame, config: PipelineConfig, join: JoinConfig) -> DataFrame:
    """The responses of one join with ``_stale`` and ``_orphan`` flags.

    Args:
        responses: ``pk_*, fk_*, _lhs_hash, _instruction, _propagates, _origin``.
        left_rows: current left state rows (tombstones included) of at least the responses' keys.

    ``_orphan`` marks a response whose left row is gone or has another foreign key: if it came
    from a subscription, that subscription is a leftover to remove.
    """
    left = config.left_source
    pks = pk_columns(left)
    current = left_rows.select(
        *[F.col(quote(c)).alias(p) for c, p in zip(left.primary_key, pks, strict=True)],
        F.col(HASH).alias("__hash"),
        F.col(DELETED).alias("__deleted"),
        F.struct(*quoted(left_rows.columns)).alias("__row"),
    ).select(*pks, "__hash", "__deleted", normalized_fk("__row", join).alias("__fk"))
    response_fk = _fk_struct(join)
    joined = responses.join(current, pks, "left")
    gone = F.col("__deleted").isNull() | F.col("__deleted")
    same_fk = response_fk.eqNullSafe(F.col("__fk"))
    is_current = ~gone & same_fk & F.col(LHS_HASH).eqNullSafe(F.col("__hash"))
    is_delete = F.col(INSTRUCTION) == Instruction.DELETE_KEY_AND_PROPAGATE.value
    valid = F.when(is_delete, gone).otherwise(F.coalesce(is_current, F.lit(False)))
    return joined.select(*responses.columns, (~valid).alias(STALE), (gone | ~same_fk).alias(ORPHAN))


def _fk_struct(join: JoinConfig) -> Column:
    """A response's ``fk_*`` columns as one struct (null when the response has no fk)."""
    fks = fk_columns(join)
    present = functools.reduce(operator.and_, [F.col(f).isNotNull() for f in fks])
    return F.when(present, F.struct(*[F.col(f) for f in fks]))


def affected(checked: DataFrame, config: PipelineConfig) -> DataFrame:
    """``pk_*`` of the valid responses that propagate: the left keys whose row to rebuild."""
    keep = ~F.col(STALE) & F.col(PROPAGATES)
    return checked.filter(keep).select(*pk_columns(config.left_source))


def orphans(checked: DataFrame, join: JoinConfig, config: PipelineConfig) -> DataFrame:
    """``fk_*, pk_*`` of leftover subscriptions: stale right-driven responses, orphaned."""
    leftover = F.col(STALE) & F.col(ORPHAN) & (F.col(ORIGIN) == "right")
    return checked.filter(leftover).select(*fk_columns(join), *pk_columns(config.left_source))


def build_rows(
    config: PipelineConfig,
    left_rows: DataFrame,
    right_rows: Mapping[str, DataFrame],
    run_id: int,
) -> DataFrame:
    """Silver rows (upserts and deletes) for left keys, joined to each right table on the fk.

    Args:
        left_rows: current left state rows, tombstones included (a tombstone makes a delete).
        right_rows: per join alias, live right rows as ``fk_*, _right, _right_seq``
            (:func:`cdc_join.lookup.right_rows`): those the left rows' keys name, or all.
        run_id: the run writing the rows (lineage).

    Returns:
        ``_pk_*``, the select columns, ``_seq_<alias>`` per source alias, ``_run_id`` and
        ``_action`` (``upsert``/``delete``). A foreign key with a null part matches no row.
    """
    left = config.left_source
    values = [quote(f.name) for f in value_fields(left_rows.schema)]
    rows = left_rows.select(
        *[F.col(quote(c)).alias(p) for c, p in zip(left.primary_key, pk_columns(left), strict=True)],
        F.struct(*values).alias(config.left),
        F.col(SEQ).alias(lineage_column(config.left)),
        F.col(DELETED),
    )
    for join in config.joins:
        rows = _join_right(rows, config, join, right_rows[join.alias])
    return _output(config, rows, run_id)


def _join_right(rows: DataFrame, config: PipelineConfig, join: JoinConfig, right: DataFrame) -> DataFrame:
    keys = [f"__{join.alias}__{f}" for f in fk_columns(join)]
    renamed = right.select(
        *[F.col(f).alias(k) for f, k in zip(fk_columns(join), keys, strict=True)],
        F.col(RIGHT).alias(join.alias),
        F.col(RIGHT_SEQ).alias(lineage_column(join.alias)),
    )
    on = functools.reduce(
        operator.and_,
        [F.col(f"{config.left}.{quote(c)}") == F.col(k) for c, k in zip(join.foreign_key, keys, strict=True)],
    )
    return rows.join(renamed, on, "left").drop(*keys)


def _output(config: PipelineConfig, rows: DataFrame, run_id: int) -> DataFrame:
    """Silver rows from rows carrying one struct (or null) and one lineage column per alias."""
    missing_inner: Column = F.lit(False)
    for join in config.joins:
        if join.type is JoinType.INNER:
            missing_inner = missing_inner | F.col(join.alias).isNull()
    action = F.when(F.col(DELETED) | missing_inner, F.lit("delete")).otherwise(F.lit("upsert"))
    aliases = [config.left, *(j.alias for j in config.joins)]
    return rows.select(
        *[F.col(p).alias(f"_{p}") for p in pk_columns(config.left_source)],
        *[F.expr(expr).alias(name) for name, expr in config.select],
        *[F.col(lineage_column(a)) for a in aliases],
        F.lit(run_id).cast("long").alias(RUN_ID),
        action.alias(ACTION),
    )


@dataclass(frozen=True)
class Resolved:
    """What the stale check kept: silver rows of the affected keys (``None``: no key), counts,
    and per join the leftover subscriptions to remove."""

    rows: DataFrame | None
    affected_keys: int
    stale_dropped: int
    orphans: Mapping[str, DataFrame]


def resolve(
    storage: Storage,
    config: PipelineConfig,
    responses: Mapping[str, ChangeSet | None],
    pinned: Mapping[str, int],
    run_id: int,
) -> Resolved:
    """Stale-check every join's responses against the current left rows, then build the silver
    rows of the affected keys from the current left row and the right rows its fks name."""
    left = config.left_source
    present = {alias: found for alias, found in responses.items() if found is not None and found.rows}
    if not present:
        return Resolved(None, 0, 0, {})
    pks = pk_columns(left)
    keys = ChangeSet.concat(list(present.values()), pks).renamed(
        dict(zip(pks, left.primary_key, strict=True))
    )
    left_rows = materialize(
        state.read_current(
            storage, config.state_path(config.left), left.primary_key, pinned[config.left], keys=keys
        )
    )
    stale, affected, orphaned = 0, [], {}
    for join in config.joins:
        if join.alias not in present:
            continue
        checked = materialize(check(present[join.alias].frame, left_rows.frame, config, join))
        stale += checked.count_true(STALE)
        kept = pc.and_(
            pc.invert(pc.fill_null(checked.table.column(STALE), True)),
            pc.fill_null(checked.table.column(PROPAGATES), False),
        )
        affected.append(checked.filtered(kept).distinct(pks))
        orphaned[join.alias] = orphans(checked.frame, join, config)
    keys = ChangeSet.concat(affected, pks) if affected else None
    if keys is None or not keys.rows:
        return Resolved(None, 0, stale, orphaned)
    named = keys.renamed(dict(zip(pks, left.primary_key, strict=True)))
    in_scope = left_rows.frame.join(named.frame, list(left.primary_key), "left_semi")
    scoped = materialize(in_scope)
    rows = build_rows(config, scoped.frame, _right_rows_named_by(storage, config, scoped, pinned), run_id)
    collect(rows)
    return Resolved(rows, keys.rows, stale, orphaned)


def _right_rows_named_by(
    storage: Storage, config: PipelineConfig, left_rows: ChangeSet, pinned: Mapping[str, int]
) -> dict[str, DataFrame]:
    """Per join, the live right rows the left rows' foreign keys name (keyed reads)."""
    found = {}
    for join in config.joins:
        fks = left_rows.distinct(list(join.foreign_key)).renamed(
            dict(zip(join.foreign_key, fk_columns(join), strict=True))
        )
        right = config.sources[join.right]
        found[join.alias] = lookup.right_rows(
            storage, config.state_path(join.right), pinned[join.right], right, join, fks
        )
    return found


def recompute(storage: Storage, config: PipelineConfig, pinned: Mapping[str, int], run_id: int) -> DataFrame:
    """Silver rows of every left key: the whole join of the pinned state tables."""
    left = config.left_source
    left_rows = state.read_current(
        storage, config.state_path(config.left), left.primary_key, pinned[config.left]
    )
    right = {
        join.alias: lookup.right_rows(
            storage, config.state_path(join.right), pinned[join.right], config.sources[join.right], join, None
        )
        for join in config.joins
    }
    return build_rows(config, left_rows, right, run_id)
