"""Left changes → KIP-213 subscription instructions → the CombinedKey subscription table.

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

A foreign key with any part null is no foreign key (:func:`normalized_fk`): nothing on the
right can match it, so it has no subscription, but its instruction still produces a response,
so a left join outputs the row with null right columns (KIP-962) and an inner join deletes a
row whose fk became null (KAFKA-16407).

The subscription table is merge-on-read, one appended row per instruction: ``fk_*, pk_*``
(the CombinedKey), ``_lhs_hash`` (the left value it subscribes for), ``_subscribed`` (false
for an unsubscribe) and ``_cdc_written`` (a counter that grows with every append). A
CombinedKey's subscription is its row of greatest ``_cdc_written``, if subscribed
(:func:`current`). Instructions derive from the left state as of the last completed run, so a
rerun after a crash appends the same rows again, which changes no current subscription.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import BooleanType, LongType, StructField, StructType

from cdc_join.changeset import ChangeSet, collect, materialize
from cdc_join.config import JoinConfig, JoinType, PipelineConfig, SourceConfig
from cdc_join.schemas import quote, quoted
from cdc_join.state import NEW, OLD
from cdc_join.storage import Storage
from cdc_join.storage.pruning import ScanStats, read_keyed
from cdc_join.tables import (
    DELETED,
    HASH,
    LHS_HASH,
    RUN_ID,
    SUBSCRIBED,
    WRITTEN,
    fk_columns,
    pk_columns,
    table_properties,
)

INSTRUCTION = "_instruction"


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


def normalized_fk(row: str, join: JoinConfig) -> Column:
    """The foreign key of a left row (a struct column) as a struct of ``fk_*`` fields, or null
    when the row is null or any part of its key is null: a partly null key names no right row.

    Responses and the stale check both compare keys in this form, so a row whose key is
    ``(1, null)`` is seen as having no key on both sides.
    """
    parts = [F.col(f"{row}.{quote(c)}") for c in join.foreign_key]
    present = F.col(row).isNotNull()
    for part in parts:
        present = present & part.isNotNull()
    named = [part.alias(f) for part, f in zip(parts, fk_columns(join), strict=True)]
    return F.when(present, F.struct(*named))


def _live(image: str) -> Column:
    """An old/new image column, null when absent or a tombstone."""
    return F.when(F.col(image).isNotNull() & ~F.col(f"{image}.{DELETED}"), F.col(image))


def instructions(changes: DataFrame, left: SourceConfig, join: JoinConfig) -> DataFrame:
    """Subscription instructions of one join for changed left keys.

    Args:
        changes: one row per changed left key: the key columns, ``_old`` and ``_new`` (left
            state rows, null when absent; tombstones count as absent).
        left: the left source.
        join: the join.

    Returns:
        ``pk_*, fk_* (null when there is no fk), _instruction, _lhs_hash``.
    """
    frame = changes.select(*quoted(left.primary_key), _live(OLD).alias(OLD), _live(NEW).alias(NEW))
    old_fk, new_fk = normalized_fk(OLD, join), normalized_fk(NEW, join)
    was, now = F.col(OLD).isNotNull(), F.col(NEW).isNotNull()
    fk_changed = old_fk.isNotNull() & (new_fk.isNull() | (old_fk != new_fk))
    same_fk = (
        Instruction.PROPAGATE_NULL_IF_NO_FK_VAL_AVAILABLE
        if join.type is JoinType.LEFT
        else Instruction.PROPAGATE_ONLY_IF_FK_VAL_AVAILABLE
    )
    no_hash = F.lit(None).cast("long")
    unsubscribe = F.when(
        old_fk.isNotNull() & (~now | fk_changed),
        _message(
            old_fk,
            F.when(~now, _lit(Instruction.DELETE_KEY_AND_PROPAGATE)).otherwise(
                _lit(Instruction.DELETE_KEY_NO_PROPAGATE)
            ),
            no_hash,
        ),
    )
    # A deleted row whose old fk was null had no subscription, but its output must still go.
    delete_without_fk = F.when(
        old_fk.isNull() & was & ~now, _message(old_fk, _lit(Instruction.DELETE_KEY_AND_PROPAGATE), no_hash)
    )
    subscribe = F.when(
        now,
        _message(
            new_fk,
            F.when(fk_changed, _lit(Instruction.PROPAGATE_NULL_IF_NO_FK_VAL_AVAILABLE)).otherwise(
                _lit(same_fk)
            ),
            F.col(f"{NEW}.{HASH}"),
        ),
    )
    pks = [F.col(quote(c)).alias(p) for c, p in zip(left.primary_key, pk_columns(left), strict=True)]
    messages = frame.select(*pks, F.explode(F.array(unsubscribe, delete_without_fk, subscribe)).alias("m"))
    return messages.filter(F.col("m").isNotNull()).select(
        *pk_columns(left),
        *[F.col(f"m.fk.{f}").alias(f) for f in fk_columns(join)],
        F.col("m.instruction").alias(INSTRUCTION),
        F.col("m.hash").alias(LHS_HASH),
    )


def _message(fk: Column, instruction: Column, lhs_hash: Column) -> Column:
    return F.struct(fk.alias("fk"), instruction.alias("instruction"), lhs_hash.alias("hash"))


def _lit(instruction: Instruction) -> Column:
    return F.lit(instruction.value)


def subscription_schema(left: SourceConfig, join: JoinConfig, left_schema: StructType) -> StructType:
    """``fk_*, pk_*, _lhs_hash, _subscribed, _run_id, _cdc_written`` with the left columns' types."""
    fields = [
        StructField(f, left_schema[c].dataType, False)
        for c, f in zip(join.foreign_key, fk_columns(join), strict=True)
    ]
    fields += [
        StructField(p, left_schema[c].dataType, False)
        for c, p in zip(left.primary_key, pk_columns(left), strict=True)
    ]
    return StructType(
        [
            *fields,
            StructField(LHS_HASH, LongType(), True),
            StructField(SUBSCRIBED, BooleanType(), False),
            StructField(RUN_ID, LongType(), False),
            StructField(WRITTEN, LongType(), False),
        ]
    )


def prepare(
    storage: Storage, path: str, left: SourceConfig, join: JoinConfig, left_schema: StructType
) -> None:
    """Create the join's subscription table, or widen its key columns with the left table's."""
    schema = subscription_schema(left, join, left_schema)
    if not storage.create(path, schema, cdf=False, properties=table_properties("subscription")):
        storage.evolve(path, schema)


@dataclass(frozen=True)
class Subscribed:
    """Rows one append of instructions wrote."""

    subscribed: int
    unsubscribed: int


def append_instructions(
    storage: Storage, path: str, messages: ChangeSet, left: SourceConfig, join: JoinConfig, run_id: int
) -> Subscribed:
    """Append the instructions that have a foreign key: subscribe new fks, unsubscribe old ones.

    Rows are written in fk order, so each appended file holds a narrow fk range too.
    """
    fks = fk_columns(join)
    keyed = messages.frame.filter(" AND ".join(f"{f} IS NOT NULL" for f in fks))
    subscribes = F.col(INSTRUCTION).isin(
        Instruction.PROPAGATE_NULL_IF_NO_FK_VAL_AVAILABLE.value,
        Instruction.PROPAGATE_ONLY_IF_FK_VAL_AVAILABLE.value,
    )
    rows = keyed.select(
        *fks,
        *pk_columns(left),
        F.when(subscribes, F.col(LHS_HASH)).alias(LHS_HASH),
        subscribes.alias(SUBSCRIBED),
        F.lit(run_id).cast("long").alias(RUN_ID),
        F.lit(storage.version(path) + 1).cast("long").alias(WRITTEN),
    ).orderBy(*fks, *pk_columns(left))
    table = collect(rows)
    if table.num_rows:
        storage.append(path, rows)
    subscribed = sum(1 for s in table.column(SUBSCRIBED).to_pylist() if s) if table.num_rows else 0
    return Subscribed(subscribed, table.num_rows - subscribed)


def current(
    storage: Storage,
    path: str,
    join: JoinConfig,
    left: SourceConfig,
    version: int | None = None,
    fks: ChangeSet | None = None,
) -> tuple[DataFrame, ScanStats]:
    """The current subscriptions (``fk_*, pk_*, _lhs_hash``), optionally only of the fks in
    ``fks`` (a change set with ``fk_*`` columns), read with file skipping on the first fk."""
    keys = fk_columns(join) + pk_columns(left)
    if fks is None:
        rows = storage.read(path, version)
        stats = ScanStats(0, 0)
    else:
        on = [(f, f) for f in fk_columns(join)]
        rows, stats = read_keyed(storage, path, fks.frame, on, version, fks.values(on[0][1]))
    packed = F.struct(F.col(LHS_HASH), F.col(SUBSCRIBED))
    newest = rows.groupBy(*keys).agg(F.max_by(packed, F.col(WRITTEN)).alias("__s"))
    subscribed = newest.filter(F.col(f"__s.{SUBSCRIBED}"))
    return subscribed.select(*keys, F.col(f"__s.{LHS_HASH}").alias(LHS_HASH)), stats


def rebuild(
    storage: Storage, path: str, left_rows: DataFrame, left: SourceConfig, join: JoinConfig, run_id: int
) -> int:
    """Overwrite the subscription table with one row per live left row that has an fk.

    ``left_rows`` are current left state rows. Rows are written in fk order, so the files come
    out clustered by fk, which is what lets right-driven lookups skip files. Returns the rows
    written.
    """
    keyed = left_rows.filter(~F.col(DELETED)).select(F.struct(*quoted(left_rows.columns)).alias("row"))
    fk = normalized_fk("row", join)
    rows = (
        keyed.filter(fk.isNotNull())
        .select(
            *[
                F.col(f"row.{quote(c)}").alias(f)
                for c, f in zip(join.foreign_key, fk_columns(join), strict=True)
            ],
            *[
                F.col(f"row.{quote(c)}").alias(p)
                for c, p in zip(left.primary_key, pk_columns(left), strict=True)
            ],
            F.col(f"row.{HASH}").alias(LHS_HASH),
            F.lit(True).alias(SUBSCRIBED),
            F.lit(run_id).cast("long").alias(RUN_ID),
            F.lit(0).cast("long").alias(WRITTEN),
        )
        .orderBy(*fk_columns(join), *pk_columns(left))
    )
    return storage.overwrite(path, rows).rows_inserted or 0


def unsubscribe(
    storage: Storage, path: str, orphans: DataFrame, left: SourceConfig, join: JoinConfig, run_id: int
) -> int:
    """Append unsubscribes for leftover subscriptions (``fk_*, pk_*`` of ``orphans``)."""
    rows = orphans.select(
        *fk_columns(join),
        *pk_columns(left),
        F.lit(None).cast("long").alias(LHS_HASH),
        F.lit(False).alias(SUBSCRIBED),
        F.lit(run_id).cast("long").alias(RUN_ID),
        F.lit(storage.version(path) + 1).cast("long").alias(WRITTEN),
    ).distinct()
    table = collect(rows)
    if table.num_rows:
        storage.append(path, rows)
    return table.num_rows


def compact(storage: Storage, path: str, join: JoinConfig, left: SourceConfig, run_id: int) -> int:
    """Rewrite the table with its current subscriptions only, in fk order (maintenance)."""
    version = storage.version(path)
    live, _ = current(storage, path, join, left, version)
    rows = live.select(
        *fk_columns(join),
        *pk_columns(left),
        LHS_HASH,
        F.lit(True).alias(SUBSCRIBED),
        F.lit(run_id).cast("long").alias(RUN_ID),
        F.lit(version + 1).cast("long").alias(WRITTEN),
    ).orderBy(*fk_columns(join), *pk_columns(left))
    return storage.overwrite(path, rows, expected_version=version).rows_inserted or 0


def subscribe(
    storage: Storage, config: PipelineConfig, join: JoinConfig, left_changes: ChangeSet, run_id: int
) -> tuple[ChangeSet | None, dict[str, Any]]:
    """One join's subscription step of a run: instructions for the changed left keys, appended
    to the subscription table. Returns the instructions (``None`` when no left key changed)
    and the report's counts."""
    path, left = config.subscription_path(join), config.left_source
    prepare(storage, path, left, join, storage.schema(config.state_path(config.left)))
    if not left_changes.rows:
        return None, {"instructions": {}}
    messages = materialize(instructions(left_changes.frame, left, join))
    written = append_instructions(storage, path, messages, left, join, run_id)
    counts = {
        "instructions": messages.value_counts(INSTRUCTION),
        "subscribed": written.subscribed,
        "unsubscribed": written.unsubscribed,
    }
    return messages, counts
