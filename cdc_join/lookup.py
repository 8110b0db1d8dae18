"""Changes → the rows they touch: subscribers of changed right keys, right rows named by fks.

- A changed right key finds its subscribers with a prefix-range read of the subscription
  table (:func:`subscribers`), the batch form of RocksDB's prefix scan on
  ``CombinedKey(fk, pk)``: the table is clustered by fk, so a few changed keys read a few files.
- The right rows a set of left rows joins to are read by their primary key, which the left
  rows' foreign keys name (:func:`right_rows`), skipping files by statistics.

Both are keyed reads (:mod:`cdc_join.storage.pruning`) of the table versions a run pinned.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Mapping
from typing import Any

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from cdc_join import state, subscription
from cdc_join.changeset import ChangeSet, materialize_all
from cdc_join.columns import DELETED, LHS_HASH, SEQ, fk_columns, pk_columns
from cdc_join.config import JoinConfig, PipelineConfig, SourceConfig
from cdc_join.schemas import quote, quoted
from cdc_join.storage import Storage
from cdc_join.storage.pruning import ScanStats

RIGHT = "_right"
RIGHT_SEQ = "_right_seq"
#: Changed right keys up to this many are broadcast to the scan of the left state.
BROADCAST_KEYS = 1_000_000


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
    values = ", ".join(quote(f.name) for f in state.value_fields(rows.schema))
    return rows.filter(f"NOT {DELETED}").selectExpr(
        *[f"{quote(pk)} AS {quote(fk)}" for pk, fk in on],
        f"struct({values}) AS {RIGHT}",
        f"{SEQ} AS {RIGHT_SEQ}",
    )


def all_subscribers(
    storage: Storage,
    config: PipelineConfig,
    changes: Mapping[str, state.SourceChanges],
    counts: dict[str, Any],
) -> dict[str, ChangeSet]:
    """Per join, the current subscribers of its changed right keys, all read in one Spark job.

    ``counts`` gets, per join alias, the changed right keys, the files the prefix-range reads
    scanned and skipped, and the subscribers found.
    """
    found = {}
    for join in config.joins:
        keys = changed_right_keys(changes[join.right].keys, config.sources[join.right], join)
        path = config.subscription_path(join)
        if keys.rows and storage.exists(path):
            found[join.alias], scans = subscribers(storage, config, join, keys, storage.version(path))
            counts[join.alias] = {"right_keys_changed": keys.rows, **scans.as_counts()}
    done = dict(zip(found, materialize_all(list(found.values())), strict=True)) if found else {}
    for alias, rows in done.items():
        counts[alias]["subscribers"] = rows.rows
    return done


def subscribers(
    storage: Storage, config: PipelineConfig, join: JoinConfig, changed: ChangeSet, version: int
) -> tuple[DataFrame, ScanStats]:
    """The current subscribers of the changed right keys (``changed``: ``fk_*``), as
    ``pk_*, fk_*, _lhs_hash``: a prefix-range read of the fk-clustered subscription table."""
    rows, stats = subscription.current(
        storage, config.subscription_path(join), join, config.left_source, version, changed
    )
    return rows.select(*pk_columns(config.left_source), *fk_columns(join), LHS_HASH), stats


def left_keys_naming(
    storage: Storage, config: PipelineConfig, join: JoinConfig, changed: ChangeSet, version: int
) -> DataFrame:
    """The keys of every left state row whose foreign key names a changed right key
    (``changed``: ``fk_*``), by one scan of the left state: the set-based form of
    :func:`subscribers`, for a run that changes too many right keys for prefix-range reads.

    Every row of the table counts, superseded ones too (a key's current row is only known once
    its rows are folded): a key whose current row names none of the changed keys is computed
    again for nothing, and the silver MERGE finds its row unchanged. Foreign keys compare as in
    the join that builds silver rows (a null part matches nothing).
    """
    stored = storage.read(config.state_path(config.left), version)
    # Broadcast unless the keys are many (a truncate of a large right table changes all of them).
    named = F.broadcast(changed.frame) if changed.rows <= BROADCAST_KEYS else changed.frame
    on = functools.reduce(
        operator.and_,
        [
            stored[quote(c)] == named[quote(f)]
            for c, f in zip(join.foreign_key, fk_columns(join), strict=True)
        ],
    )
    return stored.join(named, on, "left_semi").select(*quoted(config.left_source.primary_key))


def changed_right_keys(keys: ChangeSet, right: SourceConfig, join: JoinConfig) -> ChangeSet:
    """Changed keys of a right source (its primary key columns), as the join's ``fk_*``."""
    names = dict(zip(right.primary_key, fk_columns(join), strict=True))
    return keys.distinct(list(right.primary_key)).renamed(names)
