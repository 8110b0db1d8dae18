"""Is silver right? A recompute of the join from bronze, compared with silver row for row.

The expected silver comes from bronze alone (README.md, "What silver holds"): per source, the
newest event of each key by the sequence rule, deletes and truncates applied
(:func:`cdc_join.join.rebuild.from_events`), then the join (:func:`cdc_join.join.resolve.build_rows`). The
pipeline's state and subscription tables are not read for it, so a damaged internal table
cannot hide a wrong silver: it shows up as a difference. The internal tables are checked
against the same recompute as well, since a damaged one makes the *next* runs wrong:

- state: every live row of a state table must be the newest event of its key in bronze;
- subscriptions: every live left row with a foreign key must have its subscription, with its
  current hash (leftover subscriptions are allowed: they only cost work, as the stale check
  drops what they answer).

``source="state"`` recomputes from the state tables instead: faster, but blind to a damaged
state table.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import reduce

from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import ArrayType, DataType, MapType, StructType

from cdc_join.checkpoint import Checkpoint, last_checkpoint
from cdc_join.columns import (
    ACTION,
    DELETED,
    FILE,
    HASH,
    LHS_HASH,
    LINE,
    RUN,
    SEQ,
    fk_columns,
    output_columns,
    pk_columns,
    silver_key_columns,
)
from cdc_join.config import PipelineConfig
from cdc_join.join import collect, lookup, rebuild, resolve, state, subscription
from cdc_join.landing.ingest import beyond_lookback, legacy_warnings
from cdc_join.landing.listing import landing_warnings, list_folders
from cdc_join.locations import local_bytes
from cdc_join.schemas import exact_json, quoted, same_type, widens_to
from cdc_join.storage import Storage, commits

SOURCES = ("bronze", "state")
#: Spark's settings for a verify of a small lake (:func:`read_bytes` up to
#: :data:`cdc_join.session.SMALL_WORK_BYTES`) in a session started for it: one shuffle partition
#: and no adaptive execution, as the test sessions run. Its recompute is a few windows and joins
#: of rows read on the driver, which adaptive execution runs as about 24 jobs, one per query
#: stage (5 without it). Measured (2026-12-08, a new `cdc-join verify` process on delta-rs,
#: README's two-source pipeline, interleaved, 6 each, on a slow hour of this VM): median 12.0 s
#: -> 11.5 s, 8.8-12.4 s against 11.5-13.2 s, faster in 5 of the 6 pairs.
SMALL_LAKE_CONF = {"spark.sql.adaptive.enabled": "false", "spark.sql.shuffle.partitions": "1"}


def read_bytes(config: PipelineConfig) -> int | None:
    """The bytes of the tables a verify reads (bronze, silver), from the local file system
    without Spark; ``None`` where a table is not a local folder. A session started for a
    verify asks it (:attr:`cdc_join.session.DeferredSession.work_bytes`)."""
    return local_bytes([*(config.bronze_path(s) for s in config.sources), config.silver_path])


@dataclass(frozen=True)
class VerifyReport:
    """How silver (and the internal tables) differ from a recompute of the join."""

    expected_rows: int
    silver_rows: int
    missing: int
    extra: int
    different: int
    samples: tuple[str, ...] = ()
    duplicated: int = 0
    """Keys silver holds more than once."""
    notes: tuple[str, ...] = ()
    state_differences: Mapping[str, int] = field(default_factory=dict)
    subscription_differences: Mapping[str, int] = field(default_factory=dict)
    source: str = "bronze"
    repaired: bool = False
    unlisted: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Per source, landing files no run will ingest (older than ``landing_lookback_hours``)."""
    unfinished: tuple[str, ...] = ()
    """Tables a run wrote after the last completed one (see :func:`unfinished`): then silver is
    not compared, the rerun finishes that run's work."""

    @property
    def silver_ok(self) -> bool:
        return self.missing == self.extra == self.different == self.duplicated == 0

    @property
    def ok(self) -> bool:
        if self.unfinished:
            return False
        internal = [*self.state_differences.values(), *self.subscription_differences.values()]
        return self.silver_ok and not any(internal) and not self.unlisted

    def summary(self) -> str:
        if self.unfinished:
            return (
                f"a run of this pipeline is unfinished: it wrote {', '.join(self.unfinished)} after the "
                "last completed run, and stopped before its commit (or is still running). Silver is "
                "not compared until it is finished: run `cdc-join run` (it completes that work), "
                "then verify again"
            )
        if self.ok:
            head = f"silver matches the join of the current sources (recomputed from {self.source})"
        else:
            head = (
                f"silver DIFFERS from a full recompute (from {self.source})"
                if not self.silver_ok
                else (
                    "silver matches, but internal tables DIFFER from bronze (the next runs would go wrong)"
                    if not self.unlisted
                    else "silver matches bronze, but landing files are left out"
                )
            )
        lines = [
            f"{head}: expected {self.expected_rows} rows, silver has {self.silver_rows}; "
            f"missing {self.missing}, extra {self.extra}, different {self.different}"
            + (f", {self.duplicated} keys more than once" if self.duplicated else "")
        ]
        lines += [f"  {note}" for note in self.notes]
        for name, count in self.state_differences.items():
            if count:
                lines.append(f"  state table of {name}: {count} keys differ from bronze")
        for alias, count in self.subscription_differences.items():
            if count:
                lines.append(f"  subscriptions of {alias}: {count} live left rows lack their subscription")
        for name, files in self.unlisted.items():
            shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
            lines.append(
                f"  landing files of {name} no run will ingest: {len(files)} ({shown}), modified before "
                "the lookback window; run once without landing_lookback_hours to take them in"
            )
        lines += [f"  e.g. {s}" for s in self.samples]
        if self.repaired:
            lines.append("  repaired: a full refresh rebuilt state, subscriptions and silver")
        return "\n".join(lines)


def current_from_bronze(
    storage: Storage, config: PipelineConfig, name: str, version: int | None = None
) -> DataFrame:
    """Newest row per key of a source implied by its whole bronze table (tombstones included),
    at ``version`` (default: the latest)."""
    source = config.sources[name]
    events = storage.read(config.bronze_path(name), version)
    row_type = events.schema["_after"].dataType
    return rebuild.from_events(events, source, state.state_schema(row_type), run_id=0)


def expected_silver(
    storage: Storage,
    config: PipelineConfig,
    source: str = "bronze",
    current: Mapping[str, DataFrame] | None = None,
) -> DataFrame:
    """Silver as it should be: the join of the sources' current rows (upserts only).

    ``current``: the sources' current rows (tombstones included) when already at hand."""
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, not {source!r}")
    current = current or _current(storage, config, source, last_checkpoint(storage, config))
    right = {
        join.alias: collect.arrays(
            current[join.right], config, join, collect.live_parents(current[config.left])
        )
        if join.collects
        else _right_rows(current[join.right], config, join)
        for join in config.joins
    }
    rows = resolve.build_rows(config, current[config.left], right, run_id=0)
    return rows.filter(F.col(ACTION) == "upsert")


def _current(
    storage: Storage, config: PipelineConfig, source: str, checkpoint: Checkpoint
) -> dict[str, DataFrame]:
    """Every source's current rows as of ``checkpoint`` (the last completed run): bronze read
    at the versions that run processed, or the state tables' rows written by completed runs.
    Events landed since, and rows of a run killed before its commit, are not what silver is for."""
    return {
        name: current_from_bronze(storage, config, name, checkpoint.bronze_versions.get(name))
        if source == "bronze"
        else state.newest(_settled(storage, config, name, checkpoint), config.sources[name].primary_key)
        for name in config.sources
    }


def _settled(storage: Storage, config: PipelineConfig, name: str, checkpoint: Checkpoint) -> DataFrame:
    """A state table's rows written by completed runs (a killed run's rows have a greater run id;
    :func:`unfinished` stops verify before it compares while there are any)."""
    return storage.read(config.state_path(name)).filter(F.col(RUN) <= F.lit(checkpoint.run_id))


def unfinished(storage: Storage, config: PipelineConfig, checkpoint: Checkpoint) -> list[str]:
    """The tables a run wrote after the last completed one: a run stopped before its commit,
    beaten by another, or still going, whose rerun finishes its work. Empty when there is none.

    Read from the tables' commit logs (:mod:`cdc_join.storage.commits`): a commit a run made (its note
    says so) after the version the checkpoint recorded was made by a run that did not commit,
    whatever run id its rows carry (a beaten run's are the winner's); a table the checkpoint
    does not know (none before a first run) counts from its first commit. A commit made by hand
    or by another tool carries no such note: verify compares what it wrote."""
    tables = {
        **{config.state_path(n): f"state of {n}" for n in config.sources},
        **{config.subscription_path(j): f"subscriptions of {j.alias}" for j in config.joins},
        config.silver_path: "silver",
    }
    return [
        label
        for path, label in tables.items()
        if commits.unfinished_since(storage, path, checkpoint.tables.get(path))
    ]


def _right_rows(rows: DataFrame, config: PipelineConfig, join) -> DataFrame:  # type: ignore[no-untyped-def]
    right = config.sources[join.right]
    live = rows.filter(~F.col(DELETED))
    values = state.value_fields(live.schema)
    return live.select(
        *[F.col(f"`{pk}`").alias(fk) for pk, fk in zip(right.primary_key, fk_columns(join), strict=True)],
        F.struct(*[F.col(f"`{f.name}`") for f in values]).alias(lookup.RIGHT),
        F.col(SEQ).alias(lookup.RIGHT_SEQ),
    )


def verify(
    storage: Storage, config: PipelineConfig, *, samples: int = 5, source: str = "bronze"
) -> VerifyReport:
    """Compare silver with :func:`expected_silver` row for row (and the internal tables).

    Every count comes from one Spark job (:func:`_count_all`); rows are sampled only when
    silver differs."""
    keys = silver_key_columns(config)
    columns = [*keys, *output_columns(config)]
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, not {source!r}")
    checkpoint = last_checkpoint(storage, config)
    stopped = unfinished(storage, config, checkpoint)
    if stopped:
        return VerifyReport(0, 0, 0, 0, 0, source=source, unfinished=tuple(stopped))
    # Built and cached once: the silver and the internal checks read it three times.
    current = {name: rows.cache() for name, rows in _current(storage, config, source, checkpoint).items()}
    computed = expected_silver(storage, config, source, current).select(*quoted(columns))
    types = {f.name: f.dataType for f in computed.schema.fields}
    expected = _comparable(computed).cache()
    cached = [*current.values(), expected]
    try:
        landing = list_folders(storage.spark, config)
        notes = landing_warnings(config, landing) + legacy_warnings(storage, config)
        actual = (
            _silver_as_defined(storage, config, columns, types, notes)
            if storage.exists(config.silver_path)
            else expected.limit(0)
        )
        joined = _compared(expected, actual, keys).cache()
        cached.append(joined)
        silver = _silver_differences(expected, actual, joined, keys)
        internal = _internal_differences(storage, config, current, checkpoint) if source == "bronze" else {}
        counts = _count_all({**silver, **internal})
        shown = [
            f"{kind} {r.asDict()}"
            for kind in ("missing", "extra", "different", "duplicated")
            if counts[kind]
            for r in silver[kind].limit(samples).collect()
        ]
    finally:
        for frame in cached:
            frame.unpersist()
    return VerifyReport(
        *(counts["expected"], counts["silver"], counts["missing"], counts["extra"], counts["different"]),
        samples=tuple(shown),
        duplicated=counts["duplicated"],
        notes=tuple(notes),
        state_differences=_summed(counts, "state:", list(config.sources)) if internal else {},
        subscription_differences=(
            _summed(counts, "subscription:", [j.alias for j in config.joins]) if internal else {}
        ),
        source=source,
        unlisted={
            name: tuple(files)
            for name, files in beyond_lookback(storage.spark, storage, config, landing).items()
        },
    )


def _silver_as_defined(
    storage: Storage,
    config: PipelineConfig,
    columns: list[str],
    types: Mapping[str, DataType],
    notes: list[str],
) -> DataFrame:
    """Silver's key and select columns, comparable with the expected rows. A column silver
    lacks or holds in a type the definition no longer gives compares as NULL (every row with a
    value differs; ``notes`` says why); a narrower type compares by its values."""
    stored = storage.read(config.silver_path)
    have = {f.name: f.dataType for f in stored.schema.fields}
    absent = [c for c in columns if c not in have]
    retyped = [c for c in columns if c in have and not _compares_as(have[c], types[c])]
    if absent:
        notes.append(
            f"silver has no column {', '.join(absent)}: its definition changed since the last "
            "run; the next run recomputes it"
        )
    if retyped:
        held = ", ".join(f"{have[c].simpleString()}, not {types[c].simpleString()}" for c in retyped)
        notes.append(
            f"silver's column {', '.join(retyped)} has another type than its definition gives "
            f"({held}): the next run recomputes it"
        )
    return _comparable(
        stored.select(
            *[
                F.lit(None).cast(types[c]).alias(c)
                if c in absent or c in retyped
                else F.col(f"`{c}`").alias(c)
                if same_type(have[c], types[c])
                else F.col(f"`{c}`").cast(types[c]).alias(c)
                for c in columns
            ]
        )
    )


def _silver_differences(
    expected: DataFrame, actual: DataFrame, joined: DataFrame, keys: list[str]
) -> dict[str, DataFrame]:
    """The frames whose counts a verify reports: both sides, and each kind of difference."""
    return {
        "expected": expected,
        "silver": actual,
        "missing": joined.filter("__n IS NULL").select(*quoted(keys), "__e"),
        "extra": joined.filter("__e IS NULL").select(*quoted(keys), F.col("__a").alias("silver")),
        "different": joined.filter("__e IS NOT NULL AND __n IS NOT NULL AND NOT (__e <=> __a)").select(
            *quoted(keys), F.col("__e").alias("expected"), F.col("__a").alias("silver")
        ),
        "duplicated": joined.filter("__n > 1").select(*quoted(keys), F.col("__n").alias("copies")),
    }


def _compares_as(held: DataType, wanted: DataType) -> bool:
    """Whether silver's values of type ``held`` compare with the definition's of type ``wanted``:
    the same type, or a flat type that widens to it (cast; a struct cast goes by position)."""
    if same_type(held, wanted):  # nullability flags aside: arrays of structs carry many
        return True
    flat = not isinstance(held, (ArrayType, MapType, StructType))
    return flat and widens_to(held, wanted)


def _compared(expected: DataFrame, actual: DataFrame, keys: list[str]) -> DataFrame:
    """Per key of either side: the expected values (``__e``, null when expected has no such
    key), one of silver's (``__a``) and how many rows silver holds for it (``__n``).

    One join on the key instead of set differences both ways: a recompute holds each key once,
    and a silver row whose key is null (or whose key the recompute lacks) is an extra one."""
    values = [F.col(f"`{c}`") for c in expected.columns if c not in keys]
    wanted = expected.select(*quoted(keys), F.struct(*values).alias("__e"))
    held = actual.groupBy(*quoted(keys)).agg(
        F.count(F.lit(1)).alias("__n"), F.first(F.struct(*values)).alias("__a")
    )
    return wanted.join(held, keys, "full_outer")


def _comparable(rows: DataFrame) -> DataFrame:
    """Rows that set operations can compare: a map column (which Spark cannot compare) as the
    JSON of its entries sorted by key."""
    return rows.select(
        *[
            exact_json(F.array_sort(F.map_entries(F.col(f"`{f.name}`")))).alias(f.name)
            if isinstance(f.dataType, MapType)
            else F.col(f"`{f.name}`")
            for f in rows.schema.fields
        ]
    )


def _count_all(parts: Mapping[str, DataFrame]) -> dict[str, int]:
    """The row count of every frame, in one Spark job (a union of labels, grouped)."""
    labelled = [frame.select(F.lit(label).alias("part")) for label, frame in parts.items()]
    union = reduce(DataFrame.unionAll, labelled)
    found = {r["part"]: r["n"] for r in union.groupBy("part").agg(F.count(F.lit(1)).alias("n")).collect()}
    return {label: found.get(label, 0) for label in parts}


def _summed(counts: Mapping[str, int], prefix: str, names: list[str]) -> dict[str, int]:
    """Per name, the sum of the counts labelled ``prefix + name`` (``…:a``/``…:b`` parts too);
    names without any part (no state table to compare, e.g.) are left out."""
    out: dict[str, int] = {}
    for label, count in counts.items():
        if label.startswith(prefix):
            name = label[len(prefix) :].rsplit("\x00", 1)[0]
            out[name] = out.get(name, 0) + count
    return {n: out[n] for n in names if n in out}


def _internal_differences(
    storage: Storage, config: PipelineConfig, from_bronze: Mapping[str, DataFrame], checkpoint: Checkpoint
) -> dict[str, DataFrame]:
    """Frames whose rows are the differences of the internal tables, labelled for
    :func:`_count_all`. Per source (``state:<name>``), keys whose live state row is not bronze's
    newest event of the key, both ways; per join (``subscription:<alias>``), live left rows
    whose subscription is missing or holds another hash than the state row (the rows of the
    join's hop's left side: in a chain, a joined source's). ``from_bronze``:
    :func:`current_from_bronze` of every source."""
    parts: dict[str, DataFrame] = {}
    stored: dict[str, DataFrame] = {}
    for name, source in config.sources.items():
        bronze = from_bronze[name].filter(~F.col(DELETED))
        path = config.state_path(name)
        if not storage.exists(path):
            parts[f"state:{name}"] = bronze
            continue
        settled = _settled(storage, config, name, checkpoint)
        stored[name] = state.current_rows(settled, list(source.primary_key))
        identity = [*quoted(source.primary_key), SEQ, FILE, LINE]
        ours = stored[name].select(*identity, F.lit(True).alias("__ours"))
        theirs = bronze.select(*identity, F.lit(True).alias("__theirs"))
        # Each side holds one row per key: a key whose row is on one side only differs.
        pairs = ours.join(theirs, [*source.primary_key, SEQ, FILE, LINE], "full_outer")
        parts[f"state:{name}"] = pairs.filter("__ours IS NULL OR __theirs IS NULL")
    for join in config.joins:
        left = config.hop_left(join)
        if left.name not in stored:
            continue
        rows = stored[left.name].select(F.struct(*quoted(stored[left.name].columns)).alias("row"))
        fk = subscription.normalized_fk("row", join)
        wanted = rows.filter(fk.isNotNull()).select(
            *[F.col(f"row.`{c}`").alias(f) for c, f in zip(join.foreign_key, fk_columns(join), strict=True)],
            *[F.col(f"row.`{c}`").alias(p) for c, p in zip(left.primary_key, pk_columns(left), strict=True)],
            F.col(f"row.{HASH}").alias(LHS_HASH),
        )
        path = config.subscription_path(join)
        if not storage.exists(path):
            parts[f"subscription:{join.alias}"] = wanted
            continue
        have, _ = subscription.current(storage, path, join, left)
        parts[f"subscription:{join.alias}"] = wanted.join(have, wanted.columns, "left_anti")
    return parts
