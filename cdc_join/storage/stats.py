"""Data files' statistics, read from a Delta log into :class:`~cdc_join.storage.base.FileStats`,
and the predicates that let Delta skip files by them. Both backends use it.

- Minimums are lower and maximums upper bounds, never tighter than the data: timestamp maximums
  are logged to the millisecond (:func:`stat_upper_bound`), decimals wider than 15 digits may
  be logged as doubles (:func:`_widen_decimal`), and a statistic that cannot be parsed is none.
- ``num_records`` counts live rows: deletion vectors are subtracted (:func:`deleted_rows`).
- :func:`skipping_ranges` and :func:`ranges_predicate` turn the files a keyed read wants into
  a predicate every row of those files satisfies and Delta's data skipping understands.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal, localcontext
from functools import reduce
from typing import Any
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column
from pyspark.sql import functions as F
from pyspark.sql.types import (
    BooleanType,
    ByteType,
    DataType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from cdc_join.schemas import quote
from cdc_join.storage.base import FileStats

# read(files=...): at most this many columns and ranges per column in the skipping predicate.
_SKIP_COLUMNS = 2


_SKIP_RANGES = 32


_INTEGER_BITS = {ByteType: 8, ShortType: 16, IntegerType: 32, LongType: 64}


def int_or_none(value: Any) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def stat_upper_bound(data_type: DataType, value: Any) -> Any:
    """A column maximum from the Delta log, made a true upper bound.

    Delta writers (delta-spark and delta-rs alike) store timestamp statistics truncated to
    milliseconds, so a file's real maximum can exceed the logged one by up to 999 µs.
    """
    if value is None:
        return None
    if isinstance(data_type, (TimestampType, TimestampNTZType)) and isinstance(value, datetime):
        return value + timedelta(microseconds=999)
    return value


def parse_stat(data_type: DataType, value: Any) -> Any:
    """A value of a Delta ``stats`` JSON (parsed with ``parse_float=Decimal``) as a Python value.

    Types match what delta-rs returns: ``int``, ``float``, ``Decimal``, ``str``, ``bool``,
    ``date``, aware UTC ``datetime`` for timestamps and naive ``datetime`` for timestamp_ntz.
    Unparseable values become ``None`` (no statistic rather than a wrong one).
    """
    if value is None or isinstance(value, (dict, list)):
        return None
    try:
        if isinstance(data_type, (LongType, IntegerType, ShortType, ByteType)):
            return int(value)
        if isinstance(data_type, (DoubleType, FloatType)):
            return float(value)
        if isinstance(data_type, DecimalType):
            return Decimal(str(value))
        if isinstance(data_type, StringType):
            return str(value)
        if isinstance(data_type, BooleanType):
            return bool(value)
        if isinstance(data_type, DateType):
            return date.fromisoformat(str(value))
        if isinstance(data_type, TimestampType):
            parsed = datetime.fromisoformat(str(value))
            if parsed.tzinfo is None:
                parsed = parsed.replace(tzinfo=timezone.utc)
            return parsed.astimezone(timezone.utc)
        if isinstance(data_type, TimestampNTZType):
            return datetime.fromisoformat(str(value)).replace(tzinfo=None)
    except (TypeError, ValueError, ArithmeticError):
        return None
    return None


def _widen_decimal(value: Decimal | None, data_type: DecimalType, *, upper: bool) -> Decimal | None:
    """Widen a decimal statistic that may have been rounded through a double.

    Some writers (delta-rs) log decimal statistics as JSON doubles, which keep about 15-17
    significant digits; a wider column's logged value can then sit on either side of the real
    one. Moving it outwards by the double's relative error (2**-52, with margin) and rounding
    outwards to the column's scale keeps it a bound whichever writer produced it.
    """
    if value is None or data_type.precision <= 15:
        return value
    # The default context keeps 28 digits; decimal(38, s) needs more, exactly.
    with localcontext() as ctx:
        ctx.prec = 100
        step = Decimal(1).scaleb(-data_type.scale)
        slack = abs(value) * Decimal(2) ** -52
        moved = value + slack if upper else value - slack
        return moved.quantize(step, rounding=ROUND_CEILING if upper else ROUND_FLOOR)


def file_stats_from_add(
    path: str, size: int | None, stats_json: str | None, dv_cardinality: int | None, schema: StructType
) -> FileStats:
    """One :class:`FileStats` from an add action's ``stats`` JSON (see :func:`file_stats_from_values`)."""
    parsed: dict[str, Any] = {}
    if stats_json:
        try:
            parsed = json.loads(stats_json, parse_float=Decimal)
        except ValueError:
            parsed = {}
    return file_stats_from_values(
        path,
        size,
        parsed.get("numRecords"),
        dv_cardinality,
        parsed.get("minValues") or {},
        parsed.get("maxValues") or {},
        parsed.get("nullCount") or {},
        schema,
    )


def file_stats_from_values(
    path: str,
    size: int | None,
    num_records: Any,
    dv_cardinality: int | None,
    mins: Mapping[str, Any],
    maxs: Mapping[str, Any],
    nulls: Mapping[str, Any],
    schema: StructType,
) -> FileStats:
    """One :class:`FileStats` from an add action's statistics, as JSON values or typed (delta-rs).

    ``num_records`` counts live rows: the physical ``numRecords`` less the rows a deletion
    vector removes. Minimums are lower and maximums upper bounds: timestamp maximums are
    widened for millisecond truncation (:func:`stat_upper_bound`)
    and decimals wider than 15 digits for double rounding (:func:`_widen_decimal`).
    """
    live = None
    if isinstance(num_records, (int, Decimal)) and not isinstance(num_records, bool):
        live = int(num_records) - int(dv_cardinality or 0)
    null_counts = {}
    for f in schema.fields:
        count = nulls.get(f.name)
        valid = isinstance(count, (int, Decimal)) and not isinstance(count, bool)
        null_counts[f.name] = int(count) if valid else None
    min_values: dict[str, Any] = {}
    max_values: dict[str, Any] = {}
    for f in schema.fields:
        low = parse_stat(f.dataType, mins.get(f.name))
        high = stat_upper_bound(f.dataType, parse_stat(f.dataType, maxs.get(f.name)))
        if isinstance(f.dataType, DecimalType):
            low = _widen_decimal(low, f.dataType, upper=False)
            high = _widen_decimal(high, f.dataType, upper=True)
        min_values[f.name] = low
        max_values[f.name] = high
    return FileStats(
        path=path,
        size_bytes=int(size or 0),
        num_records=live,
        min_values=min_values,
        max_values=max_values,
        null_counts=null_counts,
        deleted_rows=int(dv_cardinality or 0),
    )


def basename(file: str) -> str:
    """A data file's name: the last part of its path or URI."""
    return file.rstrip("/").rsplit("/", 1)[-1]


def deleted_rows(table: Any) -> dict[str, int]:
    """Data file name → rows its deletion vector removes, from a delta-rs table."""
    if "deletionVectors" not in (table.protocol().reader_features or []):
        return {}
    vectors = pa.table(table.deletion_vectors())
    if not vectors.num_rows:
        return {}
    keep = vectors.column("selection_vector").combine_chunks()
    lengths = pc.list_value_length(keep).to_pylist()
    flags = pa.table(
        {"file": pc.list_parent_indices(keep), "kept": pc.cast(pc.list_flatten(keep), pa.int64())}
    )
    kept = flags.group_by("file").aggregate([("kept", "sum")])
    kept_by_file = dict(
        zip(kept.column("file").to_pylist(), kept.column("kept_sum").to_pylist(), strict=True)
    )
    names = vectors.column("filepath").to_pylist()
    return {
        basename(unquote(name)): int(lengths[i] or 0) - int(kept_by_file.get(i) or 0)
        for i, name in enumerate(names)
    }


@dataclass(frozen=True)
class SkipRanges:
    """A predicate every row of some data files satisfies: ``column`` lies in one of
    ``intervals`` (closed, sorted, disjoint), or is null when ``nulls``."""

    column: str
    intervals: tuple[tuple[Any, Any], ...]
    nulls: bool


def _skippable(data_type: DataType) -> bool:
    """Types whose statistics are exact bounds and compare in Spark as in Python.

    Floating point is left out (NaN and -0.0 order differently), so are collated strings.
    """
    if isinstance(data_type, StringType):
        return data_type == StringType()
    return isinstance(
        data_type,
        (ByteType, ShortType, IntegerType, LongType, DecimalType, DateType, TimestampType, TimestampNTZType),
    )


def _merge_intervals(intervals: list[tuple[Any, Any]], limit: int) -> tuple[tuple[Any, Any], ...]:
    """Overlapping intervals joined; beyond ``limit``, neighbours joined into ``limit`` spans."""
    merged: list[tuple[Any, Any]] = []
    for low, high in sorted(intervals, key=lambda i: i[0]):
        if merged and low <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], high))
        else:
            merged.append((low, high))
    if len(merged) <= limit:
        return tuple(merged)
    per_span = -(-len(merged) // limit)
    return tuple(
        (merged[i][0], merged[min(i + per_span, len(merged)) - 1][1]) for i in range(0, len(merged), per_span)
    )


def _outside(file: FileStats, ranges: SkipRanges) -> bool:
    """Whether Delta's data skipping can prove no row of ``file`` satisfies ``ranges``."""
    low, high = file.min_values.get(ranges.column), file.max_values.get(ranges.column)
    if low is None or high is None:
        return False
    if ranges.nulls and file.null_counts.get(ranges.column) != 0:
        return False
    return all(high < a or low > b for a, b in ranges.intervals)


def skipping_ranges(
    schema: StructType,
    chosen: Sequence[FileStats],
    others: Sequence[FileStats],
    *,
    max_columns: int = _SKIP_COLUMNS,
    max_ranges: int = _SKIP_RANGES,
) -> list[SkipRanges]:
    """Column ranges that hold for every row of the ``chosen`` files and let Delta skip as many
    of the ``others`` as possible (columns picked greedily; none if no column skips a file).

    A column qualifies only if every chosen file has both its bounds; nulls are admitted where
    a chosen file has nulls or does not say.
    """
    candidates: list[tuple[SkipRanges, set[str]]] = []
    for field in schema.fields:
        if not _skippable(field.dataType):
            continue
        name = field.name
        bounds = [(f.min_values.get(name), f.max_values.get(name)) for f in chosen]
        if not bounds or any(low is None or high is None for low, high in bounds):
            continue
        nulls = any(f.null_counts.get(name) != 0 for f in chosen)
        try:
            ranges = SkipRanges(name, _merge_intervals(bounds, max_ranges), nulls)
            skipped = {f.path for f in others if _outside(f, ranges)}
        except TypeError:  # statistics of mixed types: not comparable, not usable
            continue
        if skipped:
            candidates.append((ranges, skipped))
    picked: list[SkipRanges] = []
    covered: set[str] = set()
    while candidates and len(picked) < max_columns:
        best = max(candidates, key=lambda c: len(c[1] - covered))
        if not best[1] - covered:
            break
        picked.append(best[0])
        covered |= best[1]
        candidates.remove(best)
    return picked


def _stat_literal(data_type: DataType, value: Any, *, upper: bool) -> Column | None:
    """A statistic as a literal of the column's own type (no coercion), ``None`` if it has none."""
    if isinstance(data_type, DecimalType):
        if not isinstance(value, Decimal) or not value.is_finite():
            return None
        with localcontext() as ctx:
            ctx.prec = 100
            step = Decimal(1).scaleb(-data_type.scale)
            exact = value.quantize(step, rounding=ROUND_CEILING if upper else ROUND_FLOOR)
            if abs(exact) >= Decimal(10) ** (data_type.precision - data_type.scale):
                return None
        return F.lit(format(exact, "f")).cast(data_type)
    if isinstance(data_type, TimestampType) and isinstance(value, datetime):
        moment = value if value.tzinfo else value.replace(tzinfo=timezone.utc)
        return F.lit(moment.astimezone(timezone.utc).isoformat()).cast(data_type)
    if isinstance(data_type, TimestampNTZType) and isinstance(value, datetime):
        return F.lit(value.replace(tzinfo=None).isoformat()).cast(data_type)
    if isinstance(data_type, DateType) and isinstance(value, date) and not isinstance(value, datetime):
        return F.lit(value.isoformat()).cast(data_type)
    if isinstance(data_type, (ByteType, ShortType, IntegerType, LongType)) and isinstance(value, int):
        bits = _INTEGER_BITS[type(data_type)]
        # An out-of-range cast fails the query under ANSI mode (Spark 4's default).
        return F.lit(value).cast(data_type) if -(2 ** (bits - 1)) <= value < 2 ** (bits - 1) else None
    if isinstance(data_type, StringType) and isinstance(value, str):
        try:
            value.encode("utf-8")  # a lone surrogate cannot reach the JVM
        except UnicodeEncodeError:
            return None
        return F.lit(value)
    return None


def ranges_predicate(schema: StructType, all_ranges: Sequence[SkipRanges]) -> Column | None:
    """``all_ranges`` as one Spark predicate (columns whose bounds have no literal are left out)."""
    conjuncts = []
    for ranges in all_ranges:
        data_type = schema[ranges.column].dataType
        column = F.col(quote(ranges.column))
        legs = []
        for low, high in ranges.intervals:
            lo = _stat_literal(data_type, low, upper=False)
            hi = _stat_literal(data_type, high, upper=True)
            if lo is None or hi is None:
                legs = []
                break
            legs.append((column >= lo) & (column <= hi))
        if not legs:
            continue
        if ranges.nulls:
            legs.append(column.isNull())
        conjuncts.append(reduce(lambda a, b: a | b, legs))
    return reduce(lambda a, b: a & b, conjuncts) if conjuncts else None
