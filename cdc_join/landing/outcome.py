"""What a parsed batch of landing lines comes to: the events and quarantined lines ingest
writes, and their counts per file.

One aggregation counts the batch's classified lines (:func:`cdc_join.landing.debezium.parse_events`)
per file and outcome, with the placeholders of values Debezium could not read per column, and
finds the files holding one JSON array instead of JSON lines (their lines are no events, whatever
some of them parse to: such a file becomes one quarantined line saying so).

A small batch (a few MB of text) is counted and brought to the driver as Arrow in the same
Spark job, its events and quarantined lines beside the counts: a scheduled run's batch so costs
one job here, not one for the counts and one per write, and its lines are parsed once. A larger
batch's lines stay in Spark, cached: only the counts reach the driver, and the events and
quarantined lines stay lazy frames, which bronze's and quarantine's writes read. On the
delta-spark backend driver memory therefore does not grow with the batch (an initial snapshot
can be millions of events): bronze is written by Spark, without a round trip through Python. The
delta-rs backend merges on the driver, so it takes the events there as Arrow, as it does every
write's rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import StructField, StructType, TimestampType

from cdc_join.changeset import ChangeSet, Rows, arrow_schema, frame_of, rows_of_struct, spark_frame, to_arrow
from cdc_join.landing.debezium import QUARANTINE_SCHEMA, ParsedBatch
from cdc_join.landing.debezium.envelope import EVENT_SQL, quarantine_columns
from cdc_join.landing.debezium.sql import lit
from cdc_join.landing.debezium.unavailable import unavailable_checks

_INGESTED_AT = StructField("_ingested_at", TimestampType())
QUARANTINE_TABLE_SCHEMA = StructType([*QUARANTINE_SCHEMA.fields, _INGESTED_AT])

UNREADABLE_REASON = "the file cannot be read, nothing in it was ingested; land a good copy under a new name"

JSON_ARRAY_REASON = (
    "the file holds a JSON array, not JSON lines: nothing in it was ingested. Land its events "
    "one JSON object per line, in a new file"
)

#: Characters a line may start with before the ``[`` that opens a JSON array.
_LEADING_SPACE = " \t\x0b\f\r"


@dataclass(frozen=True)
class FileCounts:
    lines: int = 0
    events: int = 0
    quarantined: int = 0
    tombstones: int = 0


@dataclass(frozen=True)
class Outcome:
    """A parsed batch, ready to write: its events and quarantined lines (lazy frames over the
    cached lines until :meth:`release`, or a small batch's rows on the driver), and per file the
    count of each outcome."""

    events: Rows
    quarantine: Rows
    counts: Mapping[str, FileCounts]
    row_schema: StructType
    event_schema: StructType
    """The events' columns as bronze holds them (``_ingested_at`` nullable, as the events'
    stamp is not)."""
    ingested_at: datetime
    unavailable: Mapping[str, int] = field(default_factory=dict)
    sequence_rule: str = ""
    cached: tuple[DataFrame, ...] = ()

    @property
    def event_count(self) -> int:
        return sum(c.events for c in self.counts.values())

    @property
    def quarantined(self) -> int:
        return sum(c.quarantined for c in self.counts.values())

    @classmethod
    def of(cls, parsed: ParsedBatch, source_name: str, ingested_at: datetime, *, on_driver: bool) -> Outcome:
        """Count the classified lines (one Spark job). With ``on_driver`` (a small batch) the same
        job brings the events and quarantined lines to the driver; otherwise they stay in Spark,
        cached until :meth:`release`."""
        cache = not on_driver
        classified = parsed.classified.persist() if cache else parsed.classified
        stamp = f"timestamp_micros({_epoch_us(ingested_at)}) AS _ingested_at"
        events: Rows = parsed.events.selectExpr("*", stamp)
        quarantine: Rows = parsed.quarantine.selectExpr("*", stamp)
        try:
            if on_driver:
                grouped, event_rows, quarantine_rows = _on_driver(
                    classified, parsed.row_schema, source_name, ingested_at
                )
                tally = _tally(grouped, parsed.row_schema)
                spark = classified.sparkSession
                events = ChangeSet(spark, events.schema, event_rows)
                quarantine = ChangeSet(spark, quarantine.schema, quarantine_rows)
            else:
                tally = _tally(_tally_frame(classified, parsed.row_schema).collect(), parsed.row_schema)
        except BaseException:
            classified.unpersist()
            raise
        if parsed.parsed is not None:
            parsed.parsed.unpersist()  # what the classified lines were computed from
        arrays = sorted(tally.arrays)
        if arrays:
            events = _without_files(events, arrays)
            quarantine = _without_files(quarantine, arrays)
            first = " OR ".join(f"(_file = {lit(a)} AND _line = {int(tally.arrays[a])})" for a in arrays)
            opening = classified.filter(first).selectExpr(
                f"{lit(source_name)} AS source",
                "CAST(_file AS STRING) AS _file",
                "CAST(_line AS BIGINT) AS _line",
                f"{lit(JSON_ARRAY_REASON)} AS reason",
                "value AS raw",
                stamp,
            )
            quarantine = frame_of(quarantine).unionByName(opening)
        return cls(
            events=events,
            quarantine=quarantine,
            counts={**tally.counts, **{a: FileCounts(lines=1, quarantined=1) for a in arrays}},
            row_schema=parsed.row_schema,
            event_schema=StructType([*parsed.events.schema.fields, _INGESTED_AT]),
            ingested_at=ingested_at,
            unavailable=tally.unavailable,
            sequence_rule=parsed.sequence.name,
            cached=(classified,) if cache else (),
        )

    @classmethod
    def nothing(cls, spark: SparkSession, ingested_at: datetime) -> Outcome:
        """The outcome of a batch without a readable file."""
        return cls(
            events=spark.createDataFrame([], StructType([])),
            quarantine=spark.createDataFrame([], QUARANTINE_TABLE_SCHEMA),
            counts={},
            row_schema=StructType([]),
            event_schema=StructType([]),
            ingested_at=ingested_at,
        )

    def with_unreadable(
        self, spark: SparkSession, source_name: str, unreadable: Mapping[str, str]
    ) -> Outcome:
        """This outcome plus one quarantined line (line 0, no text) per file that could not be read."""
        n = len(unreadable)
        rows = pa.table(
            {
                "source": pa.array([source_name] * n, pa.string()),
                "_file": pa.array(list(unreadable), pa.string()),
                "_line": pa.array([0] * n, pa.int64()),
                "reason": pa.array([f"{UNREADABLE_REASON}: {why}" for why in unreadable.values()]),
                "raw": pa.nulls(n, pa.string()),
                "_ingested_at": pa.array([self.ingested_at] * n, pa.timestamp("us", tz="UTC")),
            },
            schema=arrow_schema(QUARANTINE_TABLE_SCHEMA),
        )
        lines = spark_frame(spark, rows, QUARANTINE_TABLE_SCHEMA)
        counts = {**self.counts, **{name: FileCounts(lines=1, quarantined=1) for name in unreadable}}
        return replace(self, quarantine=frame_of(self.quarantine).unionByName(lines), counts=counts)

    def reasons(self) -> dict[str, int]:
        """Quarantined lines per reason (a Spark job, when any line was quarantined and the
        lines are not on the driver)."""
        if not self.quarantined:
            return {}
        if isinstance(self.quarantine, ChangeSet):
            counted = self.quarantine.table.group_by("reason").aggregate([("reason", "count")])
            return dict(zip(counted["reason"].to_pylist(), counted["reason_count"].to_pylist(), strict=True))
        rows = self.quarantine.groupBy("reason").count().collect()
        return {str(r["reason"]): int(r["count"]) for r in rows}

    def release(self) -> None:
        """Drop the cached lines (once the outcome is written)."""
        for frame in self.cached:
            frame.unpersist()


@dataclass(frozen=True)
class _Tally:
    counts: dict[str, FileCounts]
    unavailable: dict[str, int]
    arrays: Mapping[str, int]
    """The files holding a JSON array, with the number of the line that opens it."""


def _without_files(rows: Rows, names: list[str]) -> Rows:
    """``rows`` without those of the files ``names``."""
    if isinstance(rows, ChangeSet):
        kept = pc.invert(pc.is_in(rows.table.column("_file"), value_set=pa.array(names, pa.string())))
        return ChangeSet(rows.spark, rows.schema, rows.table.filter(kept))
    return rows.filter(f"_file NOT IN ({', '.join(lit(a) for a in names)})")


def _on_driver(
    classified: DataFrame, row: StructType, source_name: str, ingested_at: datetime
) -> tuple[list[dict[str, Any]], pa.Table, pa.Table]:
    """A small batch in one Spark job: every classified line once, as Arrow (its event's or
    quarantined line's columns, and what the counts need), then counted on the driver. Returns
    :func:`_tally_frame`'s rows, and the events and quarantined lines, stamped."""
    checks = list(unavailable_checks(row, "__after").values())
    table = to_arrow(
        classified.selectExpr(
            "CAST(_file AS STRING) AS _file",
            "CAST(_line AS BIGINT) AS _line",
            "__kind",
            f"{_opens_array()} AS opens_array",
            *(f"__kind = 'event' AND coalesce({check}, false) AS u{i}" for i, check in enumerate(checks)),
            f"{_fields_of('event', EVENT_SQL)} AS __e",
            f"{_fields_of('quarantine', quarantine_columns(source_name))} AS __q",
        )
    ).sort_by([("_file", "ascending"), ("_line", "ascending")])
    flags = [f"u{i}" for i in range(len(checks))]
    aggregated = table.group_by(["_file", "__kind"], use_threads=False).aggregate(
        [("_line", "count"), ("_line", "min"), ("opens_array", "first"), *((u, "sum") for u in flags)]
    )
    names = {"_line_count": "n", "_line_min": "first_line", "opens_array_first": "opens_array"}
    grouped = aggregated.rename_columns(
        [names.get(c, c.removesuffix("_sum")) for c in aggregated.column_names]
    )
    kinds = table.column("__kind")
    events, quarantine = (
        _stamped(rows_of_struct(table.filter(pc.equal(kinds, kind)), column), ingested_at)
        for kind, column in (("event", "__e"), ("quarantine", "__q"))
    )
    return grouped.to_pylist(), events, quarantine


def _fields_of(kind: str, columns: Sequence[tuple[str, str]]) -> str:
    """SQL: a struct of ``columns`` (name, SQL), each null unless the line is of ``kind`` (every
    field nullable: Spark's Arrow writer refuses nulls under a field that may not hold any)."""
    return "struct({})".format(
        ", ".join(f"CASE WHEN __kind = {lit(kind)} THEN {sql} END AS {name}" for name, sql in columns)
    )


def _stamped(rows: pa.Table, ingested_at: datetime) -> pa.Table:
    """``rows`` and the ingest's stamp, ``_ingested_at``."""
    stamp = pa.array([ingested_at] * rows.num_rows, pa.timestamp("us", tz="UTC"))
    return rows.append_column("_ingested_at", stamp)


def _opens_array() -> str:
    """SQL: the line, leading white space aside, starts with ``[``."""
    trimmed = f"TRIM(LEADING {lit(_LEADING_SPACE)} FROM coalesce(value, ''))"
    return f"startswith({trimmed}, '[')"


def _tally_frame(classified: DataFrame, row: StructType) -> DataFrame:
    """Per file and outcome: its lines, the first one's number, whether that line opens a
    JSON array (blank lines are not classified), and its events' placeholders per column."""
    checks = list(unavailable_checks(row, "__after").values())
    aggregates = [
        "count(*) AS n",
        "min(_line) AS first_line",
        f"min_by({_opens_array()}, _line) AS opens_array",
        *(
            f"sum(CASE WHEN __kind = 'event' AND {check} THEN 1 ELSE 0 END) AS u{i}"
            for i, check in enumerate(checks)
        ),
    ]
    return classified.groupBy("_file", "__kind").agg(*(F.expr(a) for a in aggregates))


def _tally(grouped: list[Any], row: StructType) -> _Tally:
    """The counts per file, from :func:`_tally_frame`'s rows (a row per file and outcome)."""
    checks = list(unavailable_checks(row, "__after").items())
    first: dict[str, Any] = {}  # per file, the group holding its first classified line
    for r in grouped:
        known = first.get(str(r["_file"]))
        if known is None or r["first_line"] < known["first_line"]:
            first[str(r["_file"])] = r
    arrays = {name: int(r["first_line"]) for name, r in first.items() if r["opens_array"]}
    by_file: dict[str, dict[str, int]] = {}
    unavailable: dict[str, int] = {}
    for r in grouped:
        if r["_file"] in arrays:
            continue
        by_file.setdefault(str(r["_file"]), {})[str(r["__kind"])] = int(r["n"])
        for i, (column, _) in enumerate(checks):
            if r[f"u{i}"]:
                unavailable[column] = unavailable.get(column, 0) + int(r[f"u{i}"])
    counts = {
        name: FileCounts(sum(k.values()), k.get("event", 0), k.get("quarantine", 0), k.get("tombstone", 0))
        for name, k in by_file.items()
    }
    return _Tally(counts, unavailable, arrays)


def _epoch_us(moment: datetime) -> int:
    return (moment - datetime(1970, 1, 1, tzinfo=timezone.utc)) // timedelta(microseconds=1)
