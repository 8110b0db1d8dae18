"""Changes → responses (KIP-213 SubscriptionResponseWrapper): which left keys to recompute.

Two paths produce responses ``(pk, fk, lhs hash, instruction, propagates, origin)``:

- left-driven: each instruction that propagates looks up its new fk in the right state; it
  propagates when the right row exists or the instruction propagates a null
  (``PROPAGATE_ONLY_IF_FK_VAL_AVAILABLE`` with no right row changes nothing);
- right-driven: each changed right key finds its subscribers with a prefix-range read of the
  subscription table (:func:`cdc_join.subscription.current`), the batch form of RocksDB's
  prefix scan on ``CombinedKey(fk, pk)``; each subscriber's row must be recomputed.

Every keyed read skips files by statistics (:mod:`cdc_join.storage.pruning`); the subscription
table is clustered by fk, so a few changed right keys read a few files.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import pyarrow.compute as pc
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import BooleanType, StringType

from cdc_join import state, subscription
from cdc_join.changeset import ChangeSet, materialize
from cdc_join.config import JoinConfig, PipelineConfig, SourceConfig
from cdc_join.schemas import quote
from cdc_join.storage import Storage
from cdc_join.storage.pruning import ScanStats
from cdc_join.subscription import INSTRUCTION, Instruction
from cdc_join.tables import DELETED, LHS_HASH, SEQ, fk_columns, pk_columns

RIGHT = "_right"
RIGHT_SEQ = "_right_seq"
PROPAGATES = "_propagates"
ORIGIN = "_origin"


def right_rows(
    storage: Storage,
    path: str,
    version: int | None,
    right: SourceConfig,
    join: JoinConfig,
    fks: ChangeSet | None,
) -> DataFrame:
    """Live current right rows as ``fk_*, _right (struct of values), _right_seq``.

    With ``fks`` (a change set with the join's ``fk_*`` columns) only the rows those keys name
    are read, skipping files; without, every row (a recompute).
    """
    on = list(zip(right.primary_key, fk_columns(join), strict=True))
    rows = state.read_current(storage, path, right.primary_key, version, keys=fks, on=on if fks else None)
    live = rows.filter(~F.col(DELETED))
    values = state.value_fields(live.schema)
    return live.select(
        *[F.col(quote(pk)).alias(fk) for pk, fk in on],
        F.struct(*[F.col(quote(f.name)) for f in values]).alias(RIGHT),
        F.col(SEQ).alias(RIGHT_SEQ),
    )


def left_driven(
    storage: Storage,
    right_path: str,
    right_version: int,
    messages: ChangeSet,
    left: SourceConfig,
    join: JoinConfig,
    right: SourceConfig,
) -> DataFrame:
    """Responses to the instructions that propagate (all but ``DELETE_KEY_NO_PROPAGATE``)."""
    fks = fk_columns(join)
    propagating = messages.frame.filter(F.col(INSTRUCTION) != Instruction.DELETE_KEY_NO_PROPAGATE.value)
    keyed = messages.filtered(
        pc.not_equal(messages.table.column(INSTRUCTION), Instruction.DELETE_KEY_NO_PROPAGATE.value)
    ).distinct(fks)
    found = right_rows(storage, right_path, right_version, right, join, keyed).select(*fks).distinct()
    hit = F.col("__hit").isNotNull()
    responses = propagating.join(found.withColumn("__hit", F.lit(True)), fks, "left")
    propagates = hit | (F.col(INSTRUCTION) != Instruction.PROPAGATE_ONLY_IF_FK_VAL_AVAILABLE.value)
    return responses.select(
        *pk_columns(left),
        *fks,
        F.col(LHS_HASH),
        F.col(INSTRUCTION),
        propagates.alias(PROPAGATES),
        F.lit("left").alias(ORIGIN),
    )


def right_driven(
    storage: Storage,
    subscription_path: str,
    subscription_version: int,
    changed_keys: ChangeSet,
    left: SourceConfig,
    join: JoinConfig,
) -> tuple[DataFrame, ScanStats]:
    """Responses for every subscriber of a changed right key (``changed_keys``: ``fk_*``)."""
    subscribers, stats = subscription.current(
        storage, subscription_path, join, left, subscription_version, changed_keys
    )
    responses = subscribers.select(
        *pk_columns(left),
        *fk_columns(join),
        F.col(LHS_HASH),
        F.lit(None).cast(StringType()).alias(INSTRUCTION),
        F.lit(True).cast(BooleanType()).alias(PROPAGATES),
        F.lit("right").alias(ORIGIN),
    )
    return responses, stats


def changed_right_keys(changes: ChangeSet, right: SourceConfig, join: JoinConfig) -> ChangeSet:
    """The changed keys of a right source, renamed to the join's ``fk_*`` columns."""
    names = dict(zip(right.primary_key, fk_columns(join), strict=True))
    return changes.distinct(list(right.primary_key)).renamed(names)


def responses(
    storage: Storage,
    config: PipelineConfig,
    join: JoinConfig,
    messages: ChangeSet | None,
    changed_right: ChangeSet | None,
    pinned: Mapping[str, int],
    subscription_version: int,
) -> tuple[ChangeSet | None, dict[str, int]]:
    """All responses of one join in a run (materialized), and the lookup's scan counts."""
    left, right = config.left_source, config.sources[join.right]
    parts = []
    if messages is not None and messages.rows:
        parts.append(
            left_driven(
                storage, config.state_path(join.right), pinned[join.right], messages, left, join, right
            )
        )
    stats = ScanStats(0, 0)
    if changed_right is not None and changed_right.rows:
        from_right, stats = right_driven(
            storage, config.subscription_path(join), subscription_version, changed_right, left, join
        )
        parts.append(from_right)
    counts = {
        "right_keys_changed": 0 if changed_right is None else changed_right.rows,
        "subscription_files_scanned": stats.files_scanned,
        "subscription_files_total": stats.files_total,
    }
    if not parts:
        return None, {**counts, "responses": 0}
    found = materialize(functools.reduce(DataFrame.unionByName, parts))
    return found, {**counts, "responses": found.rows}
