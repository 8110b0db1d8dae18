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
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import BooleanType, LongType, StringType, StructField, StructType

from cdc_join.changeset import ChangeSet, arrow_schema, as_read, from_arrow, one_partition, same_values
from cdc_join.columns import (
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
from cdc_join.config import JoinConfig, JoinType, PipelineConfig, SourceConfig
from cdc_join.join.images import NEW, OLD
from cdc_join.report import Step
from cdc_join.schemas import quote, quoted
from cdc_join.storage import Storage, commits
from cdc_join.storage.pruning import ScanStats, read_keyed

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


def instructions(changes: ChangeSet, left: SourceConfig, join: JoinConfig) -> ChangeSet:
    """Subscription instructions of one join for changed left keys (the table above).

    Computed on the driver: the changed keys and their images are there already, and the
    instructions are a few column operations per key, not worth a Spark job.

    Args:
        changes: one row per changed left key: the key columns, ``_old`` and ``_new`` (left
            state rows, null when absent; tombstones count as absent).
        left: the left source.
        join: the join.

    Returns:
        ``pk_*, fk_* (null when there is no fk), _instruction, _lhs_hash``.
    """
    t = changes.table
    old, new = t.column(OLD), t.column(NEW)
    was, now = _live(old), _live(new)
    old_fk, new_fk = _fk_parts(old, join), _fk_parts(new, join)
    had_fk, has_fk = _all_valid(was, old_fk), _all_valid(now, new_fk)
    differs = [_differs(a, b) for a, b in zip(old_fk, new_fk, strict=True)]
    fk_changed = pc.and_(had_fk, pc.or_(pc.invert(has_fk), functools.reduce(pc.or_, differs)))
    same_fk = (
        Instruction.PROPAGATE_NULL_IF_NO_FK_VAL_AVAILABLE
        if join.type is JoinType.LEFT
        else Instruction.PROPAGATE_ONLY_IF_FK_VAL_AVAILABLE
    )
    n = t.num_rows
    keys = [t.column(c) for c in left.primary_key]
    no_fk, no_hash = [pa.nulls(n, f.type) for f in old_fk], pa.nulls(n, pa.int64())
    gone = _text(Instruction.DELETE_KEY_AND_PROPAGATE, n)
    moved = _text(Instruction.DELETE_KEY_NO_PROPAGATE, n)
    subscribe = pc.if_else(
        fk_changed, _text(Instruction.PROPAGATE_NULL_IF_NO_FK_VAL_AVAILABLE, n), _text(same_fk, n)
    )
    parts = [
        # The old fk is unsubscribed when the row is gone or its fk changed.
        _messages(
            keys,
            old_fk,
            pc.if_else(now, moved, gone),
            no_hash,
            pc.and_(had_fk, pc.or_(pc.invert(now), fk_changed)),
        ),
        # A deleted row whose old fk was null had no subscription, but its output must still go.
        _messages(keys, no_fk, gone, no_hash, pc.and_(pc.and_(pc.invert(had_fk), was), pc.invert(now))),
        # The new row subscribes to its fk (none when null or partly null: it still answers).
        _messages(
            keys,
            [pc.if_else(has_fk, f, pa.nulls(n, f.type)) for f in new_fk],
            subscribe,
            pc.struct_field(new, HASH),
            now,
        ),
    ]
    return _instruction_set(changes, left, join, parts)


def instructions_all(changes: Mapping[str, ChangeSet], config: PipelineConfig) -> dict[str, ChangeSet]:
    """Per join alias, the instructions of the changed keys of its hop's left side (``changes``:
    per source name, its changed keys with ``_old`` and ``_new``); none for a hop whose left
    side did not change."""
    out = {}
    for join in config.joins:
        changed = changes.get(config.hop_left(join).name)
        if changed is not None and changed.rows:
            out[join.alias] = instructions(changed, config.hop_left(join), join)
    return out


def _instruction_set(
    changes: ChangeSet, left: SourceConfig, join: JoinConfig, parts: list[list[Any]]
) -> ChangeSet:
    pks, fks = pk_columns(left), fk_columns(join)
    row_type = changes.schema[NEW].dataType
    schema = StructType(
        [
            *[StructField(p, changes.schema[c].dataType) for c, p in zip(left.primary_key, pks, strict=True)],
            *[StructField(f, row_type[c].dataType) for c, f in zip(join.foreign_key, fks, strict=True)],
            StructField(INSTRUCTION, StringType()),
            StructField(LHS_HASH, LongType()),
        ]
    )
    arrow = arrow_schema(schema)
    tables = [
        pa.Table.from_arrays([c.cast(f.type) for c, f in zip(p, arrow, strict=True)], schema=arrow)
        for p in parts
    ]
    return ChangeSet(changes.spark, schema, pa.concat_tables(tables))


def _live(image: Any) -> Any:
    """Per row: the image is present and not a tombstone."""
    return pc.and_(pc.is_valid(image), pc.invert(pc.fill_null(pc.struct_field(image, DELETED), True)))


def _fk_parts(image: Any, join: JoinConfig) -> list[Any]:
    return [pc.struct_field(image, c) for c in join.foreign_key]


def _differs(old: Any, new: Any) -> Any:
    """Per row: the values differ, or either is null (a void column: no value at all yet)."""
    if pa.types.is_null(old.type) or pa.types.is_null(new.type):
        return pa.array([True] * len(old), pa.bool_())
    return pc.fill_null(pc.invert(same_values(old, new)), True)


def _all_valid(live: Any, parts: list[Any]) -> Any:
    """The image is live and every part of its foreign key is set (a normalized fk exists)."""
    return functools.reduce(pc.and_, [pc.is_valid(p) for p in parts], live)


def _text(instruction: Instruction, rows: int) -> pa.Array:
    return pa.array([instruction.value] * rows, pa.string())


def _messages(keys: list[Any], fk: list[Any], instruction: Any, lhs_hash: Any, where: Any) -> list[Any]:
    """The columns of the messages of the rows where ``where`` holds."""
    mask = pc.fill_null(where, False)
    return [pc.filter(column, mask) for column in [*keys, *fk, instruction, lhs_hash]]


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

    Built on the driver from the materialized instructions (no Spark job); rows are written in
    fk order, so each appended file holds a narrow fk range too.
    """
    fks, pks = fk_columns(join), pk_columns(left)
    table = messages.table
    keyed = functools.reduce(pc.and_, [pc.is_valid(table.column(f)) for f in fks])
    table = table.filter(keyed)
    subscribes = pc.is_in(
        table.column(INSTRUCTION),
        value_set=pa.array(
            [
                Instruction.PROPAGATE_NULL_IF_NO_FK_VAL_AVAILABLE.value,
                Instruction.PROPAGATE_ONLY_IF_FK_VAL_AVAILABLE.value,
            ]
        ),
    )
    hashes = pc.if_else(subscribes, table.column(LHS_HASH), pa.scalar(None, pa.int64()))
    _append_rows(storage, path, table.select([*fks, *pks]), hashes, subscribes, run_id)
    subscribed = int(pc.sum(pc.cast(subscribes, pa.int64())).as_py() or 0)
    return Subscribed(subscribed, table.num_rows - subscribed)


def _append_rows(
    storage: Storage, path: str, keys: pa.Table, hashes: Any, subscribed: Any, run_id: int
) -> None:
    """Append CombinedKeys with their hash and subscribed flag, sorted by fk then pk."""
    if not keys.num_rows:
        return
    schema = storage.schema(path)
    n = keys.num_rows
    columns = {c: keys.column(c) for c in keys.column_names}
    columns[LHS_HASH] = hashes
    columns[SUBSCRIBED] = subscribed
    columns[RUN_ID] = pa.array([run_id] * n, pa.int64())
    # The commit must be the version its rows name: readers order a key's rows by it, so
    # another writer's commit in between (``cdc-join optimize``'s compaction) fails this one.
    version = storage.version(path)
    columns[WRITTEN] = pa.array([version + 1] * n, pa.int64())
    table = pa.table({f.name: columns[f.name] for f in schema.fields}).sort_by(
        [(c, "ascending") for c in keys.column_names]
    )
    rows = from_arrow(storage.spark, schema, table.cast(arrow_schema(schema)))
    storage.append(path, rows, expected_version=version)


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
        rows, stats = read_keyed(storage, path, fks, on, version, fks.values(on[0][1]))
        rows = one_partition(rows, stats.rows_on_driver)
    newest = rows.groupBy(*keys).agg(F.expr(f"max_by(struct({LHS_HASH}, {SUBSCRIBED}), {WRITTEN}) AS __s"))
    subscribed = newest.filter(f"__s.{SUBSCRIBED}")
    return subscribed.selectExpr(*quoted(keys), f"__s.{LHS_HASH} AS {LHS_HASH}"), stats


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
    # A join whose foreign key changed under the same alias leaves the old fk columns behind.
    reshaped = set(storage.schema(path).names) != set(rows.columns)
    written = as_read(rows, left_rows)
    return storage.overwrite(path, written, replace_schema=reshaped, note=commits.REBUILD).rows_inserted or 0


def write_all(
    storage: Storage, config: PipelineConfig, instructions: Mapping[str, ChangeSet], run_id: int, step: Step
) -> None:
    """Append every join's instructions to its subscription table (created first if need be)."""
    for join in config.joins:
        with step(f"subscription:{join.alias}") as counts:
            path, messages, left = (
                config.subscription_path(join),
                instructions.get(join.alias),
                config.hop_left(join),
            )
            prepare(storage, path, left, join, storage.schema(config.state_path(left.name)))
            counts["instructions"] = messages.value_counts(INSTRUCTION) if messages else {}
            if messages is not None:
                written = append_instructions(storage, path, messages, left, join, run_id)
                counts.update(subscribed=written.subscribed, unsubscribed=written.unsubscribed)


def rebuild_all(
    storage: Storage,
    config: PipelineConfig,
    rows_of: Callable[[str], DataFrame],
    run_id: int,
    step: Step,
) -> None:
    """Every join's subscription table rebuilt from the current rows of its hop's left side
    (``rows_of``: a source name → its current state rows), as in a recompute."""
    for join in config.joins:
        with step(f"subscription:{join.alias}") as counts:
            path, left = config.subscription_path(join), config.hop_left(join)
            prepare(storage, path, left, join, storage.schema(config.state_path(left.name)))
            counts["rebuilt"] = rebuild(storage, path, rows_of(left.name), left, join, run_id)


def remove_orphans(
    storage: Storage,
    config: PipelineConfig,
    orphans: Callable[[JoinConfig], ChangeSet | None],
    run_id: int,
) -> int:
    """Unsubscribe, per join, the subscriptions a run found without a current left row."""
    removed = 0
    for join in config.joins:
        found = orphans(join)
        if found is not None and found.rows:
            removed += unsubscribe(
                storage, config.subscription_path(join), found, config.hop_left(join), join, run_id
            )
    return removed


def unsubscribe(
    storage: Storage, path: str, orphans: ChangeSet, left: SourceConfig, join: JoinConfig, run_id: int
) -> int:
    """Append unsubscribes for leftover subscriptions (``fk_*, pk_*`` of ``orphans``)."""
    keys = orphans.distinct([*fk_columns(join), *pk_columns(left)]).table
    n = keys.num_rows
    _append_rows(storage, path, keys, pa.nulls(n, pa.int64()), pa.array([False] * n), run_id)
    return n


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
    written = storage.overwrite(path, rows, expected_version=version, note=commits.COMPACTION)
    return written.rows_inserted or 0
