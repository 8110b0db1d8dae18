"""Rows already on the driver (Arrow) as one Parquet data file of a Delta table, with the
statistics Delta's own writer records for it; and which tables such a file may be added to.

Delta-on-Spark writes rows through a Spark query (planning, a job, its statistics collected by
generated code): about 0.3 s for a few rows whatever their number, which a run paid for each
of its state, subscription and run-log appends (:mod:`cdc_join.storage.delta_txn` adds the file
in one transaction instead). The file is what Delta's writer would write, column for column:

- the table's columns in its order, with the Arrow types Spark reads back as the table's types
  (timestamps as UTC microseconds), Snappy-compressed;
- statistics as Delta records them in the ``add`` action (``numRecords``; ``nullCount`` of each
  top-level column that is not nested; ``minValues``/``maxValues`` of integer, date, string and
  timestamp columns, a timestamp cut to milliseconds as Delta writes it, a string's minimum cut
  to :data:`STRING_PREFIX` characters and its maximum left out when longer, as a cut maximum
  would not bound it; ``tightBounds``, as the file has no deletion
  vector). A bound left out is one a reader cannot skip on, never a wrong one.

:func:`refused` names why a table takes no such file (``None``: it does): partition columns,
column mapping, row tracking, CHECK constraints, generated, identity or default columns
(``delta.*`` column metadata), nested NOT NULL fields, types this writer does not cover, or a
writer feature not in :data:`PLAIN_FEATURES`. Those tables keep Spark's writer, as do rows with
a null in a NOT NULL column (Delta's writer then refuses them with its own error).
"""

from __future__ import annotations

import datetime
import json
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

STRING_PREFIX = 32
"""Characters of a string statistic Delta keeps (``delta.dataSkippingStringPrefixLength``)."""

PLAIN_FEATURES = frozenset(
    {
        "appendOnly",
        "invariants",
        "checkConstraints",
        "changeDataFeed",
        "deletionVectors",
        "columnMapping",
        "domainMetadata",
        "v2Checkpoint",
        "vacuumProtocolCheck",
        "inCommitTimestamp",
    }
)
"""Writer features that ask nothing of an added data file beyond what :func:`write` gives it
(each one's table property is checked apart where it can be on or off: column mapping,
constraints)."""

_PLAIN_TYPES = frozenset(
    {
        "boolean",
        "byte",
        "short",
        "integer",
        "long",
        "float",
        "double",
        "string",
        "binary",
        "date",
        "timestamp",
    }
)
_BOUNDED = frozenset({"integer", "date", "string", "timestamp"})


@dataclass(frozen=True)
class DataFile:
    """A data file written into a table's folder, as its ``add`` action names it."""

    path: str
    """Relative to the table's folder."""
    size: int
    modified_ms: int
    rows: int
    stats: str

    def add_action(self) -> str:
        """The file's ``add`` action, as one line of a Delta commit."""
        add = {
            "path": self.path,
            "partitionValues": {},
            "size": self.size,
            "modificationTime": self.modified_ms,
            "dataChange": True,
            "stats": self.stats,
        }
        return json.dumps({"add": add})

    def cdc_action(self) -> str:
        """The file's ``cdc`` action (a change data file), as one line of a Delta commit."""
        cdc = {"path": self.path, "partitionValues": {}, "size": self.size, "dataChange": False}
        return json.dumps({"cdc": cdc})


def refused(protocol: Mapping[str, Any], metadata: Mapping[str, Any]) -> str | None:
    """Why a table (its ``protocol`` and ``metaData`` actions) takes no file of :func:`write`;
    ``None`` when it takes one."""
    features = set(protocol.get("writerFeatures") or ())
    if features - PLAIN_FEATURES:
        return f"writer feature(s) {', '.join(sorted(features - PLAIN_FEATURES))}"
    if metadata.get("partitionColumns"):
        return "partition columns"
    conf = metadata.get("configuration") or {}
    if conf.get("delta.columnMapping.mode", "none") != "none":
        return "column mapping"
    if str(conf.get("delta.enableRowTracking", "false")).lower() == "true":
        return "row tracking"
    if any(key.startswith("delta.constraints.") for key in conf):
        return "CHECK constraints"
    schema = json.loads(metadata.get("schemaString") or '{"fields": []}')
    for field in schema.get("fields", []):
        why = _field_refused(field, top=True)
        if why is not None:
            return f"column {field.get('name')!r}: {why}"
    return None


def _field_refused(field: Mapping[str, Any], *, top: bool) -> str | None:
    if any(str(key).startswith("delta.") for key in field.get("metadata") or {}):
        return "Delta column metadata (generated, identity, default or invariant)"
    if not top and not field.get("nullable", True):
        return "a nested NOT NULL field"
    return _type_refused(field.get("type"))


def _type_refused(kind: Any) -> str | None:
    if isinstance(kind, str):
        if kind in _PLAIN_TYPES or kind.startswith("decimal("):
            return None
        return f"type {kind}"
    if isinstance(kind, Mapping) and kind.get("type") == "struct":
        return next(
            (why for f in kind.get("fields", []) for why in [_field_refused(f, top=False)] if why), None
        )
    if isinstance(kind, Mapping) and kind.get("type") == "array":
        if not kind.get("containsNull", True):
            return "an array of NOT NULL elements"
        return _type_refused(kind.get("elementType"))
    return f"type {json.dumps(kind)}"


def nulls_where_refused(table: pa.Table, schema: Mapping[str, Any]) -> str | None:
    """The first NOT NULL column of ``schema`` (a table's schema, as its log holds it) that
    holds a null in ``table``; ``None`` when there is none."""
    for field in schema.get("fields", []):
        if not field.get("nullable", True) and table.column(field["name"]).null_count:
            return str(field["name"])
    return None


CHANGE_DATA = "_change_data"
"""The folder of a table's change data files (Delta's ``CDCReader.CDC_LOCATION``)."""


def write(table: pa.Table, folder: str, *, changes: bool = False) -> DataFile:
    """Write ``table`` (already in the table's columns and Arrow types) as one Parquet file
    in ``folder``, the table's own folder; with ``changes``, as a change data file (the
    table's columns and ``_change_type``) in its ``_change_data`` folder, as Delta's writer
    names them."""
    name = f"part-00000-{uuid.uuid4()}-c000.snappy.parquet"
    if changes:
        os.makedirs(os.path.join(folder, CHANGE_DATA), exist_ok=True)
        name = f"{CHANGE_DATA}/cdc-00000-{uuid.uuid4()}.c000.snappy.parquet"
    target = os.path.join(folder, name)
    pq.write_table(table, target, compression="snappy")
    found = os.stat(target)
    return DataFile(name, found.st_size, int(found.st_mtime * 1000), table.num_rows, stats(table))


def stats(table: pa.Table) -> str:
    """Delta's statistics of a data file holding ``table`` (module docstring)."""
    found: dict[str, Any] = {"numRecords": table.num_rows}
    low: dict[str, Any] = {}
    high: dict[str, Any] = {}
    nulls: dict[str, int] = {}
    for name, column in zip(table.column_names, table.columns, strict=True):
        kind = _kind(column.type)
        if kind is None:
            continue
        nulls[name] = column.null_count
        if kind not in _BOUNDED or column.null_count == len(column):
            continue
        bounds = pc.min_max(column)
        least, most = bounds["min"].as_py(), bounds["max"].as_py()
        if kind == "date":
            least, most = least.isoformat(), most.isoformat()
        if kind == "timestamp":
            least, most = _millis(least), _millis(most)
        if kind == "string":
            least = least[:STRING_PREFIX]
            if len(most) > STRING_PREFIX:
                most = None
        low[name] = least
        if most is not None:
            high[name] = most
    found.update(minValues=low, maxValues=high, nullCount=nulls, tightBounds=True)
    return json.dumps(found, separators=(",", ":"))


def _kind(kind: pa.DataType) -> str | None:
    """What :func:`stats` records of a column of this Arrow type (``None``: nothing)."""
    if pa.types.is_integer(kind):
        return "integer"
    if pa.types.is_date32(kind):
        return "date"
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return "string"
    if pa.types.is_timestamp(kind) and kind.tz is not None:
        return "timestamp"
    if pa.types.is_nested(kind):
        return None
    return "other"


def _millis(value: datetime.datetime) -> str:
    """A timestamp as Delta's statistics write it: UTC, cut to milliseconds (Delta's data
    skipping reads a maximum as 1 ms later for that reason)."""
    utc = value.astimezone(datetime.timezone.utc)
    return utc.strftime("%Y-%m-%dT%H:%M:%S.") + f"{utc.microsecond // 1000:03d}Z"
