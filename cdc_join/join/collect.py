"""Nested children (``type: collect``): each parent's children as one array column of silver.

A collect join turns a foreign-key join around: the children (the join's ``right`` source) hold
the foreign key, naming the parent's (the left source's) primary key, and silver keeps one row
per parent with its children's rows in an array. That is Kafka Streams' "KTable aggregate by a
non-key field", carried to Delta:

- **Elements**: structs of the children's columns, ordered by the children's primary key; a
  parent without children gets an empty array, never null.
- **Which parents a run rebuilds**: its changed parents, and for each changed child the parent
  it named before and the one it names now (its instructions' foreign keys,
  :mod:`cdc_join.join.subscription`); no other parent.
- **Finding a parent's children** without a scan of the children's state: the join's
  subscription table, CombinedKey(parent key, child key), kept from the children's changes like
  any hop's, is their index by parent; a prefix-range read gives the children's keys, a keyed
  read their rows. A leftover subscription costs a read, never a wrong element: the elements
  are the live child rows whose current foreign key names the parent.
- **A parent with too many children** (more than the join's ``max_children``) fails the run
  with an :class:`~cdc_join.errors.InputError` naming it, before any array is built.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Mapping

import pyarrow.compute as pc
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import ArrayType, DataType, StructType

from cdc_join.changeset import ChangeSet, materialize
from cdc_join.columns import DELETED, SEQ, fk_columns, pk_columns
from cdc_join.config import JoinConfig, PipelineConfig
from cdc_join.errors import InputError
from cdc_join.join import state, subscription
from cdc_join.join.lookup import RIGHT, RIGHT_SEQ
from cdc_join.schemas import quote
from cdc_join.storage import Storage


def arrays(
    children: DataFrame, config: PipelineConfig, join: JoinConfig, parents: DataFrame, *, few: bool = False
) -> DataFrame:
    """Per live parent named by live children: ``fk_*`` (the parent's key), ``_right`` (the
    array of its children's rows, ordered by their key) and ``_right_seq`` (the newest child's
    sequence).

    Args:
        children: child state rows, one per key (tombstones are left out here).
        parents: the parents whose arrays are wanted, by the left's primary key columns (any
            others ignored): live rows only. Children naming no such parent (a guest order, an
            order landed before its customer, the orders of a deleted customer) belong to no
            array, so they neither count for ``max_children`` nor cost a group.
        few: ``parents`` are a few rows, broadcast to the semi-join.
    """
    child = config.sources[join.right]
    live = children.filter(~F.col(DELETED))
    named = functools.reduce(operator.and_, [F.col(quote(c)).isNotNull() for c in join.foreign_key])
    live = _of_parents(live.filter(named), config, join, parents, few)
    check_sizes(live, config, join)
    values = state.value_fields(live.schema)
    item = F.struct(
        F.struct(*[F.col(quote(c)) for c in child.primary_key]).alias("k"),
        F.struct(*[F.col(quote(f.name)) for f in values]).alias("r"),
    )
    keys = [F.col(quote(c)).alias(f) for c, f in zip(join.foreign_key, fk_columns(join), strict=True)]
    grouped = live.groupBy(*keys).agg(
        F.sort_array(F.collect_list(item)).alias("__items"), F.max(SEQ).alias(RIGHT_SEQ)
    )
    return grouped.select(*fk_columns(join), F.expr("transform(__items, x -> x.r)").alias(RIGHT), RIGHT_SEQ)


def _of_parents(
    children: DataFrame, config: PipelineConfig, join: JoinConfig, parents: DataFrame, few: bool
) -> DataFrame:
    """The children whose foreign key names one of ``parents`` (a semi-join on the key)."""
    fks = fk_columns(join)
    keys = parents.select(
        *[F.col(quote(p)).alias(f) for p, f in zip(config.left_source.primary_key, fks, strict=True)]
    )
    keys = F.broadcast(keys) if few else keys
    same = [F.col(quote(c)) == keys[quote(f)] for c, f in zip(join.foreign_key, fks, strict=True)]
    return children.join(keys, functools.reduce(operator.and_, same), "left_semi")


def live_parents(left_rows: DataFrame) -> DataFrame:
    """The live rows of state-shaped left rows (tombstones included): the parents that hold an
    array."""
    return left_rows.filter(~F.col(DELETED))


def element_type(child_schema: StructType) -> ArrayType:
    """The array type of a collect column, from the children's state (or row) schema."""
    return ArrayType(StructType(state.value_fields(child_schema)), True)


def empty_when_null(column: str, array_type: DataType) -> F.Column:
    """The column, or an empty array of its type where it is null (a parent without children)."""
    return F.coalesce(F.col(column), F.array().cast(array_type))


def check_sizes(children: DataFrame, config: PipelineConfig, join: JoinConfig) -> None:
    """Raise :class:`InputError` when a parent has more live children than ``max_children``
    (one aggregation of the children's keys, before any array is built)."""
    keys = [quote(c) for c in join.foreign_key]
    over = children.groupBy(*keys).count().filter(F.col("count") > join.max_children).limit(3).collect()
    if over:
        parent = config.left_source.primary_key
        found = "; ".join(
            f"{dict(zip(parent, list(r)[:-1], strict=True))}: {r['count']:,} {join.alias}" for r in over
        )
        raise InputError(
            f"{join.alias}: a parent has more children than max_children ({join.max_children:,}): "
            f"{found}. Raise max_children on the join if the array is meant to be that large, or "
            "fix the data."
        )


def parents_of(instructions: Mapping[str, ChangeSet], config: PipelineConfig) -> list[ChangeSet]:
    """Per collect join with instructions, the parent keys (as the left's ``pk_*``) its changed
    children named before or name now: the parents whose arrays change."""
    out = []
    left_pks = pk_columns(config.left_source)
    for join in config.joins:
        messages = instructions.get(join.alias)
        if not join.collects or messages is None:
            continue
        fks = fk_columns(join)
        table = messages.table
        named = functools.reduce(pc.and_, [pc.is_valid(table.column(f)) for f in fks])
        keys = messages.filtered(named).distinct(fks)
        out.append(keys.renamed(dict(zip(fks, left_pks, strict=True))))
    return out


def children_of(
    storage: Storage,
    config: PipelineConfig,
    join: JoinConfig,
    parents: ChangeSet,
    changed: ChangeSet | None,
    pinned: Mapping[str, int],
) -> DataFrame:
    """:func:`arrays` of some live parents (``parents``: the left key columns), from the
    children their subscriptions name and the children that changed in this run (whose
    subscriptions are written after silver), read by key at the pinned version."""
    child = config.sources[join.right]
    fks, child_pks = fk_columns(join), pk_columns(child)
    wanted = parents.renamed(dict(zip(config.left_source.primary_key, fks, strict=True)))
    keys = []
    path = config.subscription_path(join)
    if storage.exists(path):
        found, _ = subscription.current(storage, path, join, child, storage.version(path), wanted)
        keys.append(materialize(found.select(*child_pks)))
    if changed is not None and changed.rows:
        named = dict(zip(child.primary_key, child_pks, strict=True))
        keys.append(changed.distinct(list(child.primary_key)).renamed(named))
    path, version = config.state_path(join.right), pinned[join.right]
    found_keys = ChangeSet.concat(keys, child_pks) if keys else None
    if found_keys is None or not found_keys.rows:
        return arrays(storage.read(path, version).limit(0), config, join, parents.frame, few=True)
    on = list(zip(child.primary_key, child_pks, strict=True))
    rows = state.read_current(storage, path, child.primary_key, version, keys=found_keys, on=on)
    # Only children whose current foreign key names one of the parents (a leftover
    # subscription may name a child that moved on).
    return arrays(rows, config, join, parents.frame, few=True)
