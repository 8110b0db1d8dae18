"""Lookups that turn changes into responses (KIP-213 SubscriptionResponseWrapper).

Two paths produce responses ``(pk, fk, lhs hash, right row or null, propagate-if-null)``:

- left-driven: a subscribing instruction looks up its new fk in the right state;
- right-driven: a changed right key finds its subscribers with a prefix-range read of the
  subscription table, the batch form of RocksDB's prefix scan on ``CombinedKey(fk, pk)``.

Every keyed read goes through :func:`read_matching`, which keeps only the data files whose
min/max statistics of the first key column can contain one of the wanted keys. The
subscription table is clustered by fk, so a few changed right keys read a few files.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import BooleanType, StringType, StructField, StructType

from cdc_join.config import JoinConfig, SourceConfig
from cdc_join.state import DELETED, SEQ, value_fields
from cdc_join.storage import FileStats, Storage
from cdc_join.subscription import INSTRUCTION, LHS_HASH, Instruction, fk_columns, pk_columns

RIGHT = "_right"
RIGHT_SEQ = "_right_seq"
PROPAGATE_IF_NULL = "_propagate_if_null"
ORIGIN = "_origin"


@dataclass(frozen=True)
class ScanStats:
    """Files a keyed read opened and skipped."""

    files_scanned: int
    files_total: int

    @property
    def files_skipped(self) -> int:
        return self.files_total - self.files_scanned

    def __add__(self, other: ScanStats) -> ScanStats:
        return ScanStats(self.files_scanned + other.files_scanned, self.files_total + other.files_total)


def read_matching(
    storage: Storage,
    path: str,
    keys: DataFrame,
    on: Sequence[tuple[str, str]],
    version: int | None = None,
    values: Sequence[Any] | None = None,
) -> tuple[DataFrame, ScanStats]:
    """Rows of the table at ``path`` whose columns equal a row of ``keys``.

    Args:
        storage: the storage seam.
        path: the table.
        keys: the wanted keys (a change set; may hold duplicates).
        on: pairs ``(table column, keys column)``; the first pair drives file skipping.
        version: read this version instead of the latest.
        values: the distinct values of the first keys column, when the caller has them on the
            driver already (a materialized change set); saves the Spark job that collects them.

    Returns:
        The matching table rows and how many files were scanned out of how many.
    """
    files = storage.files(path, version)
    if not files:
        return storage.read(path, version).limit(0), ScanStats(0, 0)
    selected = _candidate_files(storage, path, version, files, keys, on[0], values)
    table = storage.read(path, version, files=selected) if selected else storage.read(path, version).limit(0)
    cond = [table[f"`{t}`"].eqNullSafe(keys[f"`{k}`"]) for t, k in on]
    wanted = keys.select(*[F.col(f"`{k}`") for _, k in on]).distinct()
    matched = table.join(wanted, cond, "left_semi")
    return matched, ScanStats(len(selected), len(files))


#: Up to this many distinct wanted keys are matched against file ranges on the driver; more
#: are range-joined in Spark. Either way only candidate paths (bounded by files) come back.
DRIVER_PRUNING_KEYS = 10_000


def _candidate_files(
    storage: Storage,
    path: str,
    version: int | None,
    files: list[FileStats],
    keys: DataFrame,
    first: tuple[str, str],
    values: Sequence[Any] | None,
) -> list[str]:
    """Paths of the files whose [min, max] of the first key column contains some wanted key."""
    if len(files) == 1:
        return [files[0].path]
    column, key_column = first
    ranged = [
        f for f in files if f.min_values.get(column) is not None and f.max_values.get(column) is not None
    ]
    unranged = {f.path for f in files} - {f.path for f in ranged}
    if not ranged:
        return sorted(unranged)
    if values is None or len(values) > DRIVER_PRUNING_KEYS:
        data_type = storage.read(path, version).schema[column].dataType
        wanted = keys.select(F.col(f"`{key_column}`").cast(data_type).alias("k")).distinct()
        few = wanted.limit(DRIVER_PRUNING_KEYS + 1).collect() if values is None else None
        if few is not None and len(few) <= DRIVER_PRUNING_KEYS:
            values = [r.k for r in few]
        else:
            return _range_join(storage, ranged, unranged, wanted, column, data_type)
    ordered = sorted({v for v in values if v is not None}, key=_sort_key)
    return sorted(unranged | {f.path for f in ranged if _holds_any(f, column, ordered)})


def _range_join(
    storage: Storage,
    ranged: list[FileStats],
    unranged: set[str],
    wanted: DataFrame,
    column: str,
    data_type: Any,
) -> list[str]:
    """Candidate files for many wanted keys: a broadcast range join of file bounds in Spark."""
    ranges = storage.spark.createDataFrame(
        [(f.path, f.min_values[column], f.max_values[column]) for f in ranged],
        StructType(
            [StructField("path", StringType()), StructField("lo", data_type), StructField("hi", data_type)]
        ),
    )
    hits = F.broadcast(ranges).join(wanted, (wanted.k >= ranges.lo) & (wanted.k <= ranges.hi))
    return sorted(unranged | {r.path for r in hits.select("path").distinct().collect()})


def _sort_key(value: object) -> tuple[str, object]:
    return (type(value).__name__, value)


def _holds_any(file: FileStats, column: str, values: list) -> bool:
    """Whether a sorted list of keys has one inside the file's range (bisect; True if unsure)."""
    lo, hi = file.min_values[column], file.max_values[column]
    try:
        i = bisect.bisect_left(values, lo)
        return i < len(values) and values[i] <= hi
    except TypeError:
        return True


def right_rows(
    storage: Storage,
    path: str,
    right: SourceConfig,
    keys: DataFrame,
    key_columns: Sequence[str],
    version: int | None,
    values: Sequence[Any] | None = None,
) -> tuple[DataFrame, ScanStats]:
    """Live right-state rows whose primary key equals ``keys[key_columns]``, as ``_right`` structs.

    Returns ``key_columns…, _right, _right_seq`` for the keys that name a live right row.
    ``values`` are the distinct values of the first key column, if known (see :func:`read_matching`).
    """
    rows, stats = read_matching(
        storage, path, keys, list(zip(right.primary_key, key_columns, strict=False)), version, values
    )
    live = rows.filter(~F.col(DELETED))
    values = value_fields(live.schema)
    return (
        live.select(
            *[F.col(f"`{pk}`").alias(k) for pk, k in zip(right.primary_key, key_columns, strict=False)],
            F.struct(*[F.col(f"`{f.name}`") for f in values]).alias(RIGHT),
            F.col(SEQ).alias(RIGHT_SEQ),
        ),
        stats,
    )


def all_right_rows(
    storage: Storage, path: str, right: SourceConfig, key_columns: Sequence[str], version: int | None
) -> DataFrame:
    """Every live right-state row, shaped like :func:`right_rows` (for a recompute)."""
    live = storage.read(path, version).filter(~F.col(DELETED))
    values = value_fields(live.schema)
    return live.select(
        *[F.col(f"`{pk}`").alias(k) for pk, k in zip(right.primary_key, key_columns, strict=False)],
        F.struct(*[F.col(f"`{f.name}`") for f in values]).alias(RIGHT),
        F.col(SEQ).alias(RIGHT_SEQ),
    )


def left_driven_responses(
    storage: Storage,
    right_state: str,
    right_version: int | None,
    messages: DataFrame,
    left: SourceConfig,
    join: JoinConfig,
    right: SourceConfig,
    fk_values: Sequence[Any] | None = None,
) -> tuple[DataFrame, ScanStats]:
    """Responses to the instructions that propagate: the right row for the new fk, or null.

    ``DELETE_KEY_AND_PROPAGATE`` answers with a null right row; ``DELETE_KEY_NO_PROPAGATE``
    only unsubscribes and gets no response. ``fk_values``: the messages' first fk values, if
    known on the driver (they drive file pruning of the right state).
    """
    fks = fk_columns(join)
    propagating = messages.filter(F.col(INSTRUCTION) != Instruction.DELETE_KEY_NO_PROPAGATE.value)
    found, stats = right_rows(
        storage, right_state, right, propagating.select(*fks), fks, right_version, fk_values
    )
    found = found.dropDuplicates(fks)
    responses = propagating.join(found, [propagating[c].eqNullSafe(found[c]) for c in fks], "left").select(
        *[propagating[c] for c in pk_columns(left)],
        *[propagating[c] for c in fks],
        propagating[LHS_HASH],
        propagating[INSTRUCTION],
        found[RIGHT],
        found[RIGHT_SEQ],
        (propagating[INSTRUCTION] != Instruction.PROPAGATE_ONLY_IF_FK_VAL_AVAILABLE.value).alias(
            PROPAGATE_IF_NULL
        ),
        F.lit("left").alias(ORIGIN),
    )
    return responses, stats


def changed_right_keys(right_changes: DataFrame, right: SourceConfig, join: JoinConfig) -> DataFrame:
    """Distinct primary keys of changed right rows, renamed to the join's ``fk_*`` columns."""
    return right_changes.select(
        *[F.col(f"`{pk}`").alias(fk) for pk, fk in zip(right.primary_key, fk_columns(join), strict=False)]
    ).distinct()


def right_driven_responses(
    storage: Storage,
    subscription: str,
    subscription_version: int | None,
    right_state: str,
    right_version: int | None,
    changed_keys: DataFrame,
    left: SourceConfig,
    join: JoinConfig,
    right: SourceConfig,
    fk_values: Sequence[Any] | None = None,
) -> tuple[DataFrame, ScanStats, ScanStats]:
    """Responses for every subscriber of a changed right key (prefix-range lookup).

    Args:
        changed_keys: ``fk_*`` columns, one row per changed right key.
        fk_values: the distinct values of the first ``fk_*`` column, if known on the driver.

    Returns:
        The responses, and the scan statistics of the subscription and right-state reads.
    """
    fks = fk_columns(join)
    subscribers, sub_stats = read_matching(
        storage, subscription, changed_keys, [(c, c) for c in fks], subscription_version, fk_values
    )
    found, right_stats = right_rows(storage, right_state, right, changed_keys, fks, right_version, fk_values)
    responses = subscribers.join(found, fks, "left").select(
        *[F.col(c) for c in pk_columns(left)],
        *[F.col(c) for c in fks],
        F.col(LHS_HASH),
        F.lit(None).cast(StringType()).alias(INSTRUCTION),
        F.col(RIGHT),
        F.col(RIGHT_SEQ),
        F.lit(True).cast(BooleanType()).alias(PROPAGATE_IF_NULL),
        F.lit("right").alias(ORIGIN),
    )
    return responses, sub_stats, right_stats
