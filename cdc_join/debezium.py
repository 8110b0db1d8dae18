"""Debezium change events (JSON lines) → typed change rows (the bronze contract) and quarantine.

A landing line is one Kafka Connect JSON value: ``{"schema": …, "payload": {…}}`` (converter
with ``schemas.enable=true``), the payload alone, or a tombstone (``null`` or
``{"schema":null,"payload":null}``), which is counted and skipped.

Everything is a Spark transformation made of built-in SQL expressions: each line is parsed into
a VARIANT (``try_parse_json``; it keeps the exact digits of JSON numbers, so NUMERIC decimals
never pass through float64; see :func:`_whole_json` for why a line is parsed twice) and fields
are read with ``variant_get``. No Python UDF runs and no Python code loops over lines. The
per-column expressions are generated as SQL text and applied with one ``selectExpr`` per
stage: building them as thousands of ``Column`` objects costs seconds of driver round trips,
and SQL text keeps each stage readable in ``explain()``.

The driver collects one small result per batch: per DISTINCT Kafka Connect schema, its text
and a few counts (bounded by schema versions, not rows); see :func:`_batch_stats`.

Row images (``before``/``after``) decode into Spark types:

- with a Kafka Connect schema, from its types and logical types (:func:`connect_type`);
- without one, from Spark's inference over the batch (``schema_of_variant_agg``) mapped to
  what Spark's JSON reader picks: integers → bigint, other numbers → double, mixed JSON types →
  string (the JSON text); all-null columns wait until a value shows up.

Types are stable across batches: ``known`` (the bronze row type) wins for every column it has;
a value that does not fit is quarantined, never silently re-typed; new columns are appended.

The order of events is one sortable string, ``_seq`` (see :func:`sequence_rule`), so "newest
event per key" is a string ``max``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    ByteType,
    DataType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    MapType,
    ShortType,
    StringType,
    StructField,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from cdc_join.config import SourceConfig
from cdc_join.errors import InputError

OPS = ("c", "u", "d", "r", "t")
UPSERT_OPS = ("c", "u", "r")

# `_seq`: components joined by \u0001, elements of a JSON-array component by \u0002. Both sort
# below every printable character, so a shorter prefix sorts first, as in a tuple comparison.
SEQ_SEPARATOR = "\u0001"
SEQ_ARRAY_SEPARATOR = "\u0002"
SEQ_DIGITS = 20  # 2^64 has 20 digits: every unsigned 64-bit LSN or offset fits

MAX_PRECISION = 38
VARIABLE_SCALE_DECIMAL_TYPE = DecimalType(38, 10)  # io.debezium.data.VariableScaleDecimal

EVENT_COLUMNS = ("_file", "_line", "_op", "_seq", "_seq_values", "_ts_ms", "_before", "_after", "_raw")
QUARANTINE_SCHEMA = StructType(
    [
        StructField("source", StringType()),
        StructField("_file", StringType()),
        StructField("_line", LongType()),
        StructField("reason", StringType()),
        StructField("raw", StringType()),
    ]
)
_MESSAGE_JSON_CHARS = 200


@dataclass(frozen=True)
class SequenceRule:
    """Which payload fields order the events of a source, compared as a tuple.

    Attributes:
        name: ``configured``, or the connector whose default applies (``timestamp`` if none).
        fields: the dotted payload paths read, in comparison order; also the names "tried".
    """

    name: str
    fields: tuple[str, ...]


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

    def persist(self) -> ParsedBatch:
        """Cache the classified lines, which every output frame reads."""
        self.classified.persist()
        return self

    def unpersist(self) -> None:
        self.classified.unpersist()


def parse_events(lines: DataFrame, source: SourceConfig, known: StructType | None = None) -> ParsedBatch:
    """Parse a batch of landing lines into change events and quarantined lines.

    Runs one small Spark job (per-schema statistics, collected to the driver); the returned
    frames are lazy. Blank lines are ignored, like the empty string after a final newline.

    Args:
        lines: columns ``_file string, _line long (1-based), value string``.
        source: the source the lines belong to (primary key, sequence fields, connector).
        known: the row type already in bronze (the type of its ``_after``, or the whole bronze
            schema); it wins for the columns it has. ``None`` for a new table.

    Returns:
        The events, quarantine and tombstones of the batch, and the row type used.

    Raises:
        InputError: the batch has events but none has any of the sequence fields, or it mixes
            connectors while the source config names none.
    """
    if known is not None and "_after" in known.names and isinstance(known["_after"].dataType, StructType):
        known = known["_after"].dataType  # a whole bronze schema was passed: take its row type
    staged = _stage(lines)
    stats = _batch_stats(staged, source.sequence_by)
    rule = sequence_rule(source, stats.connectors)
    _require_sequence(source, rule, stats)
    row, decoders = _plan_rows(stats.groups, known or StructType([]))
    # An image no event has (no `before` in a snapshot) is not decoded at all.
    images = [(tag, image) for tag, image in _IMAGES if stats.present.get(image)]
    decoded = _decode_images(staged, decoders, row, images)
    classified = _classify(_with_sequence(decoded, rule), source.primary_key, row)
    return ParsedBatch(
        events=_events(classified),
        quarantine=_quarantine(classified, source.name),
        tombstones=classified.filter("__kind = 'tombstone'").select("_file", "_line"),
        row_schema=row,
        sequence=rule,
        classified=classified,
    )


# -- SQL text helpers ------------------------------------------------------------------------


def _lit(text: str) -> str:
    """A SQL string literal."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _ident(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def _key(name: str) -> str:
    """One variant path step selecting the object field ``name``."""
    if '"' not in name:
        return f'["{name}"]'
    if "'" not in name:
        return f"['{name}']"
    raise InputError(f"field name {name!r} has both quote characters; it cannot be addressed")


def _get(v: str, steps: str) -> str:
    """The variant at ``$<steps>`` of ``v``; SQL NULL when absent (a JSON null stays a variant null)."""
    return f"variant_get({v}, {_lit('$' + steps)}, 'variant')"


def _absent(v: str) -> str:
    return f"({v} IS NULL OR is_variant_null({v}))"


def _present(v: str) -> str:
    """``v`` with a JSON null turned into SQL NULL."""
    return f"CASE WHEN NOT is_variant_null({v}) THEN {v} END"


def _as(v: str, sql_type: str) -> str:
    return f"try_variant_get({v}, '$', {_lit(sql_type)})"


def _kind(v: str) -> str:
    return f"schema_of_variant({v})"


def _is_object(v: str) -> str:
    return f"({_as(v, 'struct<>')} IS NOT NULL)"


def _json_text(v: str) -> str:
    return f"substr(to_json({v}), 1, {_MESSAGE_JSON_CHARS})"


def _ddl(dtype: DataType) -> str:
    """The SQL type of ``dtype``, field names quoted (``simpleString`` does not quote them)."""
    if isinstance(dtype, StructType):
        return "STRUCT<" + ", ".join(f"{_ident(f.name)}: {_ddl(f.dataType)}" for f in dtype.fields) + ">"
    if isinstance(dtype, ArrayType):
        return f"ARRAY<{_ddl(dtype.elementType)}>"
    if isinstance(dtype, MapType):
        return f"MAP<{_ddl(dtype.keyType)}, {_ddl(dtype.valueType)}>"
    return dtype.simpleString()


class _Names:
    """Fresh lambda variable names, so nested lambdas never shadow each other."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}{self.count}"


# -- envelope --------------------------------------------------------------------------------


def _stage(lines: DataFrame) -> DataFrame:
    """Parse each line; find its payload, schema, op and a first reason to reject it."""
    parsed = lines.filter("trim(value) != ''").selectExpr(
        "_file", "_line", "value", f"{_whole_json()} AS __v"
    )
    # The Connect envelope is an object with `payload` and no `op`; anything else with an `op`
    # is a bare payload. A JSON-null payload (or a bare `null`) is a tombstone.
    envelope = f"({_get('__v', '.op')} IS NULL AND {_get('__v', '.payload')} IS NOT NULL)"
    schema = _present(_get("__v", ".schema"))
    with_payload = parsed.selectExpr(
        "*",
        f"CASE WHEN {envelope} THEN {_get('__v', '.payload')} ELSE __v END AS __p",
        f"CASE WHEN {envelope} THEN to_json({schema}) END AS __schema",
    )
    return with_payload.selectExpr(
        "*",
        "sha2(__schema, 256) AS __sid",
        "try_variant_get(__p, '$.op', 'string') AS __op",
        "coalesce(is_variant_null(__p), false) AS __tombstone",
    ).selectExpr("*", f"{_base_reason()} AS __base_reason", f"{_is_event()} AS __event")


def _whole_json() -> str:
    """The line as a VARIANT; NULL unless the whole line is one JSON value.

    Spark's JSON parsers stop after the first value and ignore what follows, so
    ``{"op":"c",…} {"op":"u",…}`` (a lost newline) would parse as its first event. Inside
    ``{"v": …}`` anything after the value fails unless it starts with ``}``; inside ``[…]``
    unless it starts with ``]``. Passing both means nothing follows.
    """
    wrapped = "try_parse_json(concat('{\"v\":', value, '\\n}'))"
    in_array = "try_parse_json(concat('[', value, '\\n]'))"
    return f"CASE WHEN {in_array} IS NOT NULL THEN variant_get({wrapped}, '$.v', 'variant') END"


def _base_reason() -> str:
    ops = ", ".join(_lit(op) for op in OPS)
    no_op, unknown = _lit("not a Debezium event: no 'op' field"), _lit("not a Debezium event: unknown op '")
    return (
        "CASE WHEN __v IS NULL THEN 'not valid JSON' WHEN __tombstone THEN NULL "
        f"WHEN __op IS NULL THEN {no_op} "
        f"WHEN __op NOT IN ({ops}) THEN concat({unknown}, __op, {_lit(chr(39))}) END"
    )


def _is_event() -> str:
    ops = ", ".join(_lit(op) for op in OPS)
    return f"(__v IS NOT NULL AND NOT __tombstone AND coalesce(__op IN ({ops}), false))"


# -- batch statistics: the one driver round trip ---------------------------------------------


@dataclass(frozen=True)
class _Group:
    """The events of one Kafka Connect schema; ``sid`` None for the events without a schema."""

    sid: str | None
    schema: Mapping[str, Any] | None
    inferred: StructType | None


@dataclass(frozen=True)
class _Stats:
    groups: tuple[_Group, ...]
    connectors: frozenset[str]
    events: int
    present: Mapping[str, int]  # payload path → number of events that have it


_DEFAULT_FIELDS = {
    "postgresql": ("source.sequence", "source.lsn"),
    "mysql": ("source.file", "source.pos", "source.row"),
    "sqlserver": ("source.commit_lsn", "source.change_lsn", "source.event_serial_no"),
    "": ("source.ts_ms", "ts_ms"),
}


def _batch_stats(staged: DataFrame, sequence_by: Iterable[str]) -> _Stats:
    """Collect per-schema facts of the batch's events to the driver in one job.

    What comes back is bounded by the number of DISTINCT Kafka Connect schemas (schema
    versions) in the batch, not by its rows: each schema's text once, plus a few counts.
    """
    fields = sorted(
        {f for fs in _DEFAULT_FIELDS.values() for f in fs} | {"after", "before"} | set(sequence_by)
    )
    schemaless = "__sid IS NULL"
    aggregates = [
        "any_value(__schema) AS schema",
        "min(struct(_file, _line)) AS first",
        f"schema_of_variant_agg(CASE WHEN {schemaless} THEN {_get('__p', '.after')} END) AS after",
        f"schema_of_variant_agg(CASE WHEN {schemaless} THEN {_get('__p', '.before')} END) AS before",
        f"min_by(CASE WHEN {schemaless} THEN value END, struct(_file, _line)) AS first_line",
        "collect_set(try_variant_get(__p, '$.source.connector', 'string')) AS connectors",
        "count(1) AS events",
        *[f"count({_present(_get('__p', _steps(f)))}) AS {_ident('present:' + f)}" for f in fields],
    ]
    rows = staged.filter("__event").groupBy("__sid").agg(*[F.expr(a) for a in aggregates]).collect()
    rows.sort(key=lambda r: tuple(r["first"]))  # schemas in order of first appearance
    groups = tuple(_group(r) for r in rows)
    return _Stats(
        groups=groups,
        connectors=frozenset(c for r in rows for c in r["connectors"]) | _schema_connectors(groups),
        events=sum(r["events"] for r in rows),
        present={f: sum(r[f"present:{f}"] for r in rows) for f in fields},
    )


def _steps(dotted: str) -> str:
    return "".join(_key(name) for name in dotted.split("."))


def _group(row: Any) -> _Group:
    if row["__sid"] is not None:
        return _Group(row["__sid"], json.loads(row["schema"]), None)
    inferred = merge_row_types(_variant_struct(row["after"]), _variant_struct(row["before"]))
    return _Group(None, None, _in_key_order(inferred, row["first_line"]))


_CONNECTOR_SCHEMA = re.compile(r"^io\.debezium\.connector\.(\w+)\.Source$")


def _schema_connectors(groups: Iterable[_Group]) -> frozenset[str]:
    """Connectors named by the ``source`` schema (old events have no ``source.connector``)."""
    found = set()
    for group in groups:
        for field in (group.schema or {}).get("fields", []):
            match = _CONNECTOR_SCHEMA.match(str(field.get("name", "")))
            if field.get("field") == "source" and match:
                found.add(match.group(1))
    return frozenset(found)


# -- sequence --------------------------------------------------------------------------------


def sequence_rule(source: SourceConfig, detected: Iterable[str] = ()) -> SequenceRule:
    """Decide, once per source and batch, which fields order its events.

    ``sequence_by`` from the config wins. Otherwise the connector (``SourceConfig.connector``,
    else the one the events name in ``source.connector`` or in their ``source`` schema) picks:

    - postgresql: ``(source.sequence[0], source.sequence[1] or source.lsn)``, the
      ``[last_commit_lsn, lsn]`` pair element-wise. Events without ``source.sequence`` (older
      connectors) compare as ``('', lsn)``, so one rule holds whatever the batch contains;
    - mysql: ``(source.file, source.pos, source.row)``;
    - sqlserver: ``(source.commit_lsn, source.change_lsn, source.event_serial_no)``;
    - anything else: ``(source.ts_ms, ts_ms)``.

    Args:
        source: the source config.
        detected: connector names seen in the batch.

    Returns:
        The rule.

    Raises:
        InputError: the batch names several connectors and the config names none.
    """
    if source.sequence_by:
        return SequenceRule("configured", tuple(source.sequence_by))
    names = set(detected)
    if source.connector is None and len(names) > 1:
        raise InputError(
            f"source {source.name!r}: events from several connectors {sorted(names)}; "
            "set 'connector' or 'sequence_by' for this source"
        )
    connector = source.connector or next(iter(names), "")
    key = connector if connector in _DEFAULT_FIELDS else ""
    return SequenceRule(key or "timestamp", _DEFAULT_FIELDS[key])


def _require_sequence(source: SourceConfig, rule: SequenceRule, stats: _Stats) -> None:
    if stats.events and not any(stats.present.get(f, 0) for f in rule.fields):
        raise InputError(
            f"source {source.name!r}: none of the {stats.events} events of this batch has a "
            f"sequence field; tried {', '.join(rule.fields)}. Set 'sequence_by' for this source."
        )


def _sequence_components(rule: SequenceRule) -> list[str]:
    """The rule's components as variant expressions over the payload ``__p``, in order."""
    if rule.name != "postgresql":
        return [_present(_get("__p", _steps(f))) for f in rule.fields]
    text = "try_variant_get(__p, '$.source.sequence', 'string')"
    pair = f"try_variant_get(try_parse_json({text}), '$', 'array<variant>')"
    first = _present(f"try_element_at({pair}, 1)")
    second = _present(f"try_element_at({pair}, 2)")
    return [first, f"coalesce({second}, {_present(_get('__p', '.source.lsn'))})"]


def _with_sequence(decoded: DataFrame, rule: SequenceRule) -> DataFrame:
    """Add ``_seq``, ``_seq_values`` and ``__seq_reason`` (NULL when the sequence is usable)."""
    components = _sequence_components(rule)
    with_components = decoded.selectExpr("*", *[f"{c} AS __c{i}" for i, c in enumerate(components)])
    names = [f"__c{i}" for i in range(len(components))]
    # Connector defaults hold scalars (postgres' pair is split above); a configured field may
    # hold a JSON-array string, compared element-wise.
    encode = _encode_component if rule.name == "configured" else _encode_scalar
    encoded = with_components.selectExpr("*", *[f"{encode(n)} AS __e{i}" for i, n in enumerate(names)])
    seq = "concat_ws(chr(1), " + ", ".join(f"coalesce(__e{i}, '')" for i in range(len(names))) + ")"
    values = (
        "to_json(named_struct("
        + ", ".join(f"{_lit(f)}, {_get('__p', _steps(f))}" for f in rule.fields)
        + "))"
    )
    problem = _lit(f" is not a non-negative integer of at most {SEQ_DIGITS} digits, nor a string")
    errors = ", ".join(
        f"CASE WHEN {n} IS NOT NULL AND __e{i} IS NULL "
        f"THEN concat('sequence value ', {_json_text(n)}, {problem}) END"
        for i, n in enumerate(names)
    )
    missing = _lit(f"no sequence field: tried {', '.join(rule.fields)}")
    reason = f"CASE WHEN coalesce({', '.join(names)}) IS NULL THEN {missing} ELSE coalesce({errors}) END"
    return encoded.selectExpr("*", f"{seq} AS _seq", f"{values} AS _seq_values", f"{reason} AS __seq_reason")


def _encode_component(v: str) -> str:
    """A component → sortable text; a string holding a JSON array is encoded element-wise."""
    text = f"try_variant_get({v}, '$', 'string')"
    parsed = _as(f"try_parse_json({text})", "array<variant>")
    array = f"CASE WHEN {_kind(v)} = 'STRING' AND startswith({text}, '[') THEN {parsed} END"
    element = _Names()("s")
    encoded = f"transform({array}, {element} -> {_encode_scalar(_present(element))})"
    joined = f"array_join(transform({encoded}, x -> coalesce(x, '')), chr(2))"
    complete = f"NOT exists(zip_with({array}, {encoded}, (r, x) -> NOT {_absent('r')} AND x IS NULL), b -> b)"
    return f"CASE WHEN {array} IS NULL THEN {_encode_scalar(v)} WHEN {complete} THEN {joined} END"


def _encode_scalar(v: str) -> str:
    """Integers and all-digit strings → 20 zero-padded digits; other strings as they are.

    NULL (the error) for negative or fractional numbers and more than 20 digits.
    """
    text = f"try_variant_get({v}, '$', 'string')"
    kind = _kind(v)
    digits = f"regexp_replace({text}, '^0+(?=.)', '')"
    integral = f"({kind} = 'BIGINT' OR {kind} RLIKE '^DECIMAL\\\\(\\\\d+,0\\\\)$')"
    numeric = f"({integral} OR ({kind} = 'STRING' AND {text} RLIKE '^[0-9]+$'))"
    fits = f"({text} RLIKE '^[0-9]+$' AND length({digits}) <= {SEQ_DIGITS})"
    return (
        f"CASE WHEN {v} IS NULL THEN NULL "
        f"WHEN {numeric} THEN CASE WHEN {fits} THEN lpad({digits}, {SEQ_DIGITS}, '0') END "
        f"WHEN {kind} RLIKE '^(BIGINT|DECIMAL|DOUBLE|FLOAT)' THEN NULL ELSE {text} END"
    )


# -- row types -------------------------------------------------------------------------------


def merge_row_types(known: StructType, new: StructType) -> StructType:
    """``known`` with the columns of ``new`` it lacks appended; ``known``'s types win.

    Struct columns (and arrays of structs) merge field by field the same way, so a new nested
    field is added while an existing one never changes type.
    """
    names = set(known.fieldNames())
    merged = [
        StructField(
            f.name, _merge_type(f.dataType, new[f.name].dataType) if f.name in new.names else f.dataType
        )
        for f in known.fields
    ]
    return StructType(merged + [StructField(f.name, f.dataType) for f in new.fields if f.name not in names])


def _merge_type(known: DataType, new: DataType) -> DataType:
    if isinstance(known, StructType) and isinstance(new, StructType):
        return merge_row_types(known, new)
    if isinstance(known, ArrayType) and isinstance(new, ArrayType):
        return ArrayType(_merge_type(known.elementType, new.elementType))
    return known


_TYPE_TOKEN = re.compile(r"\s*(`(?:[^`]|``)*`|[<>(),:]|[^\s<>(),:]+)")


def _variant_struct(text: str | None) -> StructType:
    """The row type ``schema_of_variant_agg`` inferred (e.g. ``OBJECT<id: BIGINT>``)."""
    if not text:
        return StructType([])
    parsed, _ = _parse_variant_type(_TYPE_TOKEN.findall(text), 0)
    return parsed if isinstance(parsed, StructType) else StructType([])


def _parse_variant_type(tokens: list[str], i: int) -> tuple[DataType | None, int]:
    """Parse the type at ``tokens[i]``; ``None`` for a type no value has shown yet."""
    word = tokens[i].upper()
    if word == "OBJECT":
        fields, i = [], i + 2
        while tokens[i] != ">":
            name = tokens[i][1:-1].replace("``", "`") if tokens[i].startswith("`") else tokens[i]
            dtype, i = _parse_variant_type(tokens, i + 2)
            if dtype is not None:
                fields.append(StructField(name, dtype))
            i += 1 if tokens[i] == "," else 0
        return (StructType(fields) if fields else None), i + 1
    if word == "ARRAY":
        element, i = _parse_variant_type(tokens, i + 2)
        return (ArrayType(element) if element is not None else None), i + 1
    if word == "DECIMAL":
        precision, scale = int(tokens[i + 2]), int(tokens[i + 4])
        # A variant stores 2.0 as DECIMAL(1,0) and widens bigint with it to DECIMAL(20,0), so
        # only an integer too long for bigint stays a decimal; other decimals become doubles,
        # as Spark's JSON reader infers them.
        wide_integer = scale == 0 and precision > 20
        return (DecimalType(MAX_PRECISION, 0) if wide_integer else DoubleType()), i + 6
    return _VARIANT_SCALARS.get(word, StringType()), i + 1


_VARIANT_SCALARS: dict[str, DataType | None] = {
    "BIGINT": LongType(),
    "DOUBLE": DoubleType(),
    "FLOAT": DoubleType(),
    "BOOLEAN": BooleanType(),
    "STRING": StringType(),
    "VARIANT": StringType(),  # values of several JSON types: kept as JSON text
    "VOID": None,
}


def _in_key_order(row: StructType, first_line: str | None) -> StructType:
    """Order inferred columns as the batch's first event lists them (inference sorts by name)."""
    try:
        doc = json.loads(first_line) if first_line else {}
    except ValueError:
        doc = {}
    payload = doc.get("payload", doc) if isinstance(doc, dict) and "op" not in doc else doc
    rank: dict[str, int] = {}
    for image in ("after", "before"):
        value = payload.get(image) if isinstance(payload, dict) else None
        for name in value if isinstance(value, dict) else ():
            rank.setdefault(name, len(rank))
    return StructType(sorted(row.fields, key=lambda f: (rank.get(f.name, len(rank)), f.name)))


# -- Kafka Connect schema → Spark types and decoding SQL ------------------------------------

_CONNECT_PRIMITIVES: dict[str, DataType] = {
    "int8": ByteType(),
    "int16": ShortType(),
    "int32": IntegerType(),
    "int64": LongType(),
    "float": FloatType(),
    "float32": FloatType(),
    "double": DoubleType(),
    "float64": DoubleType(),
    "boolean": BooleanType(),
    "string": StringType(),
    "bytes": BinaryType(),
}
_DECIMAL = "org.apache.kafka.connect.data.Decimal"
_VARIABLE_SCALE_DECIMAL = "io.debezium.data.VariableScaleDecimal"
_DATES = frozenset({"org.apache.kafka.connect.data.Date", "io.debezium.time.Date"})
# Units per second. Timestamps of columns without a zone are wall-clock → timestamp_ntz.
_TIMESTAMPS = {
    "org.apache.kafka.connect.data.Timestamp": 1_000,
    "io.debezium.time.Timestamp": 1_000,
    "io.debezium.time.MicroTimestamp": 1_000_000,
    "io.debezium.time.NanoTimestamp": 1_000_000_000,
}
# Units per second. Delta has no TIME type, so times of day become "HH:MM:SS[.fff]".
_TIMES = {
    "org.apache.kafka.connect.data.Time": 1_000,
    "io.debezium.time.Time": 1_000,
    "io.debezium.time.MicroTime": 1_000_000,
    "io.debezium.time.NanoTime": 1_000_000_000,
}
_ZONED_TIMESTAMP = "io.debezium.time.ZonedTimestamp"
_MIN_MICROS, _MAX_MICROS = -62_135_596_800_000_000, 253_402_300_799_999_999  # years 0001-9999
_MIN_DAY, _MAX_DAY = -719_162, 2_932_896


def connect_type(field: Mapping[str, Any]) -> DataType:
    """The Spark type a Kafka Connect field schema decodes to.

    Decimal → ``decimal(connect.decimal.precision or 38, scale)``, precision capped at 38;
    VariableScaleDecimal → ``decimal(38,10)`` (values rounded half-up to 10 places); Date →
    date; Timestamp, MicroTimestamp, NanoTimestamp → timestamp_ntz (wall clock; nanoseconds
    truncated to microseconds); ZonedTimestamp → timestamp (UTC instant); Time, MicroTime,
    NanoTime → string ``HH:MM:SS[.fff]``; maps with non-string keys → their JSON text; every
    other logical type (ZonedTime, Uuid, Json, Enum, Bits, Year, geometry, …) → its base type.
    """
    kind = field.get("type")
    logical = _logical_type(field)
    if logical is not None:
        return logical
    if kind == "struct":
        return StructType([StructField(f["field"], connect_type(f)) for f in field.get("fields", [])])
    if kind == "array":
        return ArrayType(connect_type(field["items"]))
    if kind == "map" and field.get("keys", {}).get("type") == "string":
        return MapType(StringType(), connect_type(field["values"]))
    return _CONNECT_PRIMITIVES.get(str(kind), StringType())


def _logical_type(field: Mapping[str, Any]) -> DataType | None:
    name = field.get("name")
    if name == _DECIMAL:
        params = field.get("parameters") or {}
        scale = min(int(params.get("scale", 0)), MAX_PRECISION)
        precision = min(int(params.get("connect.decimal.precision", MAX_PRECISION)), MAX_PRECISION)
        return DecimalType(max(precision, scale), scale)
    if name == _VARIABLE_SCALE_DECIMAL:
        return VARIABLE_SCALE_DECIMAL_TYPE
    if name in _DATES:
        return DateType()
    if name in _TIMESTAMPS:
        return TimestampNTZType()
    if name in _TIMES:
        return StringType()
    if name == _ZONED_TIMESTAMP:
        return TimestampType()
    return None


def decode_connect_sql(x: str, field: Mapping[str, Any], target: DataType, names: _Names) -> str:
    """SQL decoding the variant ``x`` of a Connect field into ``target`` (NULL if it cannot)."""
    natural = connect_type(field)
    if isinstance(natural, StructType) and isinstance(target, StructType):
        subfields = {f["field"]: f for f in field.get("fields", [])}
        return _struct_sql(x, target, lambda v, f: _connect_sub(v, subfields.get(f.name), f.dataType, names))
    if isinstance(natural, ArrayType) and isinstance(target, ArrayType):
        e = names("e")
        body = decode_connect_sql(e, field["items"], target.elementType, names)
        return f"transform({_as(x, 'array<variant>')}, {e} -> {body})"
    if isinstance(natural, MapType) and isinstance(target, MapType):
        k, v = names("k"), names("v")
        body = decode_connect_sql(v, field["values"], target.valueType, names)
        return f"transform_values({_as(x, 'map<string,variant>')}, ({k}, {v}) -> {body})"
    if isinstance(natural, (StructType, ArrayType, MapType)):
        return f"try_cast({decode_connect_sql(x, field, natural, names)} AS {_ddl(target)})"
    value = _connect_scalar_sql(x, field, natural)
    return value if natural == target else f"try_cast({value} AS {_ddl(target)})"


def _connect_sub(v: str, field: Mapping[str, Any] | None, target: DataType, names: _Names) -> str:
    return (
        decode_connect_sql(v, field, target, names) if field is not None else f"CAST(NULL AS {_ddl(target)})"
    )


def _connect_scalar_sql(x: str, field: Mapping[str, Any], natural: DataType) -> str:
    name = field.get("name")
    if name == _DECIMAL:
        return _decimal_sql(x, natural)
    if name == _VARIABLE_SCALE_DECIMAL:
        unscaled = _unscaled_sql(f"try_variant_get({x}, '$.value', 'string')")
        return _scaled_sql(unscaled, f"try_variant_get({x}, '$.scale', 'int')", natural)
    if name in _DATES:
        return _epoch_date_sql(_as(x, "int"))
    if name in _TIMESTAMPS:
        return _epoch_timestamp_sql(_as(x, "bigint"), _TIMESTAMPS[name])
    if name in _TIMES:
        return _time_of_day_sql(_as(x, "bigint"), _TIMES[name])
    if name == _ZONED_TIMESTAMP:
        return f"try_cast({_as(x, 'string')} AS TIMESTAMP)"
    if isinstance(natural, BinaryType):
        return f"try_to_binary({_as(x, 'string')}, 'base64')"
    if isinstance(natural, StringType):
        return f"CASE WHEN {_kind(x)} = 'STRING' THEN {_as(x, 'string')} ELSE to_json({x}) END"
    return _as(x, natural.simpleString())


def _struct_sql(x: str, target: StructType, decode: Any) -> str:
    """A struct of ``target``'s fields decoded from the JSON object ``x``; NULL if not an object."""
    if not target.fields:
        return f"CAST(NULL AS {_ddl(target)})"
    args = ", ".join(f"{_lit(f.name)}, {decode(_get(x, _key(f.name)), f)}" for f in target.fields)
    return f"CASE WHEN {_is_object(x)} THEN named_struct({args}) END"


# -- logical types with built-in expressions only --------------------------------------------


def _decimal_sql(x: str, dtype: DataType) -> str:
    """Base64 two's-complement unscaled bytes, or a JSON number (``decimal.format=NUMERIC``).

    The variant holds a JSON number's exact digits, so the number path never touches float64.
    """
    assert isinstance(dtype, DecimalType)
    from_bytes = _scaled_sql(_unscaled_sql(_as(x, "string")), str(dtype.scale), dtype)
    return f"CASE WHEN {_kind(x)} = 'STRING' THEN {from_bytes} ELSE {_as(x, dtype.simpleString())} END"


def _unscaled_sql(base64: str) -> str:
    """The signed big-endian integer in base64 bytes, as decimal(38,0); NULL past 38 digits.

    Bytes (``conv`` of each byte's hex) fold most significant first: acc * 256 + byte. The
    first byte's top bit marks a negative number, whose inverted bytes fold to ~x; then
    x = -1 - ~x, one subtraction (Spark's unary minus rounds 38-digit decimals to 34 digits).
    """
    raw = f"try_to_binary({base64}, 'base64')"
    octet = f"CAST(conv(hex(substr({raw}, i, 1)), 16, 10) AS INT)"
    octets = f"transform(sequence(1, octet_length({raw})), i -> {octet})"
    start = "named_struct('negative', CAST(NULL AS BOOLEAN), 'folded', CAST(0 AS DECIMAL(38,0)))"
    negative = "coalesce(s.negative, o >= 128)"
    folded = f"try_add(try_multiply(s.folded, 256), CASE WHEN {negative} THEN 255 - o ELSE o END)"
    step = f"(s, o) -> named_struct('negative', {negative}, 'folded', CAST({folded} AS DECIMAL(38,0)))"
    finish = (
        "s -> CASE WHEN s.negative THEN try_subtract(CAST(-1 AS DECIMAL(38,0)), s.folded) ELSE s.folded END"
    )
    return f"CASE WHEN octet_length({raw}) > 0 THEN aggregate({octets}, {start}, {step}, {finish}) END"


def _scaled_sql(unscaled: str, scale: str, dtype: DataType) -> str:
    """``unscaled × 10^-scale`` as ``dtype``: the digits with an exponent, cast exactly."""
    return f"try_cast(concat(CAST({unscaled} AS STRING), 'E', CAST(-({scale}) AS STRING)) AS {_ddl(dtype)})"


def _epoch_date_sql(days: str) -> str:
    return f"CASE WHEN {days} BETWEEN {_MIN_DAY} AND {_MAX_DAY} THEN date_add(DATE'1970-01-01', {days}) END"


def _epoch_timestamp_sql(count: str, per_second: int) -> str:
    if per_second <= 1_000_000:
        micros = f"try_multiply({count}, {1_000_000 // per_second})"
    else:  # nanoseconds: Spark keeps microseconds; floor division drops the rest
        unit = per_second // 1_000_000
        # floor division without overflow: truncate, then step down for negative remainders
        micros = (
            f"(({count} div {unit}) - CASE WHEN {count} < 0 AND pmod({count}, {unit}) != 0 THEN 1 ELSE 0 END)"
        )
    timestamp = f"timestampadd(MICROSECOND, {micros}, TIMESTAMP_NTZ'1970-01-01 00:00:00')"
    return f"CASE WHEN {micros} BETWEEN {_MIN_MICROS} AND {_MAX_MICROS} THEN {timestamp} END"


def _time_of_day_sql(count: str, per_second: int) -> str:
    """``[-]HH:MM:SS`` plus ``.f`` (3, 6 or 9 digits by precision) when the fraction is not 0.

    MySQL TIME may be negative or past 24h, so hours are not wrapped.
    """
    digits = len(str(per_second)) - 1
    magnitude = f"abs({count})"
    seconds = f"({magnitude} div {per_second})"
    fraction = f"pmod({magnitude}, {per_second})"
    clock = (
        f"format_string('%s%02d:%02d:%02d', CASE WHEN {count} < 0 THEN '-' ELSE '' END, "
        f"{seconds} div 3600, pmod({seconds} div 60, 60), pmod({seconds}, 60))"
    )
    decimals = f"CASE WHEN {fraction} != 0 THEN format_string('.%0{digits}d', {fraction}) ELSE '' END"
    text = f"concat({clock}, {decimals})"
    return f"CASE WHEN {count} BETWEEN {-(10**18)} AND {10**18} THEN {text} END"


# -- schemaless JSON → the row type ----------------------------------------------------------


def decode_json_sql(x: str, target: DataType, names: _Names) -> str:
    """SQL reading the schemaless JSON value ``x`` as ``target`` (NULL when it does not fit).

    Strict on JSON kinds: a string never becomes a number and a fraction never an integer.
    Any value fits a string column (non-strings as their JSON text).
    """
    if isinstance(target, StructType):
        return _struct_sql(x, target, lambda v, f: decode_json_sql(v, f.dataType, names))
    if isinstance(target, ArrayType):
        e = names("e")
        return (
            f"transform({_as(x, 'array<variant>')}, {e} -> {decode_json_sql(e, target.elementType, names)})"
        )
    if isinstance(target, MapType):
        k, v = names("k"), names("v")
        body = decode_json_sql(v, target.valueType, names)
        return f"transform_values({_as(x, 'map<string,variant>')}, ({k}, {v}) -> {body})"
    kind, read = _kind(x), _as(x, target.simpleString())
    if isinstance(target, StringType):
        return f"CASE WHEN {kind} = 'STRING' THEN {read} ELSE to_json({x}) END"
    if isinstance(target, BinaryType):  # Debezium writes bytes as base64
        return f"CASE WHEN {kind} = 'STRING' THEN try_to_binary({_as(x, 'string')}, 'base64') END"
    if isinstance(target, (ByteType, ShortType, IntegerType, LongType)):
        return f"CASE WHEN {kind} = 'BIGINT' THEN {read} END"
    if isinstance(target, (FloatType, DoubleType, DecimalType)):
        return f"CASE WHEN {kind} RLIKE '^(BIGINT|DECIMAL|DOUBLE|FLOAT)' THEN {read} END"
    if isinstance(target, BooleanType):
        return f"CASE WHEN {kind} = 'BOOLEAN' THEN {read} END"
    return read


def fits_sql(raw: str, decoded: str, target: DataType, names: _Names) -> str:
    """SQL: true when ``decoded`` kept every value of ``raw`` (absent, or decoded all the way)."""
    inner = ""
    if isinstance(target, StructType):
        checks = [
            fits_sql(_get(raw, _key(f.name)), f"{decoded}.{_ident(f.name)}", f.dataType, names)
            for f in target
        ]
        inner = " AND ".join(checks)
    elif isinstance(target, (ArrayType, MapType)):
        r, d = names("r"), names("d")
        element = target.elementType if isinstance(target, ArrayType) else target.valueType
        raws = (
            _as(raw, "array<variant>")
            if isinstance(target, ArrayType)
            else f"map_values({_as(raw, 'map<string,variant>')})"
        )
        values = decoded if isinstance(target, ArrayType) else f"map_values({decoded})"
        pairs = f"zip_with({raws}, {values}, ({r}, {d}) -> {fits_sql(r, d, element, names)})"
        inner = f"coalesce(forall({pairs}, ok -> ok), false)"
    complete = f" AND {inner}" if inner else ""
    return f"({_absent(raw)} OR ({decoded} IS NOT NULL{complete}))"


# -- decoding the images ---------------------------------------------------------------------


@dataclass(frozen=True)
class _Decoder:
    """How one group's images decode, and how a column that failed is reported."""

    connect_fields: Mapping[str, Mapping[str, Any]] | None  # None: schemaless JSON

    def decode(self, raw: str, field: StructField, names: _Names) -> str:
        if self.connect_fields is None:
            return decode_json_sql(raw, field.dataType, names)
        return _connect_sub(raw, self.connect_fields.get(field.name), field.dataType, names)

    def message(self, raw: str, field: StructField) -> str:
        expected = field.dataType.simpleString()
        if self.connect_fields is None:
            return f"concat({_lit(f'column {field.name}: expected {expected}, got ')}, {_json_text(raw)})"
        spec = self.connect_fields.get(field.name) or {}
        kind = spec.get("name") or spec.get("type") or "a column its schema lacks"
        prefix, suffix = f"column {field.name}: cannot decode ", f" ({kind}) as {expected}"
        return f"concat({_lit(prefix)}, {_json_text(raw)}, {_lit(suffix)})"


def _plan_rows(groups: Sequence[_Group], known: StructType) -> tuple[StructType, dict[str | None, _Decoder]]:
    """The batch's row type (``known`` plus new columns in order of appearance) and decoders."""
    row = known
    decoders: dict[str | None, _Decoder] = {}
    for group in groups:
        if group.sid is None:
            row = merge_row_types(row, group.inferred or StructType([]))
            decoders[None] = _Decoder(None)
            continue
        fields = _connect_row_fields(group.schema or {})
        row = merge_row_types(row, StructType([StructField(n, connect_type(f)) for n, f in fields.items()]))
        decoders[group.sid] = _Decoder(fields)
    return row, decoders


def _connect_row_fields(schema: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """The row's Connect field schemas by name, from the envelope's ``after`` then ``before``."""
    images = [f for f in schema.get("fields", []) if f.get("field") in ("after", "before")]
    fields: dict[str, Mapping[str, Any]] = {}
    for image in sorted(images, key=lambda f: f.get("field") != "after"):
        for f in image.get("fields", []) if image.get("type") == "struct" else []:
            fields.setdefault(f["field"], f)
    return fields


_IMAGES = (("a", "after"), ("b", "before"))


def _decode_images(
    staged: DataFrame,
    decoders: Mapping[str | None, _Decoder],
    row: StructType,
    images: Sequence[tuple[str, str]],
) -> DataFrame:
    """Add ``__after``/``__before`` (typed rows) and ``__decode_reason``, in three stages.

    Raw field values, decoded values, then structs and checks are separate projections: each
    decoded value is read twice (struct and check), which keeps Spark from inlining it twice.
    """
    names = _Names()
    raw = [
        f"{_get('__p', '.' + image + _key(f.name))} AS __r{tag}{i}"
        for tag, image in images
        for i, f in enumerate(row)
    ]
    decoded = [_decoded_column(decoders, tag, i, f, names) for tag, _ in images for i, f in enumerate(row)]
    built = {image: _image_sql(tag, image, row) for tag, image in images}
    structs = [f"{built.get(image, f'CAST(NULL AS {_ddl(row)})')} AS __{image}" for _, image in _IMAGES]
    reason = f"{_decode_reason_sql(decoders, row, images, names)} AS __decode_reason"
    return staged.selectExpr("*", *raw).selectExpr("*", *decoded).selectExpr("*", *structs, reason)


def _decoded_column(
    decoders: Mapping[str | None, _Decoder], tag: str, i: int, f: StructField, names: _Names
) -> str:
    by_sid = {sid: d.decode(f"__r{tag}{i}", f, names) for sid, d in decoders.items()}
    return f"{_by_group(by_sid)} AS __d{tag}{i}"


def _image_sql(tag: str, image: str, row: StructType) -> str:
    if not row.fields:
        return f"CAST(NULL AS {_ddl(row)})"
    args = ", ".join(f"{_lit(f.name)}, __d{tag}{i}" for i, f in enumerate(row))
    return f"CASE WHEN __event AND {_is_object(_get('__p', '.' + image))} THEN named_struct({args}) END"


def _decode_reason_sql(
    decoders: Mapping[str | None, _Decoder], row: StructType, images: Sequence[tuple[str, str]], names: _Names
) -> str:
    """The first column, ``after`` then ``before``, whose JSON value did not survive decoding."""
    checks = []
    for tag, _ in images:
        for i, f in enumerate(row):
            raw, decoded = f"__r{tag}{i}", f"__d{tag}{i}"
            message = _by_group({sid: d.message(raw, f) for sid, d in decoders.items()})
            checks.append(f"CASE WHEN NOT {fits_sql(raw, decoded, f.dataType, names)} THEN {message} END")
    if not checks:
        return "CAST(NULL AS STRING)"
    return f"coalesce({', '.join(checks)})" if len(checks) > 1 else checks[0]


def _by_group(by_sid: Mapping[str | None, str]) -> str:
    """Pick the expression of the event's schema group; NULL for lines that are not events."""
    if not by_sid:
        return "NULL"
    branches = " ".join(
        f"WHEN {'__sid IS NULL' if sid is None else '__sid = ' + _lit(sid)} THEN {sql}"
        for sid, sql in by_sid.items()
    )
    return f"CASE WHEN NOT __event THEN NULL {branches} END"


# -- classification and outputs --------------------------------------------------------------


def _classify(sequenced: DataFrame, primary_key: Sequence[str], row: StructType) -> DataFrame:
    """One narrow row per line with its outcome: what the three output frames are cut from."""
    reason = f"coalesce(__base_reason, __decode_reason, {_key_reason(primary_key, row)}, __seq_reason)"
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


def _key_reason(primary_key: Sequence[str], row: StructType) -> str:
    """Upserts need the key in ``after``, deletes in ``before``; truncates need none."""
    upserts = ", ".join(_lit(op) for op in UPSERT_OPS)
    checks = []
    for column in primary_key:
        message = _lit(f"missing primary key column '{column}'")
        if column not in row.names:
            checks.append(f"CASE WHEN __op != 't' THEN {message} END")
            continue
        image = f"CASE WHEN __op IN ({upserts}) THEN __after WHEN __op = 'd' THEN __before END"
        checks.append(f"CASE WHEN __op != 't' AND ({image}).{_ident(column)} IS NULL THEN {message} END")
    return f"coalesce({', '.join(checks)})" if len(checks) > 1 else checks[0]


def _events(classified: DataFrame) -> DataFrame:
    return classified.filter("__kind = 'event'").selectExpr(
        "CAST(_file AS STRING) AS _file",
        "CAST(_line AS BIGINT) AS _line",
        "__op AS _op",
        "_seq",
        "_seq_values",
        "_ts_ms",
        "__before AS _before",
        "__after AS _after",
        "value AS _raw",
    )


def _quarantine(classified: DataFrame, source_name: str) -> DataFrame:
    return classified.filter("__kind = 'quarantine'").selectExpr(
        f"{_lit(source_name)} AS source",
        "CAST(_file AS STRING) AS _file",
        "CAST(_line AS BIGINT) AS _line",
        "__reason AS reason",
        "value AS raw",
    )
