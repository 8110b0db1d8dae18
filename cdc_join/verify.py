"""Is silver right? A recompute of the join from bronze, compared with silver row for row.

The expected silver comes from bronze alone (DESIGN.md §2): per source, the newest event of
each key by the sequence rule, deletes and truncates applied (:func:`cdc_join.state.from_events`),
then the join (:func:`cdc_join.resolve.build_rows`). The pipeline's state and subscription
tables are not read for it, so a damaged internal table cannot hide a wrong silver: it shows
up as a difference. The internal tables are checked against the same recompute as well, since
a damaged one makes the *next* runs wrong:

- state: every live row of a state table must be the newest event of its key in bronze;
- subscriptions: every live left row with a foreign key must have its subscription, with its
  current hash (leftover subscriptions are allowed: they only cost work, see DESIGN.md §3).

``source="state"`` recomputes from the state tables instead: faster, but blind to a damaged
state table.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import reduce

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from cdc_join import lookup, resolve, state, subscription
from cdc_join.config import PipelineConfig
from cdc_join.schemas import quoted
from cdc_join.storage import Storage
from cdc_join.tables import (
    ACTION,
    DELETED,
    FILE,
    HASH,
    LHS_HASH,
    LINE,
    SEQ,
    fk_columns,
    output_columns,
    pk_columns,
    silver_key_columns,
)

SOURCES = ("bronze", "state")


@dataclass(frozen=True)
class VerifyReport:
    """How silver (and the internal tables) differ from a recompute of the join."""

    expected_rows: int
    silver_rows: int
    missing: int
    extra: int
    different: int
    samples: tuple[str, ...] = ()
    state_differences: Mapping[str, int] = field(default_factory=dict)
    subscription_differences: Mapping[str, int] = field(default_factory=dict)
    source: str = "bronze"
    repaired: bool = False

    @property
    def silver_ok(self) -> bool:
        return self.missing == self.extra == self.different == 0

    @property
    def ok(self) -> bool:
        internal = [*self.state_differences.values(), *self.subscription_differences.values()]
        return self.silver_ok and not any(internal)

    def summary(self) -> str:
        if self.ok:
            head = f"silver matches the join of the current sources (recomputed from {self.source})"
        else:
            head = (
                f"silver DIFFERS from a full recompute (from {self.source})"
                if not self.silver_ok
                else ("silver matches, but internal tables DIFFER from bronze (the next runs would go wrong)")
            )
        lines = [
            f"{head}: expected {self.expected_rows} rows, silver has {self.silver_rows}; "
            f"missing {self.missing}, extra {self.extra}, different {self.different}"
        ]
        for name, count in self.state_differences.items():
            if count:
                lines.append(f"  state table of {name}: {count} keys differ from bronze")
        for alias, count in self.subscription_differences.items():
            if count:
                lines.append(f"  subscriptions of {alias}: {count} live left rows lack their subscription")
        lines += [f"  e.g. {s}" for s in self.samples]
        if self.repaired:
            lines.append("  repaired: a full refresh rebuilt state, subscriptions and silver")
        return "\n".join(lines)


def current_from_bronze(storage: Storage, config: PipelineConfig, name: str) -> DataFrame:
    """Newest row per key of a source implied by its whole bronze table (tombstones included)."""
    source = config.sources[name]
    events = storage.read(config.bronze_path(name))
    row_type = events.schema["_after"].dataType
    return state.from_events(events, source, state.state_schema(row_type), run_id=0)


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
    current = current or _current(storage, config, source)
    right = {join.alias: _right_rows(current[join.right], config, join) for join in config.joins}
    rows = resolve.build_rows(config, current[config.left], right, run_id=0)
    return rows.filter(F.col(ACTION) == "upsert")


def _current(storage: Storage, config: PipelineConfig, source: str) -> dict[str, DataFrame]:
    return {
        name: current_from_bronze(storage, config, name)
        if source == "bronze"
        else state.read_current(storage, config.state_path(name), config.sources[name].primary_key)
        for name in config.sources
    }


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
    # Built and cached once: the silver and the internal checks read it three times.
    current = {name: rows.cache() for name, rows in _current(storage, config, source).items()}
    expected = expected_silver(storage, config, source, current).select(*quoted(columns)).cache()
    cached = [*current.values(), expected]
    try:
        if storage.exists(config.silver_path):
            actual = storage.read(config.silver_path).select(*quoted(columns))
        else:
            actual = expected.limit(0)
        only_expected, only_actual = expected.exceptAll(actual).cache(), actual.exceptAll(expected).cache()
        cached += [only_expected, only_actual]
        silver = {
            "expected": expected,
            "silver": actual,
            "missing": only_expected.join(actual, keys, "left_anti"),
            "extra": only_actual.join(expected, keys, "left_anti"),
            "different": only_expected.join(actual, keys, "left_semi"),
        }
        internal = _internal_differences(storage, config, current) if source == "bronze" else {}
        counts = _count_all({**silver, **internal})
        shown = [
            f"{kind} {r.asDict()}"
            for kind in ("missing", "extra", "different")
            if counts[kind]
            for r in silver[kind].limit(samples).collect()
        ]
    finally:
        for frame in cached:
            frame.unpersist()
    return VerifyReport(
        expected_rows=counts["expected"],
        silver_rows=counts["silver"],
        missing=counts["missing"],
        extra=counts["extra"],
        different=counts["different"],
        samples=tuple(shown),
        state_differences=_summed(counts, "state:", list(config.sources)) if internal else {},
        subscription_differences=(
            _summed(counts, "subscription:", [j.alias for j in config.joins]) if internal else {}
        ),
        source=source,
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
    storage: Storage, config: PipelineConfig, from_bronze: Mapping[str, DataFrame]
) -> dict[str, DataFrame]:
    """Frames whose rows are the differences of the internal tables, labelled for
    :func:`_count_all`. Per source (``state:<name>``), keys whose live state row is not bronze's
    newest event of the key, both ways; per join (``subscription:<alias>``), live left rows
    whose subscription is missing or holds another hash than the state row. ``from_bronze``:
    :func:`current_from_bronze` of every source."""
    parts: dict[str, DataFrame] = {}
    stored: dict[str, DataFrame] = {}
    for name, source in config.sources.items():
        bronze = from_bronze[name].filter(~F.col(DELETED))
        path = config.state_path(name)
        if not storage.exists(path):
            parts[f"state:{name}"] = bronze
            continue
        stored[name] = state.current_rows(storage.read(path), list(source.primary_key))
        identity = [*quoted(source.primary_key), SEQ, FILE, LINE]
        ours, theirs = stored[name].select(*identity), bronze.select(*identity)
        parts[f"state:{name}"] = ours.exceptAll(theirs)
        parts[f"state:{name}\x00bronze"] = theirs.exceptAll(ours)
    if config.left not in stored:
        return parts
    left = config.left_source
    rows = stored[config.left].select(F.struct(*quoted(stored[config.left].columns)).alias("row"))
    for join in config.joins:
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
        parts[f"subscription:{join.alias}"] = wanted.exceptAll(have.select(*wanted.columns))
    return parts
