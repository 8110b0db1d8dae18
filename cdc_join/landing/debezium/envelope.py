"""Landing lines → classified change events: the envelope, the op, and why a line is unusable.

A landing line is one Kafka Connect JSON value: ``{"schema": …, "payload": {…}}`` (converter
with ``schemas.enable=true``), the payload alone, or a tombstone (``null`` or
``{"schema":null,"payload":null}``), which is counted and skipped.

Each line is parsed once into a VARIANT (``try_parse_json``, which keeps the exact digits of
JSON numbers) and classified as an event, a tombstone or a quarantined line with the first
reason that applies, in this order: not one whole JSON value, not a Debezium event (no or an
unknown ``op``), a value that does not decode (see :mod:`cdc_join.landing.debezium.decode`), a missing
primary key, no usable sequence (see :mod:`cdc_join.landing.debezium.sequence`).

Everything is a Spark transformation of built-in SQL expressions. The driver collects one
small result per batch: per DISTINCT Kafka Connect schema, its text and a few counts (bounded
by schema versions, not rows); see :func:`_batch_stats`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import LongType, StringType, StructField, StructType

import cdc_join.landing.debezium.types as T
from cdc_join.config import SourceConfig
from cdc_join.landing.debezium.decode import IMAGES, SchemaGroup, decode_images, plan_rows
from cdc_join.landing.debezium.sequence import (
    DEFAULT_FIELDS,
    SequenceRule,
    decided_fields,
    require_sequence,
    sequence_rule,
    with_sequence,
)
from cdc_join.landing.debezium.sql import absent, get, ident, is_object, json_text, lit, present, steps

OPS = ("c", "u", "d", "r", "t")
UPSERT_OPS = ("c", "u", "r")
#: An event's columns, each its name and SQL over a classified line (:attr:`ParsedBatch.events`).
EVENT_SQL = (
    ("_file", "CAST(_file AS STRING)"),
    ("_line", "CAST(_line AS BIGINT)"),
    ("_op", "__op"),
    ("_seq", "_seq"),
    ("_seq_values", "_seq_values"),
    ("_ts_ms", "_ts_ms"),
    ("_before", "__before"),
    ("_after", "__after"),
    ("_raw", "value"),
)
EVENT_COLUMNS = tuple(name for name, _ in EVENT_SQL)
QUARANTINE_SCHEMA = StructType(
    [
        StructField("source", StringType()),
        StructField("_file", StringType()),
        StructField("_line", LongType()),
        StructField("reason", StringType()),
        StructField("raw", StringType()),
    ]
)


@dataclass(frozen=True)
class ParsedBatch:
    """The outcome of :func:`parse_events` for one batch of lines.

    ``events``, ``quarantine`` and ``tombstones`` are filters of one classified frame; call
    :meth:`persist` before using more than one of them so the lines are parsed once.

    Attributes:
        events: one row per change event, columns :data:`EVENT_COLUMNS`.
        quarantine: one row per unusable line, columns of :data:`QUARANTINE_SCHEMA`.
        tombstones: ``_file, _line`` of the tombstone lines (skipped, not quarantined).
        row_schema: the struct type of ``_before`` and ``_after``.
        sequence: the rule ``_seq`` was encoded with.
        classified: every non-blank line with its outcome (internal columns start with ``__``).
    """

    events: DataFrame
    quarantine: DataFrame
    tombstones: DataFrame
    row_schema: StructType
    sequence: SequenceRule
    classified: DataFrame
    parsed: DataFrame | None = None
    """The lines parsed as JSON, when :func:`parse_events` was asked to cache them."""

    def persist(self) -> ParsedBatch:
        """Cache the classified lines, which every output frame reads."""
        self.classified.persist()
        return self

    def unpersist(self) -> None:
        self.classified.unpersist()
        if self.parsed is not None:
            self.parsed.unpersist()


def parse_events(
    lines: DataFrame,
    source: SourceConfig,
    known: StructType | None = None,
    *,
    cache: bool = False,
    recorded: tuple[str, ...] | None = None,
) -> ParsedBatch:
    """Parse a batch of landing lines into change events and quarantined lines.

    Runs one small Spark job (per-schema statistics, collected to the driver); the returned
    frames are lazy. Blank lines are ignored, like the empty string after a final newline.

    Args:
        lines: columns ``_file string, _line long (1-based), value string``.
        source: the source the lines belong to (primary key, sequence fields, connector).
        known: the row type already in bronze (the type of its ``_after``, or the whole bronze
            schema); it wins for the columns it has. ``None`` for a new table.
        cache: keep the lines parsed as JSON in Spark's cache, so the statistics job and the
            job that reads the outputs parse each line once; :meth:`ParsedBatch.unpersist`
            releases them.
        recorded: the sequence fields bronze's events were ordered by, if it has any (see
            :func:`~cdc_join.landing.debezium.sequence.sequence_rule`).

    Returns:
        The events, quarantine and tombstones of the batch, and the row type used.

    Raises:
        InputError: the batch has events but none has any of the sequence fields, or it mixes
            connectors while the source config names none.
        ConfigError: the source's configured sequence rule is not ``recorded``.
    """
    if known is not None and "_after" in known.names and isinstance(known["_after"].dataType, StructType):
        known = known["_after"].dataType  # a whole bronze schema was passed: take its row type
    staged = _stage(lines)
    if cache:
        staged = staged.persist()
    try:
        stats = _batch_stats(staged, decided_fields(source, recorded))
        rule = sequence_rule(source, stats.connectors, recorded)
        require_sequence(source, rule, stats.events, stats.present)
    except BaseException:
        if cache:
            staged.unpersist()
        raise
    row, decoders = plan_rows(stats.groups, known or StructType([]))
    # An image no event has (no `before` in a snapshot) is not decoded at all.
    images = [(tag, image) for tag, image in IMAGES if stats.present.get(image)]
    decoded = decode_images(staged, decoders, row, images)
    classified = _classify(with_sequence(decoded, rule), source.primary_key, row)
    return ParsedBatch(
        events=_events(classified),
        quarantine=_quarantine(classified, source.name),
        tombstones=classified.filter("__kind = 'tombstone'").select("_file", "_line"),
        row_schema=row,
        sequence=rule,
        classified=classified,
        parsed=staged if cache else None,
    )


# -- envelope --------------------------------------------------------------------------------


def _stage(lines: DataFrame) -> DataFrame:
    """Parse each line; find its payload, schema, op and a first reason to reject it."""
    # A blank line (spaces, tabs) is no event; trim() alone strips only spaces.
    parsed = (
        lines.filter(f"NOT {_blank('value')}")
        .selectExpr("_file", "_line", "value", f"{_whole_json_array()} AS __arr")
        .selectExpr("_file", "_line", "value", f"{_whole_json()} AS __v")
    )
    # The Connect envelope is an object with `payload` and no `op`; anything else with an `op`
    # is a bare payload. A JSON-null payload (or a bare `null`) is a tombstone.
    envelope = f"({get('__v', '.op')} IS NULL AND {get('__v', '.payload')} IS NOT NULL)"
    schema = present(get("__v", ".schema"))
    with_payload = parsed.selectExpr(
        "*",
        f"CASE WHEN {envelope} THEN {get('__v', '.payload')} ELSE __v END AS __p",
        f"CASE WHEN {envelope} THEN to_json({schema}) END AS __schema",
    )
    return (
        with_payload.selectExpr(
            "*",
            "sha2(__schema, 256) AS __sid",
            "try_variant_get(__p, '$.op', 'string') AS __op",
            "coalesce(is_variant_null(__p), false) AS __tombstone",
        )
        .selectExpr("*", f"{_base_reason()} AS __base_reason", f"{_is_event()} AS __event")
        .drop("__v")
    )


#: Java's ``^\s*$`` written with the characters themselves: a backslash escape in SQL text
#: reads otherwise with ``spark.sql.parser.escapedStringLiterals`` on.
_ONLY_WHITE_SPACE = "^[ \t\n\x0b\f\r]*$"


def _blank(value: str) -> str:
    """SQL: the line holds only white space (Java's ``\\s``, and a final line terminator).

    A line starting with ``{`` (every event) is not blank, which spares almost every line the
    regular expression (1.8 s of a 226 MB batch when run on every line).
    """
    return f"(NOT startswith({value}, '{{') AND {value} RLIKE {lit(_ONLY_WHITE_SPACE)})"


def _whole_json_array() -> str:
    """The line inside ``[`` … ``]``, parsed once (see :func:`_whole_json`)."""
    return f"try_parse_json(concat('[', value, {lit(chr(10) + ']')}))"


def _whole_json() -> str:
    """The line as a VARIANT; NULL unless the whole line is one JSON value.

    Spark's JSON parsers stop after the first value and ignore what follows, so
    ``{"op":"c",…} {"op":"u",…}`` (a lost newline) would parse as its first event. Inside
    ``[…]`` what follows the value must be a comma and more values (so the array has more
    than one element) or a ``]`` that closes the array early. A line without ``]`` is thus
    decided by that one parse, which is most of ingest's CPU; a line with one is parsed again
    inside ``{"v": …}``, where anything after the value fails unless it starts with ``}``.
    Passing both means nothing follows.
    """
    first, second = (f"variant_get(__arr, '$[{i}]', 'variant')" for i in (0, 1))
    wrapped = f"try_parse_json(concat('{{\"v\":', value, {lit(chr(10) + '}')}))"
    return (
        f"CASE WHEN __arr IS NULL OR {second} IS NOT NULL THEN NULL "
        f"WHEN instr(value, ']') = 0 THEN {first} "
        f"ELSE variant_get({wrapped}, '$.v', 'variant') END"
    )


def _base_reason() -> str:
    ops = ", ".join(lit(op) for op in OPS)
    no_op, unknown = lit("not a Debezium event: no 'op' field"), lit("not a Debezium event: unknown op '")
    return (
        "CASE WHEN __v IS NULL THEN 'not valid JSON' WHEN __tombstone THEN NULL "
        f"WHEN __op IS NULL THEN {no_op} "
        f"WHEN __op NOT IN ({ops}) THEN concat({unknown}, __op, {lit(chr(39))}) END"
    )


def _is_event() -> str:
    ops = ", ".join(lit(op) for op in OPS)
    return f"(__v IS NOT NULL AND NOT __tombstone AND coalesce(__op IN ({ops}), false))"


# -- batch statistics: the one driver round trip ---------------------------------------------


@dataclass(frozen=True)
class _Stats:
    groups: tuple[SchemaGroup, ...]
    connectors: frozenset[str]
    events: int
    present: Mapping[str, int]  # payload path → number of events that have it


def _batch_stats(staged: DataFrame, sequence_fields: Iterable[str] | None) -> _Stats:
    """Collect per-schema facts of the batch's events to the driver in one job.

    What comes back is bounded by the number of DISTINCT Kafka Connect schemas (schema
    versions) in the batch, not by its rows: each schema's text once, plus a few counts.
    ``sequence_fields``: the sequence rule's fields when it is already decided, else ``None``:
    then every connector's default fields are counted and the events' connectors collected.
    """
    undecided = sequence_fields is None
    defaults = {f for fs in DEFAULT_FIELDS.values() for f in fs}
    fields = sorted((defaults if undecided else set(sequence_fields or ())) | {"after", "before"})
    schemaless = "__sid IS NULL"
    # Each field is read out of the payload once, in a projection: the aggregates below use
    # it twice (the images) or test it for both SQL NULL and JSON null.
    values = {f: f"__f{i}" for i, f in enumerate(fields)}
    aggregates = [
        "any_value(__schema) AS schema",
        "min(struct(_file, _line)) AS first",
        # Objects only: one image of another JSON type (quarantined, see _image_reason) would
        # merge every column into VARIANT, and the batch's row type would have none.
        *[
            f"schema_of_variant_agg(CASE WHEN {schemaless} AND {is_object(values[image])} "
            f"THEN {values[image]} END) AS {image}"
            for image in ("after", "before")
        ],
        f"min_by(CASE WHEN {schemaless} THEN value END, struct(_file, _line)) AS first_line",
        "count(1) AS events",
        *[f"count_if(NOT {absent(v)}) AS {ident('present:' + f)}" for f, v in values.items()],
    ]
    if undecided:
        aggregates.append("collect_set(try_variant_get(__p, '$.source.connector', 'string')) AS connectors")
    events = staged.filter("__event").selectExpr(
        "__sid",
        "__schema",
        "_file",
        "_line",
        "value",
        "__p",
        *[f"{get('__p', steps(f))} AS {v}" for f, v in values.items()],
    )
    rows = events.groupBy("__sid").agg(*[F.expr(a) for a in aggregates]).collect()
    rows.sort(key=lambda r: tuple(r["first"]))  # schemas in order of first appearance
    groups = tuple(_group(r) for r in rows)
    return _Stats(
        groups=groups,
        connectors=frozenset(c for r in rows for c in (r["connectors"] if undecided else ()))
        | _schema_connectors(groups),
        events=sum(r["events"] for r in rows),
        present={f: sum(r[f"present:{f}"] for r in rows) for f in fields},
    )


def _group(row: Any) -> SchemaGroup:
    if row["__sid"] is not None:
        return SchemaGroup(row["__sid"], json.loads(row["schema"]), None)
    inferred = T.merge_row_types(T.inferred_row_type(row["after"]), T.inferred_row_type(row["before"]))
    return SchemaGroup(None, None, T.in_key_order(inferred, row["first_line"]))


_CONNECTOR_SCHEMA = re.compile(r"^io\.debezium\.connector\.(\w+)\.Source$")


def _schema_connectors(groups: Iterable[SchemaGroup]) -> frozenset[str]:
    """Connectors named by the ``source`` schema (old events have no ``source.connector``)."""
    found = set()
    for group in groups:
        for field in (group.schema or {}).get("fields", []):
            match = _CONNECTOR_SCHEMA.match(str(field.get("name", "")))
            if field.get("field") == "source" and match:
                found.add(match.group(1))
    return frozenset(found)


# -- classification and outputs --------------------------------------------------------------


def _classify(sequenced: DataFrame, primary_key: Sequence[str], row: StructType) -> DataFrame:
    """One narrow row per line with its outcome: what the three output frames are cut from."""
    reason = (
        f"coalesce(__base_reason, {_image_reason()}, __decode_reason, "
        f"{_key_reason(primary_key, row)}, __seq_reason)"
    )
    ts_ms = (
        "coalesce(try_variant_get(__p, '$.ts_ms', 'bigint'), "
        "try_variant_get(__p, '$.source.ts_ms', 'bigint'))"
    )
    outcome = sequenced.selectExpr(
        "_file",
        "_line",
        "value",
        "__op",
        "_seq",
        "_seq_values",
        f"{ts_ms} AS _ts_ms",
        "CASE WHEN __op != 't' THEN __before END AS __before",
        "CASE WHEN __op != 't' THEN __after END AS __after",
        "__tombstone",
        f"CASE WHEN NOT __tombstone THEN {reason} END AS __reason",
    )
    kind = (
        "CASE WHEN __reason IS NOT NULL THEN 'quarantine' WHEN __tombstone THEN 'tombstone' ELSE 'event' END"
    )
    return outcome.selectExpr("*", f"{kind} AS __kind")


def _image_reason() -> str:
    """An image that is there but neither an object nor ``null`` (no row to decode). Tested
    only where the decoded image is NULL: objects decode to a row."""
    checks = []
    for image in ("after", "before"):
        value = get("__p", steps(image))
        message = lit(f"'{image}' is neither an object nor null: ")
        checks.append(
            f"CASE WHEN __{image} IS NULL AND NOT {is_object('__p', steps(image))} AND NOT {absent(value)} "
            f"THEN concat({message}, {json_text(value)}) END"
        )
    return f"coalesce({', '.join(checks)})"


def _key_reason(primary_key: Sequence[str], row: StructType) -> str:
    """Upserts need the key in ``after``, deletes in ``before``; truncates need none."""
    upserts = ", ".join(lit(op) for op in UPSERT_OPS)
    checks = []
    for column in primary_key:
        message = lit(f"missing primary key column '{column}'")
        if column not in row.names:
            checks.append(f"CASE WHEN __op != 't' THEN {message} END")
            continue
        image = f"CASE WHEN __op IN ({upserts}) THEN __after WHEN __op = 'd' THEN __before END"
        checks.append(f"CASE WHEN __op != 't' AND ({image}).{ident(column)} IS NULL THEN {message} END")
    return f"coalesce({', '.join(checks)})" if len(checks) > 1 else checks[0]


def quarantine_columns(source_name: str) -> tuple[tuple[str, str], ...]:
    """A quarantined line's columns (:data:`QUARANTINE_SCHEMA`), each its name and SQL over a
    classified line."""
    return (
        ("source", lit(source_name)),
        ("_file", "CAST(_file AS STRING)"),
        ("_line", "CAST(_line AS BIGINT)"),
        ("reason", "__reason"),
        ("raw", "value"),
    )


def _events(classified: DataFrame) -> DataFrame:
    return classified.filter("__kind = 'event'").selectExpr(*_aliased(EVENT_SQL))


def _quarantine(classified: DataFrame, source_name: str) -> DataFrame:
    return classified.filter("__kind = 'quarantine'").selectExpr(*_aliased(quarantine_columns(source_name)))


def _aliased(columns: Sequence[tuple[str, str]]) -> list[str]:
    return [f"{sql} AS {name}" for name, sql in columns]
