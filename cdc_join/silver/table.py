"""Joined rows → the silver table (KIP-213's output KTable), with MERGEs that write only changes.

Silver is keyed by the left primary key (``_pk_*`` columns, so the key is there even when the
select list does not carry it). A row is inserted when new, updated only when one of its data
columns differs (lineage columns alone do not cause a rewrite), and deleted when the row's
action says so. Applying the same rows twice changes nothing, which is what a rerun after a
crash does. Change Data Feed is on, so downstream jobs can read silver incrementally, unless
the pipeline turns it off (``silver_change_feed: false``): then a MERGE need not read the rows
it replaces for their pre-images. A run that writes silver sets the property as configured.

A run's MERGE tells a changed row by ``_values_hash`` (the hash of its data columns), one
column, so that Delta need not read silver's other columns to decide; a recompute compares the
values themselves (:func:`differences`), so a full refresh also repairs a row edited by hand.

A run MERGEs with the silver version it saw at its start as the expected version: if another
run wrote silver in between, the MERGE fails instead of overwriting newer rows with older ones.

What defines silver's rows (the left source, the joins, ``select``, ``output``, the joined
sources' keys and row types) is kept in each run's checkpoint (:func:`definition`). When it
changes between runs, the next run recomputes every row (:func:`redefined` gives the reason):
added columns are added and filled; a dropped or retyped column makes that recompute replace
silver's rows and schema in one commit. Either way silver stays the same Delta table, with its
history and change feed.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F
from pyspark.sql.types import DataType, MapType, StructField, StructType

from cdc_join.changeset import ChangeSet, Rows, collect, distinct_rows, found_in, frame_of, from_arrow
from cdc_join.columns import (
    ACTION,
    CHANGE_DATA_FEED_PROPERTY,
    RUN_ID,
    VALUES_HASH,
    output_columns,
    silver_key_columns,
    table_properties,
)
from cdc_join.config import JoinConfig, PipelineConfig
from cdc_join.errors import ConcurrentRunError
from cdc_join.join import hashing
from cdc_join.schemas import exact_json, quote, widens_to
from cdc_join.storage import MergeSpec, Storage, keyed


@dataclass(frozen=True)
class SilverReport:
    """What a silver MERGE did."""

    inserted: int
    updated: int
    deleted: int
    files_added: int | None
    files_removed: int | None
    version: int
    rows_written: int | None = None
    """Rows in the data files the MERGE wrote: inserted and updated rows, plus the unchanged
    rows copied out of every file it rewrote (Delta rewrites whole files; ``None`` if unknown)."""

    def as_counts(self) -> dict[str, int | None]:
        return {
            "inserted": self.inserted,
            "updated": self.updated,
            "deleted": self.deleted,
            "rows_written": self.rows_written,
            "files_added": self.files_added,
            "files_removed": self.files_removed,
        }


NOTHING = {"inserted": 0, "updated": 0, "deleted": 0, "rows_written": 0}
COPIES = "_copies"


def prepare(storage: Storage, config: PipelineConfig, rows: Rows, expected_version: int | None) -> int:
    """Create silver for rows of this shape, or add new columns, widen types and turn its
    change feed on or off as the pipeline says.

    ``expected_version`` is silver's version when the run started (``None``: no silver yet);
    if silver moved since, another run wrote it and this one stops. Returns the version the
    run's MERGE must find.
    """
    path, schema, feed = config.silver_path, _columns(rows.schema), config.silver_change_feed
    if expected_version is None:
        if not storage.create(path, schema, cdf=feed, properties=table_properties("silver")):
            raise ConcurrentRunError(f"silver {path} was created by another run while this one worked")
        return storage.version(path)
    if storage.version(path) != expected_version:
        raise ConcurrentRunError(f"silver {path} moved past version {expected_version}: another run wrote it")
    storage.set_properties(path, {CHANGE_DATA_FEED_PROPERTY: str(feed).lower()})
    storage.evolve(path, schema)
    return storage.version(path)


def _columns(schema: StructType) -> StructType:
    """Silver's columns of rows on their way into silver (all but ``_action``): nullable but
    ``_run_id``, which every row has. Silver's schema is then the same whichever plan's rows
    create it (rows from the driver keep a state table's NOT NULLs, Spark's rebuild does not)."""
    kept = [f for f in schema.fields if f.name != ACTION]
    return StructType([StructField(f.name, f.dataType, f.name != RUN_ID, f.metadata) for f in kept])


def definition(config: PipelineConfig, types: Sequence[Sequence[str]] | None = None) -> dict[str, Any]:
    """What defines silver's rows, as kept in the checkpoint: the left source, the joins, the
    select list, the output, the primary keys of the joined sources and, given, their row
    types (:func:`source_types`)."""
    found = {
        "left": config.left,
        "joins": [
            [
                j.right,
                j.alias,
                list(j.foreign_key),
                j.type.value,
                *([j.source] if j.source != config.left else []),
            ]
            for j in config.joins
        ],
        "select": [[name, expression] for name, expression in config.select],
        "output": config.output,
        "keys": [[name, list(config.sources[name].primary_key)] for name in _joined(config)],
    }
    if types is not None:
        found["types"] = [list(t) for t in types]
    return found


def _join_definition(config: PipelineConfig, join: JoinConfig) -> list[Any]:
    """A join as the definition keeps it; ``from`` only in a chain (so that a pipeline without
    one keeps the definition it had before chains)."""
    found: list[Any] = [join.right, join.alias, list(join.foreign_key), join.type.value]
    return found if join.source == config.left else [*found, join.source]


def source_types(
    storage: Storage, config: PipelineConfig, versions: Mapping[str, int] | None = None
) -> list[list[str]]:
    """Each joined source's row type in bronze (at ``versions``, the ones a run pinned; default
    the latest), as text.

    A ``select`` value may depend on a column's type, not only its value (``concat`` of a
    decimal whose scale grew, ``to_json`` of a row that gained a column, a float widened to
    double): when a type changes, the rows that did not change would keep values the new types
    no longer give, so the definition records the types and a change recomputes every row. The
    types are those of the bronze a run read: an ingest that widens a type while the run works
    is the next run's to apply, so the next run must see the change.
    """

    def row_type(name: str) -> str:
        path = config.bronze_path(name)
        pinned = None if versions is None else versions.get(name)
        schema = (
            storage.read(path, pinned).schema
            if pinned is not None and storage.version(path) != pinned
            else storage.schema(path)
        )
        return schema["_after"].dataType.simpleString()

    return [[name, row_type(name)] for name in _joined(config)]


def _joined(config: PipelineConfig) -> list[str]:
    return list(dict.fromkeys([config.left, *(j.right for j in config.joins)]))


def _now(
    previous: Mapping[str, Any], config: PipelineConfig, types: Sequence[Sequence[str]] | None = None
) -> dict[str, Any]:
    """This config's definition, without what ``previous`` (an older version's) did not record."""
    now = definition(config, types)
    for recorded in ("keys", "types"):  # not in checkpoints written before 2026-11-28
        if recorded not in previous:
            now.pop(recorded, None)
    if "types" in previous and "types" not in now:
        now["types"] = previous["types"]  # not asked about types
    return now


def restated(previous: Mapping[str, Any] | None, config: PipelineConfig) -> str | None:
    """Why every state table must be rebuilt from bronze and silver's rows replaced, or ``None``:
    the left source is another one than in the last run, or a joined source's primary key
    changed. State rows are kept per primary key and silver's rows per left key, so neither
    can be carried over; a new left source's state may also be left over from an earlier
    config, and out of date (e.g. ``left: a``, then ``b``, then ``a`` again)."""
    if previous is None:
        return None
    if previous.get("left") != config.left:
        return f"the left source changed since the last run ({previous.get('left')} → {config.left})"
    now = _now(previous, config)
    if "keys" not in now or previous["keys"] == now["keys"]:
        return None
    before = {name: key for name, key in previous["keys"]}
    changed = [name for name, key in now["keys"] if name in before and before[name] != key]
    if not changed:
        return None
    return f"the primary key of {', '.join(changed)} changed since the last run"


def redefined(
    previous: Mapping[str, Any] | None,
    config: PipelineConfig,
    types: Sequence[Sequence[str]] | None = None,
) -> str | None:
    """Why silver must be recomputed because its definition (with ``types``, the sources' row
    types) changed since the last run, or ``None`` (also when the last run did not record one)."""
    if previous is None:
        return None
    now = _now(previous, config, types)
    if previous == now:
        return None
    before, after = dict(map(tuple, previous.get("select", []))), dict(map(tuple, now["select"]))
    parts = []
    for word, names in (
        ("added", [n for n in after if n not in before]),
        ("dropped", [n for n in before if n not in after]),
        ("changed", [n for n in after if n in before and before[n] != after[n]]),
    ):
        if names:
            parts.append(f"{word} {', '.join(names)}")
    parts += [
        f"{key} changed" for key in ("left", "joins", "output", "keys") if previous.get(key) != now.get(key)
    ]
    if previous.get("types") != now.get("types"):
        before_types = {name: text for name, text in previous.get("types", [])}
        retyped = [name for name, text in now.get("types", []) if before_types.get(name, text) != text]
        if retyped:  # (a source joined or no longer joined is told as a change of the joins)
            parts.append(f"column types of {', '.join(retyped)} changed")
    return f"silver's definition changed since the last run ({'; '.join(parts) or 'select order'})"


def joins_redefined(previous: Mapping[str, Any] | None, config: PipelineConfig) -> bool:
    """Whether the left source or a join changed since the last run's definition: the
    subscription tables then describe other joins and must be rebuilt, not appended to."""
    if previous is None:
        return False
    now = _now(previous, config)
    return any(previous.get(key) != now.get(key) for key in ("left", "joins", "keys"))


def write_all(
    storage: Storage,
    config: PipelineConfig,
    rows: DataFrame,
    expected_version: int | None,
    replace: str | None = None,
) -> dict[str, Any]:
    """Make silver equal ``rows``, the *whole* join: MERGE only its differences, or, when a
    column was dropped or changed type in a way silver cannot widen to, or ``replace`` gives a
    reason (silver's rows are keyed otherwise: a MERGE on the new key would match none of
    them), replace every row and the schema in one overwrite commit. Returns the run report's
    counts."""
    path = config.silver_path
    if expected_version is not None and replace:
        return _replace_all(storage, config, rows, expected_version, replace)
    if expected_version is not None and _reshaped(storage.schema(path), _columns(rows.schema)):
        return _replace_all(storage, config, rows, expected_version, "columns dropped or retyped")
    expected = prepare(storage, config, rows, expected_version)
    if expected_version is None:
        # Silver was created by this run and is empty: its rows are the upserts, written as
        # they stream out of Spark instead of collected for a MERGE.
        upserts = rows.filter(F.col(ACTION) == "upsert").drop(ACTION)
        written = storage.append(path, upserts, expected_version=expected)
        inserted = written.rows_inserted or 0
        return {**NOTHING, "inserted": inserted, "rows_written": inserted, "files_added": written.files_added}
    changes = differences(storage, config, rows)
    found = collect(changes)
    if not found.num_rows:
        return dict(NOTHING)
    if pc.max(found.column(COPIES)).as_py() > 1:
        # Written by hand or by another tool: a MERGE would update every copy alike.
        return _replace_all(storage, config, rows, expected, "keys held more than once")
    schema = StructType([f for f in changes.schema.fields if f.name != COPIES])
    rows_to_merge = from_arrow(storage.spark, schema, found.drop_columns([COPIES]))
    return merge(storage, config, rows_to_merge, expected_version=expected, compared=True).as_counts()


def _replace_all(
    storage: Storage, config: PipelineConfig, rows: DataFrame, expected_version: int, why: str
) -> dict[str, Any]:
    """Replace silver's rows (and schema) with the upserts of ``rows`` in one overwrite commit."""
    path = config.silver_path
    if storage.version(path) != expected_version:
        raise ConcurrentRunError(f"silver {path} moved past version {expected_version}: another run wrote it")
    upserts = rows.filter(F.col(ACTION) == "upsert").drop(ACTION)
    written = storage.overwrite(path, upserts, expected_version=expected_version, replace_schema=True)
    return {**NOTHING, "inserted": written.rows_inserted, "replaced": why}


def reshapes(storage: Storage, config: PipelineConfig, rows: DataFrame) -> bool:
    """Whether writing ``rows`` needs silver's rows and schema replaced (see :func:`write_all`):
    silver has a column they lack, or one whose type cannot widen to theirs. Schemas only."""
    path = config.silver_path
    return storage.exists(path) and _reshaped(storage.schema(path), _columns(rows.schema))


def _reshaped(current: StructType, wanted: StructType) -> bool:
    """Whether silver has a column ``wanted`` lacks, or one whose type cannot widen to it."""
    have = {f.name: f.dataType for f in current.fields}
    names = {f.name for f in wanted.fields}
    dropped = any(name not in names for name in have)
    retyped = any(f.name in have and not widens_to(have[f.name], f.dataType) for f in wanted.fields)
    return dropped or retyped


def merge(
    storage: Storage,
    config: PipelineConfig,
    rows: Rows,
    *,
    expected_version: int | None = None,
    compared: bool = False,
) -> SilverReport:
    """MERGE upserts and deletes (``_action``) into silver; see the module docstring.

    An upsert of a key silver holds updates it only when its values differ (:func:`_differ`);
    with ``compared``, the rows are known to differ already (:func:`differences` compared
    their values) and every one updates.
    """
    replaced = _replace(storage, config, rows, expected_version, compared)
    if replaced is not None:
        return replaced
    keys = silver_key_columns(config)
    upsert = f"s.{ACTION} = 'upsert'"
    metrics = storage.merge(
        config.silver_path,
        rows,
        MergeSpec(
            on=" AND ".join(f"t.{quote(c)} = s.{quote(c)}" for c in keys),
            delete_condition=f"s.{ACTION} = 'delete'",
            update_condition=upsert if compared else f"{upsert} AND ({_differ(config, rows)})",
            insert_condition=upsert,
            exclude_columns=(ACTION,),
        ),
        expected_version=expected_version,
    )
    raw = metrics.extra.get("metrics") or {}
    # delta-rs and delta-spark name the copied-rows metric differently.
    copied = raw.get("num_target_rows_copied", raw.get("numTargetRowsCopied"))
    inserted, updated = metrics.rows_inserted or 0, metrics.rows_updated or 0
    return SilverReport(
        inserted=inserted,
        updated=updated,
        deleted=metrics.rows_deleted or 0,
        files_added=metrics.files_added,
        files_removed=metrics.files_removed,
        version=metrics.version,
        rows_written=None if copied is None else inserted + updated + int(copied),
    )


def _replace(
    storage: Storage, config: PipelineConfig, rows: Rows, expected_version: int | None, compared: bool
) -> SilverReport | None:
    """The MERGE of :func:`merge` as one commit that deletes the rows of the keys that change
    and appends their new rows, where the backend marks deleted rows instead of rewriting files
    (``Storage.replaces_keys_in_place``: delta-spark's deletion vectors); ``None`` where it
    does not apply, and the MERGE runs.

    Delta's MERGE with the change data feed reads every column of every file it touches for
    the pre-images; the replace reads silver's key and ``_values_hash`` columns of the rows'
    keys, leaves out upserts whose hash silver holds (but with ``compared``: a recompute's
    differences differ from silver's rows whatever their hashes say) and deletes of keys
    silver lacks, as the MERGE's conditions would, and writes the rest. Its feed has ``delete`` and ``insert``
    where the MERGE's has ``update_preimage`` and ``update_postimage`` (docs/storage.md).
    """
    if not getattr(storage, "replaces_keys_in_place", False) or expected_version is None:
        return None
    if not isinstance(rows, ChangeSet) or VALUES_HASH not in rows.schema.names:
        return None
    path, keys = config.silver_path, silver_key_columns(config)
    written = [n for n in rows.schema.names if n != ACTION]
    held = {f.name: f.dataType for f in storage.schema(path).fields}
    if held != {n: rows.schema[n].dataType for n in written}:
        return None  # a column silver or the rows lack, or a wider type: the MERGE evolves silver
    table = rows.table
    named = distinct_rows(table, keys)
    if not keyed.nameable(named):
        return None
    hashes = _held_hashes(storage, path, keys, named, rows.schema)
    present = found_in(table, hashes, keys)
    upserts = pc.equal(table.column(ACTION), "upsert")
    if not compared:  # (a recompute's rows differ from silver's, whatever their hashes say)
        upserts = pc.and_(upserts, pc.invert(found_in(table, hashes, [*keys, VALUES_HASH])))
    new = pc.and_(upserts, pc.invert(present))
    deletes = pc.and_(pc.equal(table.column(ACTION), "delete"), present)
    changing = table.filter(pc.or_(upserts, deletes))
    if not changing.num_rows:
        return SilverReport(0, 0, 0, 0, 0, storage.version(path), rows_written=0)
    inserted, upserted, deleted = (_count(m) for m in (new, upserts, deletes))
    kept = table.filter(upserts).select(written)
    schema = StructType([rows.schema[n] for n in written])
    metrics = storage.replace_keys(
        path,
        from_arrow(storage.spark, schema, kept),
        keys,
        distinct_rows(changing, keys),
        expected_version=expected_version,
    )
    return SilverReport(
        inserted=inserted,
        updated=upserted - inserted,
        deleted=deleted,
        files_added=metrics.files_added,
        files_removed=metrics.files_removed,
        version=metrics.version,
        rows_written=kept.num_rows,
    )


def _count(mask: Any) -> int:
    return int(pc.sum(pc.cast(mask, pa.int64())).as_py() or 0)


def _held_hashes(
    storage: Storage, path: str, keys: Sequence[str], named: pa.Table, schema: StructType
) -> pa.Table:
    """Silver's keys and ``_values_hash`` for the keys of ``named`` (a row without the hash,
    written before silver had it, holds null there: it matches no upsert and is rewritten).

    Read on the driver where the backend can (``Storage.read_rows``: no Spark job), else a
    semi-join with the keys as a small frame: a ``Column.isin`` of thousands of values costs a
    round trip to the JVM per value in a classic session (4,500 keys: 3.2 s to build it)."""
    if len(keys) == 1:
        values = named.column(keys[0]).to_pylist()
        found = storage.read_rows(path, keys[0], values, columns=[*keys, VALUES_HASH])
        if found is not None:
            return found
    wanted = frame_of(from_arrow(storage.spark, StructType([schema[k] for k in keys]), named.select(keys)))
    found = storage.read(path).join(F.broadcast(wanted), list(keys), "left_semi")
    return collect(found.select(*[F.col(quote(k)) for k in keys], F.col(VALUES_HASH)))


def _differ(config: PipelineConfig, rows: Rows) -> str:
    """SQL: a source row's values differ from the silver row it matched.

    Rows built by :mod:`cdc_join.join.resolve` carry ``_values_hash``: comparing that one column
    lets Delta decide without reading silver's other columns for it. A silver row written
    before silver had the column holds NULL there and counts as changed, once. Rows without
    the column (written by hand) are compared column by column.
    """
    if VALUES_HASH in rows.schema.names:
        return f"t.{VALUES_HASH} IS DISTINCT FROM s.{VALUES_HASH}"
    return " OR ".join(f"(t.{quote(c)} IS DISTINCT FROM s.{quote(c)})" for c in output_columns(config))


def differences(storage: Storage, config: PipelineConfig, rows: DataFrame) -> DataFrame:
    """The rows that change silver when ``rows`` is the *whole* join: new or different upserts,
    and deletes of every silver key that ``rows`` deletes or does not have at all. Each comes
    with ``_copies``, how many rows silver holds for its key (a MERGE cannot mend more than one);
    a key silver holds more than once comes once per copy.

    A recompute builds a row for every left key; comparing with silver first (one join on the
    key) leaves a MERGE of the real changes only, and removes silver rows whose key has no
    source row any more (or never had one).
    """
    path = config.silver_path
    if not storage.exists(path):
        return rows.filter(F.col(ACTION) == "upsert").withColumn(COPIES, F.lit(0).cast("long"))
    silver = storage.read(path)
    keys, columns = silver_key_columns(config), output_columns(config)
    have = {f.name: f.dataType for f in silver.schema.fields}
    types = {f.name: f.dataType for f in rows.schema.fields}
    by_key = Window.partitionBy(*[F.col(quote(k)) for k in keys])
    current, differs = _compared_values(silver, keys, columns, have, types)
    # Silver's rows with how many rows hold their key (a key held twice, written by hand or by
    # another tool, is rewritten whatever its values). A window, not a grouping: it sorts by
    # the key as the join below does, so the join reuses that sort, and no aggregate has to
    # carry every column.
    current = current.withColumn(COPIES, F.count(F.lit(1)).over(by_key))
    joined = rows.join(current, keys, "full_outer")
    present, in_rows = F.col(COPIES).isNotNull(), F.col(ACTION).isNotNull()
    upsert = in_rows & (F.col(ACTION) == "upsert") & (~present | differs | (F.col(COPIES) > 1))
    delete = present & (~in_rows | (F.col(ACTION) == "delete"))
    action = F.when(upsert, F.lit("upsert")).when(delete, F.lit("delete"))
    kept = joined.withColumn(ACTION, action).filter(F.col(ACTION).isNotNull())
    return kept.select(
        *[F.col(quote(c)) for c in rows.columns], F.coalesce(F.col(COPIES), F.lit(0)).alias(COPIES)
    )


def _compared_values(
    silver: DataFrame,
    keys: Sequence[str],
    columns: Sequence[str],
    have: Mapping[str, DataType],
    types: Mapping[str, DataType],
) -> tuple[DataFrame, Column]:
    """Silver's side of :func:`differences` (its key and what its values are compared by), and
    the condition that a joined row's values differ from silver's."""
    if columns and all(have.get(c) == types[c] for c in columns):
        # Silver's side is narrowed to its key and a fingerprint of its values: the join then
        # moves the wide rows of one side only. Silver was widened to these types (prepare).
        current = silver.select(*[F.col(quote(k)) for k in keys], _fingerprint(columns, have).alias("__s"))
        return current, ~_fingerprint(columns, types).eqNullSafe(F.col("__s"))
    # A column silver lacks or holds in another type: compare value by value.
    current = silver.select(
        *[F.col(quote(k)) for k in keys],
        *[_comparable(F.col(quote(c)), have[c]).alias(f"__s{i}") for i, c in enumerate(columns) if c in have],
    )
    differs = functools.reduce(
        operator.or_,
        [
            ~_comparable(F.col(quote(c)), types[c]).eqNullSafe(F.col(f"__s{i}")) if c in have else F.lit(True)
            for i, c in enumerate(columns)
        ],
        F.lit(False),
    )
    return current, differs


def _fingerprint(columns: Sequence[str], types: Mapping[str, DataType]) -> Column:
    """96 bits of the values of ``columns``: xxhash64 and murmur3 over the same arguments
    (:func:`~cdc_join.join.hashing.value_arguments`). Rows that differ get equal fingerprints with a
    chance of about 2^-96 per row.
    """
    args = hashing.value_arguments(columns, types)
    return F.struct(F.xxhash64(*args).alias("x"), F.hash(*args).alias("m"))


def _comparable(column: Column, data_type: DataType) -> Column:
    """A value Spark can compare for equality (maps cannot be: their JSON text can)."""
    return exact_json(column) if isinstance(data_type, MapType) else column
