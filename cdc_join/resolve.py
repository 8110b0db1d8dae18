"""Responses → joined silver rows or deletes, after the KIP-213 stale check.

A response was computed for some left value (its fk and lhs hash). It is applied only if that
is still the current left value: the left row is live, its fk equals the response's fk and its
hash equals the response's hash. Anything else is stale — a left row that moved on after the
subscription was read, a leftover subscription of a crashed run — and is dropped and counted;
the current left value has (or will get) its own response. A ``DELETE_KEY_AND_PROPAGATE``
response is current when the left row is gone.

Rows are then built for every left key with a valid response: the left row, plus per join the
response's right row, or — for a join that sent no response for that key — the right row its
current fk names. The same builder makes the from-scratch join that full refresh and verify use,
so both paths share one definition of the output (DESIGN.md §2).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Mapping
from dataclasses import dataclass

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from cdc_join.config import JoinConfig, JoinType, PipelineConfig
from cdc_join.lookup import PROPAGATE_IF_NULL, RIGHT, RIGHT_SEQ
from cdc_join.state import DELETED, HASH, SEQ, value_fields
from cdc_join.subscription import INSTRUCTION, LHS_HASH, Instruction, fk_columns, pk_columns

ACTION = "_action"
RUN_ID = "_run_id"
STALE = "_stale"
ORPHAN = "_orphan"


@dataclass(frozen=True)
class CheckedResponses:
    """Responses of one join split by the stale check."""

    valid: DataFrame
    stale: DataFrame


def check_responses(
    responses: DataFrame, left_state: DataFrame, config: PipelineConfig, join: JoinConfig
) -> CheckedResponses:
    """Compare each response with the current left row (fk and hash); split valid from stale.

    Args:
        responses: ``pk_*, fk_*, _lhs_hash, _instruction, _right, _right_seq, _propagate_if_null``.
        left_state: the left state rows (tombstones included) for at least the responses' keys.

    Returns:
        Valid responses that propagate (``pk_*, _right, _right_seq``), and stale ones
        (``pk_*, fk_*, _lhs_hash, _origin``).
    """
    return split_checked(flag_responses(responses, left_state, config, join).cache(), config, join)


def flag_responses(
    responses: DataFrame, left_state: DataFrame, config: PipelineConfig, join: JoinConfig
) -> DataFrame:
    """The responses with ``_stale`` and ``_orphan`` flags (see :func:`check_responses`)."""
    left = config.left_source
    pks = pk_columns(left)
    current = left_state.select(
        *[F.col(f"`{c}`").alias(f"pk_{c}") for c in left.primary_key],
        *[F.col(f"`{c}`").alias(f"cur_{c}") for c in join.foreign_key],
        F.col(HASH).alias("cur_hash"),
        F.col(DELETED).alias("cur_deleted"),
    )
    joined = responses.join(current, pks, "left")
    gone = F.col("cur_deleted").isNull() | F.col("cur_deleted")
    is_delete = F.col(INSTRUCTION) == Instruction.DELETE_KEY_AND_PROPAGATE.value
    same_fk = F.lit(True)
    for c in join.foreign_key:
        same_fk = same_fk & F.col(f"fk_{c}").eqNullSafe(F.col(f"cur_{c}"))
    current_value = ~gone & same_fk & F.col(LHS_HASH).eqNullSafe(F.col("cur_hash"))
    valid_flag = F.when(is_delete, gone).otherwise(F.coalesce(current_value, F.lit(False)))
    return joined.withColumn(STALE, ~valid_flag).withColumn(ORPHAN, gone | ~same_fk)


def split_checked(checked: DataFrame, config: PipelineConfig, join: JoinConfig) -> CheckedResponses:
    """Valid (propagating) and stale responses of :func:`flag_responses` output."""
    pks = pk_columns(config.left_source)
    valid = checked.filter(~F.col(STALE) & (F.col(RIGHT).isNotNull() | F.col(PROPAGATE_IF_NULL)))
    return CheckedResponses(
        valid=valid.select(*pks, RIGHT, RIGHT_SEQ),
        stale=checked.filter(F.col(STALE)).select(*pks, *fk_columns(join), LHS_HASH, "_origin", ORPHAN),
    )


def left_struct(config: PipelineConfig, left_state: DataFrame) -> DataFrame:
    """Left state rows as ``pk_*, <left alias> struct, _seq_<left>, _cdc_deleted``."""
    left = config.left_source
    values = value_fields(left_state.schema)
    return left_state.select(
        *[F.col(f"`{c}`").alias(f"pk_{c}") for c in left.primary_key],
        F.struct(*[F.col(f"`{f.name}`") for f in values]).alias(config.left),
        F.col(SEQ).alias(f"_seq_{config.left}"),
        F.col(DELETED),
    )


def build_rows(
    config: PipelineConfig,
    left_rows: DataFrame,
    right_by_alias: Mapping[str, DataFrame],
    run_id: int,
) -> DataFrame:
    """Joined output rows for the given left keys, as upserts and deletes.

    Args:
        left_rows: :func:`left_struct` rows of the affected keys (tombstones included).
        right_by_alias: per join alias, ``pk_*, _right, _right_seq`` for the affected keys
            that have a right row (keys without one get nulls).
        run_id: the run writing the rows (lineage).

    Returns:
        ``_pk_*``, the select columns, ``_seq_<alias>`` per source alias, ``_run_id`` and
        ``_action`` (``upsert``/``delete``).
    """
    pks = pk_columns(config.left_source)
    rows = left_rows
    for join in config.joins:
        right = right_by_alias[join.alias].select(
            *pks, F.col(RIGHT).alias(join.alias), F.col(RIGHT_SEQ).alias(f"_seq_{join.alias}")
        )
        rows = rows.join(right, pks, "left")
    return _output_rows(config, rows, run_id)


def build_rows_by_fk(
    config: PipelineConfig,
    left_rows: DataFrame,
    right_rows: Mapping[str, DataFrame],
    run_id: int,
) -> DataFrame:
    """Like :func:`build_rows` for every left row at once (a recompute): joined on the fk.

    :func:`build_rows` attaches right rows by left key, which suits a change set. For the whole
    left table that would mean one left-key-sized join per join; joining each right table on
    the fk instead is one join with the (usually much smaller) right table.

    Args:
        left_rows: :func:`left_struct` rows of every left key (tombstones included).
        right_rows: per join alias, every live right row as ``fk_*, _right, _right_seq``
            (:func:`cdc_join.lookup.all_right_rows`).
        run_id: the run writing the rows (lineage).
    """
    rows = left_rows
    for join in config.joins:
        fks = fk_columns(join)
        keys = [f"__{join.alias}__{f}" for f in fks]
        right = right_rows[join.alias].select(
            *[F.col(f).alias(k) for f, k in zip(fks, keys, strict=True)],
            F.col(RIGHT).alias(join.alias),
            F.col(RIGHT_SEQ).alias(f"_seq_{join.alias}"),
        )
        on = functools.reduce(
            operator.and_,
            [F.col(f"{config.left}.`{c}`") == F.col(k) for c, k in zip(join.foreign_key, keys, strict=True)],
        )
        rows = rows.join(right, on, "left").drop(*keys)
    return _output_rows(config, rows, run_id)


def _output_rows(config: PipelineConfig, rows: DataFrame, run_id: int) -> DataFrame:
    """Silver rows from left rows carrying one struct (or null) and ``_seq_`` column per join."""
    pks = pk_columns(config.left_source)
    missing_inner: Column = F.lit(False)
    for join in config.joins:
        if join.type is JoinType.INNER:
            missing_inner = missing_inner | F.col(join.alias).isNull()
    action = F.when(F.col(DELETED) | missing_inner, F.lit("delete")).otherwise(F.lit("upsert"))
    selected = [F.expr(expr).alias(name) for name, expr in config.select]
    aliases = [config.left, *(j.alias for j in config.joins)]
    return rows.select(
        *[F.col(c).alias(f"_{c}") for c in pks],
        *selected,
        *[F.col(f"_seq_{a}") for a in aliases],
        F.lit(run_id).cast("long").alias(RUN_ID),
        action.alias(ACTION),
    )


def output_columns(config: PipelineConfig) -> list[str]:
    """The silver columns that carry data (compared to decide whether a row changed)."""
    return [name for name, _ in config.select]


def silver_key_columns(config: PipelineConfig) -> list[str]:
    """Silver's merge key: the left primary key as ``_pk_*`` metadata columns."""
    return [f"_pk_{c}" for c in config.left_source.primary_key]
