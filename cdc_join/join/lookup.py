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

from cdc_join.changeset import ChangeSet, found_in, materialize_all
from cdc_join.columns import DELETED, LHS_HASH, SEQ, fk_columns, pk_columns
from cdc_join.config import JoinConfig, PipelineConfig, SourceConfig
from cdc_join.join import increment, state, subscription
from cdc_join.schemas import quote, quoted
from cdc_join.storage import Storage
from cdc_join.storage.pruning import ScanStats

RIGHT = "_right"
#: On a subscriber: its fk is a changed key of the right source (not only reached by walking back).
DIRECT = "_direct"
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
    changes: Mapping[str, increment.SourceChanges],
    counts: dict[str, Any],
) -> dict[str, ChangeSet]:
    """Per join, the current subscribers of its changed right keys; in a chain, walking back.

    A hop's right keys count as changed when their source changed, and also when they
    subscribe to a changed key of a later hop (``orders → customers → nations``: a changed
    nation finds its customers, which find their orders). So the hops are looked up from the
    end of the chain to its start, the hops of one depth in one Spark job. Subscribers found
    this way are not checked yet: the stale check (:func:`cdc_join.join.resolve.check`) compares
    each hop's with its left side's current rows, and a stale one found here costs work only.

    ``counts`` gets, per join alias, the changed right keys, the files the prefix-range reads
    scanned and skipped, and the subscribers found.
    """
    found: dict[str, ChangeSet] = {}
    for level in reversed(levels(config)):
        pending, direct = {}, {}
        for join in level:
            if join.collects:  # a child's change names its parents itself (its instructions)
                continue
            right = config.sources[join.right]
            direct[join.alias] = changed_right_keys(changes[join.right].keys, right, join)
            later = [
                _as_right_keys(found[j.alias], right, join)
                for j in config.hops_from(join.alias)
                if j.alias in found
            ]
            named = ChangeSet.concat([direct[join.alias], *later], fk_columns(join))
            path = config.subscription_path(join)
            if named.rows and storage.exists(path):
                pending[join.alias], scans = subscribers(storage, config, join, named, storage.version(path))
                counts[join.alias] = {"right_keys_changed": named.rows, **scans.as_counts()}
        if pending:
            done = zip(pending, materialize_all(list(pending.values())), strict=True)
            found.update({alias: _marked(rows, direct[alias], alias, config) for alias, rows in done})
    for alias, rows in found.items():
        counts[alias]["subscribers"] = rows.rows
    return {j.alias: found[j.alias] for j in config.joins if j.alias in found}


def _marked(found: ChangeSet, direct: ChangeSet, alias: str, config: PipelineConfig) -> ChangeSet:
    """Subscribers with ``_direct``: whether their fk is a changed key of the right source
    itself (else they were found only by walking back from a later hop)."""
    flag = found_in(found.table, direct.table, fk_columns(config.join_for_alias(alias)))
    return found.with_column(DIRECT, flag, nullable=False)


def levels(config: PipelineConfig) -> list[list[JoinConfig]]:
    """The joins by their depth in the chain: those off the left source first."""
    depth: dict[str, int] = {config.left: 0}
    levels: list[list[JoinConfig]] = []
    for join in config.joins:  # a join's ``from`` is listed before it
        depth[join.alias] = depth[join.source] + 1
        if len(levels) < depth[join.alias]:
            levels.append([])
        levels[depth[join.alias] - 1].append(join)
    return levels


def _as_right_keys(found: ChangeSet, right: SourceConfig, join: JoinConfig) -> ChangeSet:
    """The left-side keys of a later hop's subscribers (``pk_*``) as this hop's ``fk_*``."""
    names = dict(zip(pk_columns(right), fk_columns(join), strict=True))
    return found.distinct(list(names)).renamed(names)


def subscribers(
    storage: Storage, config: PipelineConfig, join: JoinConfig, changed: ChangeSet, version: int
) -> tuple[DataFrame, ScanStats]:
    """The current subscribers of the changed right keys (``changed``: ``fk_*``), as
    ``pk_*, fk_*, _lhs_hash``: a prefix-range read of the fk-clustered subscription table.
    ``pk_*`` is the key of the hop's left side."""
    left = config.hop_left(join)
    rows, stats = subscription.current(storage, config.subscription_path(join), join, left, version, changed)
    return rows.select(*pk_columns(left), *fk_columns(join), LHS_HASH), stats


def keys_naming(
    storage: Storage, config: PipelineConfig, join: JoinConfig, named: DataFrame, version: int, *, small: bool
) -> DataFrame:
    """The keys of every state row of the hop's left side whose foreign key names one of
    ``named`` (``fk_*``), by one scan of that state: the set-based form of :func:`subscribers`,
    for a run that changes too many right keys for prefix-range reads. ``small``: ``named``
    may be broadcast.

    Every row of the table counts, superseded ones too (a key's current row is only known once
    its rows are folded): a key whose current row names none of the changed keys is computed
    again for nothing, and the silver MERGE finds its row unchanged. Foreign keys compare as in
    the join that builds silver rows (a null part matches nothing).
    """
    left = config.hop_left(join)
    stored = storage.read(config.state_path(left.name), version)
    named = F.broadcast(named) if small else named
    on = functools.reduce(
        operator.and_,
        [
            stored[quote(c)] == named[quote(f)]
            for c, f in zip(join.foreign_key, fk_columns(join), strict=True)
        ],
    )
    return stored.join(named, on, "left_semi").select(*quoted(left.primary_key))


def changed_right_keys(keys: ChangeSet, right: SourceConfig, join: JoinConfig) -> ChangeSet:
    """Changed keys of a right source (its primary key columns), as the join's ``fk_*``."""
    names = dict(zip(right.primary_key, fk_columns(join), strict=True))
    return keys.distinct(list(right.primary_key)).renamed(names)
