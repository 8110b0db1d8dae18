"""Changes → the left keys to recompute, after the KIP-213 stale check; keys → silver rows.

A run recomputes the silver row of every left key that changed, and of every subscriber of a
changed right key whose subscription is still current (its response, in KIP-213's words). A
subscription was made for some left value (its fk and lhs hash); it counts only if that is
still the current left value: the left row is live, its foreign key equals the subscription's
and its hash equals the subscription's. Anything else is stale — a left row that moved on, a
leftover subscription of a crashed run — and is dropped and counted; a subscription whose left
row is gone or has another fk is a leftover, and is removed. Left keys that changed in the run
answer for themselves (their own instructions replace their subscriptions).

Rows are then built (:func:`build_rows`) for the affected keys from the current left row and,
per join, the current right row its foreign key names (a foreign key with a null part names
none): the same builder makes every silver row, whether a run recomputes a few keys, the keys
a large batch affects found by scanning the state tables (:func:`recompute_affected`), or the
whole join (:func:`recompute`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import BooleanType, StructField, StructType

from cdc_join.changeset import ChangeSet, arrow_schema, found_in, materialize, one_partition, same_values
from cdc_join.columns import (
    ACTION,
    DELETED,
    HASH,
    LHS_HASH,
    RUN_ID,
    SEQ,
    VALUES_HASH,
    fk_columns,
    lineage_column,
    output_columns,
    pk_columns,
)
from cdc_join.config import JoinConfig, JoinType, PipelineConfig
from cdc_join.errors import ConfigError, config_errors
from cdc_join.join import collect, hashing, lookup, state, subscription
from cdc_join.join.lookup import RIGHT, RIGHT_SEQ
from cdc_join.join.state import value_fields
from cdc_join.schemas import quote, quoted
from cdc_join.storage import Storage

STALE = "_stale"
ORPHAN = "_orphan"
_RUN_OF_ROWS = "__cdc_run_id"


def check(
    subscribers: ChangeSet,
    left_current: ChangeSet,
    changed: pa.Table,
    config: PipelineConfig,
    join: JoinConfig,
) -> ChangeSet:
    """The subscribers of changed right keys with ``_stale`` and ``_orphan`` flags (on the driver).

    Args:
        subscribers: ``pk_*, fk_*, _lhs_hash`` of one join.
        left_current: current state rows (tombstones included) of the hop's left side, of at
            least their keys.
        changed: ``pk_*`` of the hop's left keys that changed in this run; they are left out.
    """
    left = config.hop_left(join)
    pks = pk_columns(left)
    found = (
        subscribers.table.join(changed, keys=pks, join_type="left anti")
        if changed.num_rows
        else subscribers.table
    )
    # A column may be both a key part and a foreign-key part (order lines keyed by
    # (order_id, line_no) joined on order_id): each role gets its own copy.
    roles = [
        *zip(left.primary_key, pks, strict=True),
        *((c, f"__cur_{c}") for c in join.foreign_key),
        (HASH, "__cur_hash"),
        (DELETED, "__cur_deleted"),
    ]
    table = left_current.table
    current = pa.table({name: table.column(column) for column, name in roles})
    # Key types agree unless a key column widened since the subscriptions were written.
    found = found.cast(
        pa.schema(
            [
                current.schema.field(c) if c in pks else f
                for c, f in zip(found.column_names, found.schema, strict=True)
            ]
        )
    )
    joined = found.join(current, keys=pks, join_type="left outer")
    gone = pc.fill_null(joined.column("__cur_deleted"), True)
    same = [
        pc.fill_null(same_values(joined.column(f), joined.column(f"__cur_{c}")), False)
        for c, f in zip(join.foreign_key, fk_columns(join), strict=True)
    ]
    same_fk = functools.reduce(pc.and_, same)
    same_hash = pc.fill_null(pc.equal(joined.column(LHS_HASH), joined.column("__cur_hash")), False)
    valid = pc.and_(pc.and_(pc.invert(gone), same_fk), same_hash)
    flagged = joined.select(subscribers.table.column_names)
    flagged = flagged.append_column(STALE, pc.invert(valid)).append_column(
        ORPHAN, pc.or_(gone, pc.invert(same_fk))
    )
    schema = StructType(
        [*subscribers.schema.fields, StructField(STALE, BooleanType()), StructField(ORPHAN, BooleanType())]
    )
    return ChangeSet(subscribers.spark, schema, flagged)


@dataclass(frozen=True)
class Resolved:
    """One incremental run's resolution: per join its instructions and checked subscribers, the
    silver rows of the affected keys (one per key), and the counts the report shows."""

    instructions: Mapping[str, ChangeSet]
    checked: Mapping[str, ChangeSet]
    rows: ChangeSet | None

    @property
    def stale_dropped(self) -> int:
        return sum(c.count_true(STALE) for c in self.checked.values())

    @property
    def affected_keys(self) -> int:
        return 0 if self.rows is None else self.rows.rows

    def orphans(self, join: JoinConfig) -> ChangeSet | None:
        """``fk_*, pk_*`` of the join's leftover subscriptions, if any."""
        found = self.checked.get(join.alias)
        if found is None:
            return None
        t = found.table
        return found.filtered(
            pc.and_(pc.fill_null(t.column(STALE), False), pc.fill_null(t.column(ORPHAN), False))
        )


def incremental(
    storage: Storage,
    config: PipelineConfig,
    changed: Mapping[str, ChangeSet],
    current: Mapping[str, ChangeSet],
    subscribers: Mapping[str, ChangeSet],
    pinned: Mapping[str, int],
    run_id: int,
) -> Resolved:
    """Instructions and the stale check on the driver, then one Spark job for the silver rows
    (one more per chained hop, to read the foreign keys of the next).

    Args:
        changed: per source on the left side of a hop, its changed keys with their ``_old``
            and ``_new`` rows.
        current: per such source, the current state rows of every key of it that may be
            affected (the changed ones and the subscribers of changed right keys), on the driver.
        subscribers: per join alias, the subscribers of its changed right keys.
        pinned: the state versions the run reads.
    """
    instructions = subscription.instructions_all(changed, config)
    changed_keys = {name: _keys(config, name, rows) for name, rows in changed.items()}
    checked = {}
    for alias, found in subscribers.items():
        if found.rows:
            join = config.join_for_alias(alias)
            name = config.source_of(join.source)
            checked[alias] = check(found, current[name], changed_keys[name].table, config, join)
    left, pks = config.left_source, pk_columns(config.left_source)
    reached = _reached(config, checked)
    valid = [reached[j.alias].distinct(pks) for j in config.hops_from(config.left) if j.alias in reached]
    parents = collect.parents_of(instructions, config)
    affected = ChangeSet.concat([changed_keys[config.left], *valid, *parents], pks)
    if not affected.rows:
        return Resolved(instructions, checked, None)
    renamed = dict(zip(left.primary_key, pks, strict=True))
    keys = affected.renamed({p: c for c, p in renamed.items()})
    held = (
        _with_rows_of(storage, config, current[config.left], keys, pinned[config.left])
        if parents
        else current[config.left]
    )
    in_scope = _rows_of_keys(held, keys, list(left.primary_key))
    right = _right_rows_named(storage, config, in_scope, changed, pinned)
    # The run id comes as a column, not as a literal: the query's code then compiles once per
    # session, not once per run (a left source with a column of that name gets the literal).
    run: int | str = run_id
    if _RUN_OF_ROWS not in in_scope.schema.names:
        # Never null, as the literal it stands for (silver's _run_id is NOT NULL however made).
        ids = pa.array([run_id] * in_scope.rows, pa.int64())
        in_scope = in_scope.with_column(_RUN_OF_ROWS, ids, nullable=False)
        run = _RUN_OF_ROWS
    left_rows = one_partition(in_scope.frame, in_scope.rows)
    rows = build_rows(config, left_rows, right, run, merge=left_rows is not in_scope.frame)
    return Resolved(instructions, checked, materialize(rows))


def _with_rows_of(
    storage: Storage, config: PipelineConfig, held: ChangeSet, keys: ChangeSet, version: int
) -> ChangeSet:
    """``held`` (current left rows) with the rows of the ``keys`` it lacks, read by key: the
    parents only a child's change names were not among the keys the state step read."""
    key = list(config.left_source.primary_key)
    missing = keys.filtered(pc.invert(found_in(keys.table, held.table, key)))
    if not missing.rows:
        return held
    read = materialize(
        state.read_current(storage, config.state_path(config.left), key, version, keys=missing)
    )
    table = pa.concat_tables([held.table, read.table.select(held.table.column_names).cast(held.table.schema)])
    return ChangeSet(held.spark, held.schema, table)


def _reached(config: PipelineConfig, checked: Mapping[str, ChangeSet]) -> dict[str, ChangeSet]:
    """Per join, its subscribers that are not stale and whose right key changed: itself
    (``_direct``), or as the hop's left key of a later hop's subscriber that counts. So a stale
    subscription anywhere in a chain reaches no silver row through it (the hops are taken from
    the end of the chain back)."""
    out: dict[str, ChangeSet] = {}
    for level in reversed(lookup.levels(config)):
        for join in level:
            found = checked.get(join.alias)
            if found is None:
                continue
            t = found.table
            counts = pc.fill_null(t.column(lookup.DIRECT), False) if lookup.DIRECT in t.column_names else None
            right, fks = config.sources[join.right], fk_columns(join)
            later = [out[j.alias] for j in config.hops_from(join.alias) if j.alias in out]
            if later:
                pks = pk_columns(right)
                keys = ChangeSet.concat(later, pks).renamed(dict(zip(pks, fks, strict=True)))
                via = found_in(t, keys.table, fks)
                counts = via if counts is None else pc.or_(counts, via)
            live = pc.invert(pc.fill_null(t.column(STALE), True))
            out[join.alias] = found.filtered(live if counts is None else pc.and_(live, counts))
    return out


def _keys(config: PipelineConfig, name: str, changed: ChangeSet) -> ChangeSet:
    """A source's changed keys as ``pk_*``."""
    source = config.sources[name]
    return changed.distinct(list(source.primary_key)).renamed(
        dict(zip(source.primary_key, pk_columns(source), strict=True))
    )


def _rows_of_keys(rows: ChangeSet, keys: ChangeSet, columns: list[str]) -> ChangeSet:
    """The rows whose ``columns`` equal a row of ``keys`` (joined on the driver by position, so
    columns of any type come along)."""
    numbered = rows.table.select(columns).append_column("__row", pa.array(range(rows.rows), pa.int64()))
    hits = numbered.join(keys.table.select(columns), keys=columns, join_type="inner").column("__row")
    return ChangeSet(rows.spark, rows.schema, rows.table.take(pc.unique(hits)))


def _fk_values(rows: ChangeSet, join: JoinConfig) -> ChangeSet:
    """The distinct foreign keys of a hop's left rows on the driver, as the join's ``fk_*``."""
    names = dict(zip(join.foreign_key, fk_columns(join), strict=True))
    return rows.distinct(list(join.foreign_key)).renamed(names)


def _right_rows_named(
    storage: Storage,
    config: PipelineConfig,
    left_rows: ChangeSet,
    changed: Mapping[str, ChangeSet],
    pinned: Mapping[str, int],
) -> dict[str, DataFrame]:
    """Per join, the live right rows the left rows' foreign keys name (a keyed read, skipping
    files); down a chain, those the rows named by the hop before name (read on the driver);
    for a collect join, the arrays of the left rows' children (:func:`cdc_join.join.collect.children_of`)."""
    rows: dict[str, DataFrame] = {}
    held = {config.left: left_rows}
    for join in config.joins:
        if join.collects:
            live = left_rows.filtered(pc.invert(left_rows.table.column(DELETED)))
            parents = live.distinct(list(config.left_source.primary_key))
            rows[join.alias] = collect.children_of(
                storage, config, join, parents, changed.get(join.right), pinned
            )
            continue
        right, path = config.sources[join.right], config.state_path(join.right)
        frame = lookup.right_rows(
            storage, path, pinned[join.right], right, join, _fk_values(held[join.source], join)
        )
        if config.hops_from(join.alias):
            named = materialize(frame)
            held[join.alias] = _values_of(named)
            frame = named.frame
        rows[join.alias] = frame
    return rows


def _values_of(right: ChangeSet) -> ChangeSet:
    """The right rows' values (the ``_right`` struct) as columns of their own."""
    struct = right.schema[RIGHT].dataType
    assert isinstance(struct, StructType)
    column = right.table.column(RIGHT).combine_chunks()
    table = pa.Table.from_struct_array(column) if len(column) else arrow_schema(struct).empty_table()
    return ChangeSet(right.spark, struct, table)


def build_rows(
    config: PipelineConfig,
    left_rows: DataFrame,
    right_rows: Mapping[str, DataFrame],
    run_id: int | str,
    *,
    broadcast: Collection[str] = (),
    merge: bool = False,
) -> DataFrame:
    """Silver rows (upserts and deletes) for left keys, joined to each right table on the fk.

    Args:
        left_rows: current left state rows, tombstones included (a tombstone makes a delete).
        right_rows: per join alias, live right rows as ``fk_*, _right, _right_seq``
            (:func:`cdc_join.join.lookup.right_rows`): those the left rows' keys name, or all.
        run_id: the run writing the rows (lineage), or the name of a column of ``left_rows``
            that holds it: Spark compiles a query's code anew for every new literal in it.
        broadcast: aliases of right tables small enough to broadcast to the join.
        merge: join by sort-merge, for inputs in one partition each
            (:func:`cdc_join.changeset.one_partition`): the whole query is then one Spark job,
            where each broadcast of a right table would run one more.

    Returns:
        ``_pk_*``, the select columns, ``_seq_<alias>`` per source alias, ``_run_id``,
        ``_values_hash`` (:func:`cdc_join.join.hashing.values_hash`) and ``_action``
        (``upsert``/``delete``). A foreign key with a null part matches no row.
    """
    left = config.left_source
    values = ", ".join(quote(f.name) for f in value_fields(left_rows.schema) if f.name != run_id)
    rows = left_rows.selectExpr(
        *[f"{quote(c)} AS {quote(p)}" for c, p in zip(left.primary_key, pk_columns(left), strict=True)],
        f"struct({values}) AS {quote(config.left)}",
        f"{SEQ} AS {quote(lineage_column(config.left))}",
        DELETED,
        f"{quote(run_id) if isinstance(run_id, str) else f'CAST({int(run_id)} AS BIGINT)'} AS {RUN_ID}",
    )
    for join in config.joins:
        right = right_rows[join.alias]
        if join.alias in broadcast:
            right = F.broadcast(right)
        elif merge:
            right = right.hint("merge")
        rows = _join_right(rows, config, join, right)
    return _output(config, rows)


def _join_right(rows: DataFrame, config: PipelineConfig, join: JoinConfig, right: DataFrame) -> DataFrame:
    keys = [f"__{join.alias}__{f}" for f in fk_columns(join)]
    renamed = right.selectExpr(
        *[f"{quote(f)} AS {quote(k)}" for f, k in zip(fk_columns(join), keys, strict=True)],
        f"{RIGHT} AS {quote(join.alias)}",
        f"{RIGHT_SEQ} AS {quote(lineage_column(join.alias))}",
    )
    # A hop matches the right key on its source's fk; a collect join the children's fk on the
    # parent's (left) key, by position.
    named = config.left_source.primary_key if join.collects else join.foreign_key
    on = " AND ".join(
        f"{quote(join.source)}.{quote(c)} = {quote(k)}" for c, k in zip(named, keys, strict=True)
    )
    joined = rows.join(renamed, F.expr(on), "left").drop(*keys)
    if join.collects:
        array_type = renamed.schema[join.alias].dataType
        joined = joined.withColumn(join.alias, collect.empty_when_null(join.alias, array_type))
    return joined


def _output(config: PipelineConfig, rows: DataFrame) -> DataFrame:
    """Silver rows from rows carrying one struct (or null) and one lineage column per alias."""
    missing_inner = [f"{quote(j.alias)} IS NULL" for j in config.joins if j.type is JoinType.INNER]
    action = f"CASE WHEN {' OR '.join([DELETED, *missing_inner])} THEN 'delete' ELSE 'upsert' END"
    lineage = [lineage_column(a) for a in [config.left, *(j.alias for j in config.joins)]]
    columns = [
        *[(f"_{p}", quote(p)) for p in pk_columns(config.left_source)],
        *config.select,
        *[(c, quote(c)) for c in lineage],
        (RUN_ID, RUN_ID),
        (ACTION, action),
    ]
    # One expression each (a select entry as its user wrote it), all named in one call: a
    # classic session pays a dozen round trips to the JVM for each ``alias``.
    names = [name for name, _ in columns]
    built = rows.select(*[F.expr(sql) for _, sql in columns]).toDF(*names)
    # The hash of the select values, which the silver MERGE compares (their types: one analysis).
    types = {f.name: f.dataType for f in built.schema.fields}
    hashed = hashing.values_hash(output_columns(config), types).alias(VALUES_HASH)
    return built.select(*quoted(names[:-1]), hashed, ACTION)


def select_schema(storage: Storage, config: PipelineConfig) -> StructType:
    """The silver columns ``select`` gives over the sources' current row types; every expression
    and every join's foreign key is checked against them before a run writes anything.

    Spark analyses each expression over an empty frame with one struct column per source alias
    (no job runs). An expression naming a column a source does not have, or failing to analyse,
    is a :class:`~cdc_join.errors.ConfigError` naming the config file, the ``select`` key and
    Spark's reason.
    """
    aliases = [(config.left, config.left), *((j.alias, j.right) for j in config.joins)]
    after = {name: storage.schema(config.bronze_path(name))["_after"].dataType for name in config.sources}
    rows = StructType(
        [
            StructField(alias, collect.element_type(after[source]) if alias in collected else after[source])
            for alias, source in aliases
            for collected in [{j.alias for j in config.joins if j.collects}]
        ]
    )
    problems = _foreign_key_problems(config, after)
    empty = storage.spark.createDataFrame([], rows)
    if not problems:
        # All expressions in one analysis (one round trip to the JVM, not one per expression);
        # when one fails, each is analysed alone below, so that every failure is reported.
        with contextlib.suppress(Exception):
            found = empty.select(*[F.expr(expression) for _, expression in config.select]).schema
            return StructType(
                [
                    StructField(name, f.dataType, f.nullable, f.metadata)
                    for (name, _), f in zip(config.select, found.fields, strict=True)
                ]
            )
    known = "; ".join(
        f"{alias}: {', '.join(f.name for f in rows[alias].dataType.fields)}" for alias, _ in aliases
    )
    fields = []
    for name, expression in config.select:
        try:
            fields.append(empty.select(F.expr(expression).alias(name)).schema[name])
        except Exception as e:  # AnalysisException, ParseException; their first line says why
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            problems.append(
                ConfigError(
                    f"{expression!r} cannot be computed from the sources' columns ({known}): {reason}",
                    key=f"select.{name}",
                )
            )
    if problems:
        raise config_errors(problems, config.config_path)
    return StructType(fields)


def _foreign_key_problems(config: PipelineConfig, after: Mapping[str, StructType]) -> list[ConfigError]:
    """A join's foreign-key columns its source's rows (``after``: per source) lack: the hop's
    left side's, or for a collect join the children's."""
    problems = []
    for i, join in enumerate(config.joins):
        left_columns = after[config.hop_left(join).name]
        missing = [c for c in join.foreign_key if c not in left_columns.names]
        if missing:
            problems.append(
                ConfigError(
                    f"{join.right if join.collects else join.source!r} has no column "
                    f"{', '.join(map(repr, missing))}; its columns are {', '.join(left_columns.names)}",
                    key=f"joins[{i}].foreign_key",
                )
            )
    return problems


def recompute(storage: Storage, config: PipelineConfig, pinned: Mapping[str, int], run_id: int) -> DataFrame:
    """Silver rows of every left key: the whole join of the pinned state tables."""
    left = config.left_source
    left_rows = state.read_current(
        storage, config.state_path(config.left), left.primary_key, pinned[config.left]
    )
    return _build_from_whole_right(storage, config, left_rows, pinned, run_id)


def recompute_affected(
    storage: Storage,
    config: PipelineConfig,
    changed: Mapping[str, ChangeSet],
    pinned: Mapping[str, int],
    run_id: int,
) -> DataFrame | None:
    """Silver rows of the left keys a run affects, found and built by joining whole state
    tables in Spark (the cost rule's recompute): the set-based form of :func:`incremental`.

    The affected keys are the changed left keys and every left key whose foreign key names an
    affected key of a hop's right side: one that changed, or, down a chain, whose own foreign
    key names an affected key of the next hop (:func:`cdc_join.join.lookup.keys_naming`, scans of
    the state tables, instead of prefix-range reads of the subscriptions). Their rows come from
    the current left rows, so there is nothing stale to check. Rows of other keys cannot have
    changed since the last completed run left silver right, so silver is not read.

    Args:
        changed: per source, its changed keys (its primary key columns, any others ignored).
        pinned: the state versions the run reads (after this run's appends).

    Returns:
        As :func:`build_rows`, or ``None`` when nothing is affected.
    """
    found = _affected(storage, config, config.left, changed, pinned)
    if found is None:
        return None
    # A key listed twice is read once: a semi-join keeps each state row at most once. It puts
    # the key columns first; the row's own order is restored, since ``select`` may depend on it
    # (``to_json(orders)``).
    key = list(config.left_source.primary_key)
    stored = storage.read(config.state_path(config.left), pinned[config.left])
    in_scope = stored.join(found, key, "left_semi").select(*quoted(stored.columns))
    left_rows = state.newest(in_scope, key)
    return _build_from_whole_right(storage, config, left_rows, pinned, run_id)


def _affected(
    storage: Storage,
    config: PipelineConfig,
    alias: str,
    changed: Mapping[str, ChangeSet],
    pinned: Mapping[str, int],
) -> DataFrame | None:
    """The keys (primary key columns) of ``alias``'s source whose joined row a run changes:
    its changed keys, and those naming an affected key of a hop off ``alias``; ``None``: none."""
    name = config.source_of(alias)
    source = config.sources[name]
    own = changed[name].distinct(list(source.primary_key))
    hits = [own.frame] if own.rows else []
    for join in config.hops_from(alias):
        if join.collects:
            children = changed[join.right]
            if children.rows:
                messages = {join.alias: subscription.instructions(children, config.hop_left(join), join)}
                for parents in collect.parents_of(messages, config):
                    named = dict(zip(pk_columns(source), source.primary_key, strict=True))
                    hits.append(parents.renamed(named).frame)
            continue
        further = _affected(storage, config, join.alias, changed, pinned)
        if further is None:
            continue
        right = config.sources[join.right]
        named = further.selectExpr(
            *[f"{quote(c)} AS {quote(f)}" for c, f in zip(right.primary_key, fk_columns(join), strict=True)]
        )
        few = changed[join.right].rows <= lookup.BROADCAST_KEYS and not config.hops_from(join.alias)
        hits.append(lookup.keys_naming(storage, config, join, named, pinned[name], small=few))
    return functools.reduce(DataFrame.unionByName, hits) if hits else None


def _build_from_whole_right(
    storage: Storage, config: PipelineConfig, left_rows: DataFrame, pinned: Mapping[str, int], run_id: int
) -> DataFrame:
    """:func:`build_rows` of ``left_rows`` joined to every current right row, right tables
    under :data:`BROADCAST_BYTES` broadcast."""
    right = {
        join.alias: collect.arrays(
            state.read_current(
                storage,
                config.state_path(join.right),
                config.sources[join.right].primary_key,
                pinned[join.right],
            ),
            config,
            join,
            collect.live_parents(left_rows),
        )
        if join.collects
        else lookup.right_rows(
            storage, config.state_path(join.right), pinned[join.right], config.sources[join.right], join, None
        )
        for join in config.joins
    }
    small = {
        join.alias
        for join in config.joins
        if _bytes(storage, config.state_path(join.right), pinned[join.right]) <= BROADCAST_BYTES
    }
    return build_rows(config, left_rows, right, run_id, broadcast=small)


#: A right state table this small (its data files, at the pinned version) is broadcast to the
#: whole-join recompute, which then keeps the left rows partitioned and sorted by their key from
#: the newest-row aggregate to silver's comparison, instead of shuffling and sorting them by the
#: foreign key and back.
BROADCAST_BYTES = 64 * 1024 * 1024


def _bytes(storage: Storage, path: str, version: int) -> int:
    return sum(f.size_bytes for f in storage.files(path, version))
