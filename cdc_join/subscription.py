"""Left changes → KIP-213 subscription instructions → MERGE of the CombinedKey table.

For each changed left key the old row (as of the last completed run) and the new row (now)
decide what happens, exactly as Kafka's ``SubscriptionSendProcessorSupplier`` does:

=================================  ==========================================================
old fk → new                       instructions
=================================  ==========================================================
row deleted                        ``DELETE_KEY_AND_PROPAGATE`` to the old fk
fk changed (incl. to/from null)    ``DELETE_KEY_NO_PROPAGATE`` to the old fk,
                                   ``PROPAGATE_NULL_IF_NO_FK_VAL_AVAILABLE`` to the new fk
same fk, or a new row              left join: ``PROPAGATE_NULL_IF_NO_FK_VAL_AVAILABLE``,
                                   inner join: ``PROPAGATE_ONLY_IF_FK_VAL_AVAILABLE``
=================================  ==========================================================

A null foreign key has no subscription (nothing on the right can change its result), but its
instruction still produces a response, so a left join outputs the row with null right columns
(KIP-962) and an inner join deletes a row whose fk became null (KAFKA-16407).

The subscription table holds one row per CombinedKey (``fk_*`` columns, then ``pk_*``) with the
hash of the left value it was made for. Old rows come from the left state as of the last
checkpoint, so a rerun after a crash issues the same MERGE again, which changes nothing.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import LongType, StructField, StructType

from cdc_join.config import JoinConfig, JoinType, SourceConfig
from cdc_join.state import DELETED, HASH
from cdc_join.storage import MergeSpec, Storage

OLD = "_old"
NEW = "_new"
NEW_HASH = "_new_hash"
INSTRUCTION = "_instruction"
LHS_HASH = "_lhs_hash"
RUN_ID = "_run_id"


class Instruction(str, enum.Enum):
    """What a subscription message asks the right side to do (KIP-213 SubscriptionWrapper)."""

    DELETE_KEY_AND_PROPAGATE = "DELETE_KEY_AND_PROPAGATE"
    DELETE_KEY_NO_PROPAGATE = "DELETE_KEY_NO_PROPAGATE"
    PROPAGATE_NULL_IF_NO_FK_VAL_AVAILABLE = "PROPAGATE_NULL_IF_NO_FK_VAL_AVAILABLE"
    PROPAGATE_ONLY_IF_FK_VAL_AVAILABLE = "PROPAGATE_ONLY_IF_FK_VAL_AVAILABLE"

    @property
    def subscribes(self) -> bool:
        return self in (
            Instruction.PROPAGATE_NULL_IF_NO_FK_VAL_AVAILABLE,
            Instruction.PROPAGATE_ONLY_IF_FK_VAL_AVAILABLE,
        )

    @property
    def propagates(self) -> bool:
        """Whether the instruction yields a response (all but ``DELETE_KEY_NO_PROPAGATE``)."""
        return self is not Instruction.DELETE_KEY_NO_PROPAGATE


def fk_columns(join: JoinConfig) -> list[str]:
    """The CombinedKey's foreign-key column names in the subscription table."""
    return [f"fk_{c}" for c in join.foreign_key]


def pk_columns(left: SourceConfig) -> list[str]:
    """The CombinedKey's primary-key column names in the subscription table."""
    return [f"pk_{c}" for c in left.primary_key]


def subscription_schema(left: SourceConfig, join: JoinConfig, left_schema: StructType) -> StructType:
    """``fk_* , pk_*, _lhs_hash, _run_id`` with the left columns' types."""
    fields = [StructField(f"fk_{c}", left_schema[c].dataType, False) for c in join.foreign_key]
    fields += [StructField(f"pk_{c}", left_schema[c].dataType, False) for c in left.primary_key]
    return StructType(
        [*fields, StructField(LHS_HASH, LongType(), True), StructField(RUN_ID, LongType(), True)]
    )


def _fk_of(image: str, join: JoinConfig) -> Column:
    """The fk of an old/new image as a struct, or null if the image is absent or any part null."""
    parts = [F.col(f"{image}.`{c}`") for c in join.foreign_key]
    present = F.col(image).isNotNull()
    for p in parts:
        present = present & p.isNotNull()
    return F.when(
        present, F.struct(*[p.alias(f"fk_{c}") for p, c in zip(parts, join.foreign_key, strict=False)])
    )


def instructions(changes: DataFrame, left: SourceConfig, join: JoinConfig) -> DataFrame:
    """Turn left changes into subscription instructions for one join.

    Args:
        changes: one row per changed left key: the pk columns, ``_old`` and ``_new`` (structs of
            the row's values, null when absent or deleted) and ``_new_hash``.
        left: the left source.
        join: the join.

    Returns:
        Rows ``pk_*, fk_* (null when there is no fk), _instruction, _lhs_hash``.
    """
    old_fk, new_fk = _fk_of(OLD, join), _fk_of(NEW, join)
    fk_changed = old_fk.isNotNull() & (new_fk.isNull() | (old_fk != new_fk))
    same_fk = (
        Instruction.PROPAGATE_NULL_IF_NO_FK_VAL_AVAILABLE
        if join.type is JoinType.LEFT
        else Instruction.PROPAGATE_ONLY_IF_FK_VAL_AVAILABLE
    )
    unsubscribe = F.when(
        old_fk.isNotNull() & (F.col(NEW).isNull() | fk_changed),
        F.struct(
            old_fk.alias("fk"),
            F.when(F.col(NEW).isNull(), F.lit(Instruction.DELETE_KEY_AND_PROPAGATE.value))
            .otherwise(F.lit(Instruction.DELETE_KEY_NO_PROPAGATE.value))
            .alias("instruction"),
            F.lit(None).cast("long").alias("hash"),
        ),
    )
    # A deleted row whose old fk was null had no subscription, but its output must still go.
    delete_without_fk = F.when(
        old_fk.isNull() & F.col(OLD).isNotNull() & F.col(NEW).isNull(),
        F.struct(
            old_fk.alias("fk"),
            F.lit(Instruction.DELETE_KEY_AND_PROPAGATE.value).alias("instruction"),
            F.lit(None).cast("long").alias("hash"),
        ),
    )
    subscribe = F.when(
        F.col(NEW).isNotNull(),
        F.struct(
            new_fk.alias("fk"),
            F.when(fk_changed, F.lit(Instruction.PROPAGATE_NULL_IF_NO_FK_VAL_AVAILABLE.value))
            .otherwise(F.lit(same_fk.value))
            .alias("instruction"),
            F.col(NEW_HASH).alias("hash"),
        ),
    )
    pks = [F.col(f"`{c}`").alias(f"pk_{c}") for c in left.primary_key]
    messages = changes.select(*pks, F.explode(F.array(unsubscribe, delete_without_fk, subscribe)).alias("m"))
    return messages.filter(F.col("m").isNotNull()).select(
        *[F.col(f"pk_{c}") for c in left.primary_key],
        *[F.col(f"m.fk.fk_{c}").alias(f"fk_{c}") for c in join.foreign_key],
        F.col("m.instruction").alias(INSTRUCTION),
        F.col("m.hash").alias(LHS_HASH),
    )


@dataclass(frozen=True)
class SubscriptionReport:
    """Counts of one subscription MERGE."""

    subscribed: int
    updated: int
    unsubscribed: int
    version: int


def apply_instructions(
    storage: Storage,
    path: str,
    messages: DataFrame,
    left: SourceConfig,
    join: JoinConfig,
    run_id: int,
) -> SubscriptionReport:
    """MERGE the instructions into the subscription table: unsubscribe old fks, subscribe new.

    Instructions without a foreign key touch no subscription. Re-applying the same instructions
    (a rerun after a crash) leaves the table as it is.
    """
    keyed = messages.filter(" AND ".join(f"fk_{c} IS NOT NULL" for c in join.foreign_key))
    action = F.when(
        F.col(INSTRUCTION).isin(
            Instruction.DELETE_KEY_NO_PROPAGATE.value, Instruction.DELETE_KEY_AND_PROPAGATE.value
        ),
        F.lit("unsubscribe"),
    ).otherwise(F.lit("subscribe"))
    source = keyed.select(
        *fk_columns(join),
        *pk_columns(left),
        LHS_HASH,
        F.lit(run_id).cast("long").alias(RUN_ID),
        action.alias("_action"),
    )
    on = " AND ".join(f"t.`{c}` = s.`{c}`" for c in [*fk_columns(join), *pk_columns(left)])
    metrics = storage.merge(
        path,
        source,
        MergeSpec(
            on=on,
            delete_condition="s._action = 'unsubscribe'",
            update_condition=f"s._action = 'subscribe' AND (t.{LHS_HASH} IS DISTINCT FROM s.{LHS_HASH})",
            insert_condition="s._action = 'subscribe'",
            exclude_columns=("_action",),
        ),
    )
    return SubscriptionReport(
        subscribed=metrics.rows_inserted or 0,
        updated=metrics.rows_updated or 0,
        unsubscribed=metrics.rows_deleted or 0,
        version=metrics.version,
    )


def rebuild(
    storage: Storage, path: str, left_state: DataFrame, left: SourceConfig, join: JoinConfig, run_id: int
) -> int:
    """Overwrite the subscription table with one row per live left row that has an fk.

    Rows are written in fk order, so the files come out clustered by fk (each holds a narrow
    fk range), which is what lets right-driven lookups skip files. Returns the rows written.
    """
    fks, pks = fk_columns(join), pk_columns(left)
    live = left_state.filter(~F.col(DELETED))
    for c in join.foreign_key:
        live = live.filter(F.col(f"`{c}`").isNotNull())
    rows = live.select(
        *[F.col(f"`{c}`").alias(f) for c, f in zip(join.foreign_key, fks, strict=True)],
        *[F.col(f"`{c}`").alias(p) for c, p in zip(left.primary_key, pks, strict=True)],
        F.col(HASH).alias(LHS_HASH),
        F.lit(run_id).cast("long").alias(RUN_ID),
    ).orderBy(*fks, *pks)
    return storage.overwrite(path, rows).rows_inserted or 0


def remove_subscriptions(
    storage: Storage, path: str, stale: DataFrame, left: SourceConfig, join: JoinConfig
) -> int:
    """Delete leftover subscriptions (CombinedKeys whose left row no longer has that fk/hash)."""
    on = " AND ".join(f"t.`{c}` = s.`{c}`" for c in [*fk_columns(join), *pk_columns(left)])
    source = stale.select(*fk_columns(join), *pk_columns(left), LHS_HASH)
    metrics = storage.merge(
        path,
        source,
        MergeSpec(
            on=on + f" AND (t.{LHS_HASH} IS NOT DISTINCT FROM s.{LHS_HASH})",
            update=False,
            insert=False,
            delete_condition="true",
        ),
    )
    return metrics.rows_deleted or 0
