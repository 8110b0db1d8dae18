"""What a parsed batch of landing lines comes to: the events and quarantined lines ingest
writes, and their counts per file, without bringing the lines to the driver.

The batch's classified lines (:func:`cdc_join.landing.debezium.parse_events`) stay in Spark: a large
batch's are cached, a small one's (read by one task) are parsed again by each write, which costs
it less than the cache's Spark job. One aggregation job counts them per file and outcome, with
the placeholders of values Debezium could not read per column, and finds the files holding one
JSON array instead of JSON lines (their lines are no events, whatever some of them parse to:
such a file becomes one quarantined line saying so). Only those counts reach the driver; the
events and quarantined lines stay lazy frames, which bronze's and quarantine's MERGEs read. On
the delta-spark backend driver memory therefore does not grow with the batch (an initial
snapshot can be millions of events): bronze is written by Spark, without a round trip through
Python. The delta-rs backend merges on the driver, so it takes the events there as Arrow, as it
does every write's rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from typing import Any

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import StructField, StructType, TimestampType

from cdc_join.changeset import arrow_schema, spark_frame
from cdc_join.landing.debezium import QUARANTINE_SCHEMA, ParsedBatch
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
    """A parsed batch, ready to write: its events and quarantined lines as lazy frames (over
    the cached lines, until :meth:`release`), and per file the count of each outcome."""

    events: DataFrame
    quarantine: DataFrame
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
    def of(cls, parsed: ParsedBatch, source_name: str, ingested_at: datetime, *, cache: bool) -> Outcome:
        """Count the classified lines (one Spark job); the lines stay in Spark, cached with
        ``cache`` (else each write parses them again: cheaper for a few lines than a cache's job)."""
        classified = parsed.classified.persist() if cache else parsed.classified
        try:
            tally = _tally(classified, parsed.row_schema)
        except BaseException:
            classified.unpersist()
            raise
        if parsed.parsed is not None:
            parsed.parsed.unpersist()  # what the classified lines were computed from
        arrays = sorted(tally.arrays)
        stamp = f"timestamp_micros({_epoch_us(ingested_at)}) AS _ingested_at"
        kept = f"_file NOT IN ({', '.join(lit(a) for a in arrays)})" if arrays else "true"
        quarantine = parsed.quarantine.filter(kept)
        if arrays:
            first = " OR ".join(f"(_file = {lit(a)} AND _line = {int(tally.arrays[a])})" for a in arrays)
            opening = classified.filter(first).selectExpr(
                f"{lit(source_name)} AS source",
                "CAST(_file AS STRING) AS _file",
                "CAST(_line AS BIGINT) AS _line",
                f"{lit(JSON_ARRAY_REASON)} AS reason",
                "value AS raw",
            )
            quarantine = quarantine.unionByName(opening)
        return cls(
            events=parsed.events.filter(kept).selectExpr("*", stamp),
            quarantine=quarantine.selectExpr("*", stamp),
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
        return replace(self, quarantine=self.quarantine.unionByName(lines), counts=counts)

    def reasons(self) -> dict[str, int]:
        """Quarantined lines per reason (a Spark job, when any line was quarantined)."""
        if not self.quarantined:
            return {}
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


def _tally(classified: DataFrame, row: StructType) -> _Tally:
    """Per file: its lines by outcome, its events' placeholders per column, and whether its
    first line that is not blank opens a JSON array (blank lines are not classified). One
    Spark job; a row per file and outcome comes back."""
    checks = list(unavailable_checks(row, "__after").items())
    trimmed = f"TRIM(LEADING {lit(_LEADING_SPACE)} FROM coalesce(value, ''))"
    aggregates = [
        "count(*) AS n",
        "min(_line) AS first_line",
        f"min_by(startswith({trimmed}, '['), _line) AS opens_array",
        *(
            f"sum(CASE WHEN __kind = 'event' AND {check} THEN 1 ELSE 0 END) AS u{i}"
            for i, (_, check) in enumerate(checks)
        ),
    ]
    grouped = classified.groupBy("_file", "__kind").agg(*(F.expr(a) for a in aggregates)).collect()
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
