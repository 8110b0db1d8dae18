"""Writes Debezium-shaped change events into landing folders — for the demo, tests, benchmarks.

Events look like a PostgreSQL connector's: with the Kafka Connect ``schema``/``payload``
envelope (``schemas.enable=true``), or the payload alone for the tables named in
``payload_only``. Files are written under a temporary name starting with ``_`` and renamed into
place, the way a landing tool must do it.

Column types, with the value each takes and how it is written:

======================  ===================  =============================================
type                    Python value         Connect envelope / payload only
======================  ===================  =============================================
``int16/int32/int64``   ``int``              JSON number
``string``              ``str``              JSON string
``double``              ``float``            JSON number
``boolean``             ``bool``             JSON boolean
``date``                ``datetime.date``    days since 1970-01-01 (``io.debezium.time.Date``)
``timestamp``           ``datetime``         microseconds since 1970 (``MicroTimestamp``)
``decimal(p,s)``        ``Decimal``          base64 unscaled bytes / a JSON number
``array<T>``            ``list``             JSON array of T
``struct<a:T,…>``       ``dict``             JSON object
======================  ===================  =============================================
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import re
from collections.abc import Collection, Iterable, Mapping
from decimal import Decimal
from pathlib import Path
from typing import Any

CONNECT_TYPES = ("int16", "int32", "int64", "string", "double", "boolean", "date", "timestamp")
_EPOCH = datetime.date(1970, 1, 1)
_EPOCH_TS = datetime.datetime(1970, 1, 1)
_DECIMAL = re.compile(r"^decimal\((\d+),\s*(\d+)\)$")


def _split_top(text: str) -> list[str]:
    """Split ``a:T, b:struct<c:T, d:T>`` at its top-level commas."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "<"
        depth -= ch == ">"
        if ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return [p for p in parts if p]


def _struct_fields(type_name: str) -> list[tuple[str, str]]:
    inner = type_name[len("struct<") : -1]
    return [(p.split(":", 1)[0].strip(), p.split(":", 1)[1].strip()) for p in _split_top(inner)]


def check_type(type_name: str) -> None:
    """Raise ``ValueError`` for a column type this writer does not know."""
    if type_name in CONNECT_TYPES or _DECIMAL.match(type_name):
        return
    if type_name.startswith("array<") and type_name.endswith(">"):
        return check_type(type_name[len("array<") : -1])
    if type_name.startswith("struct<") and type_name.endswith(">"):
        for _, field_type in _struct_fields(type_name):
            check_type(field_type)
        return
    raise ValueError(
        f"unsupported column type {type_name!r}; use {CONNECT_TYPES}, decimal(p,s), array<…>, struct<…>"
    )


def field_schema(type_name: str) -> dict[str, Any]:
    """The Kafka Connect schema of a column of ``type_name`` (see the module docstring)."""
    decimal = _DECIMAL.match(type_name)
    if decimal:
        params = {"scale": decimal.group(2), "connect.decimal.precision": decimal.group(1)}
        return {
            "type": "bytes",
            "optional": True,
            "name": "org.apache.kafka.connect.data.Decimal",
            "version": 1,
            "parameters": params,
        }
    if type_name == "date":
        return {"type": "int32", "optional": True, "name": "io.debezium.time.Date", "version": 1}
    if type_name == "timestamp":
        return {"type": "int64", "optional": True, "name": "io.debezium.time.MicroTimestamp", "version": 1}
    if type_name.startswith("array<"):
        return {"type": "array", "optional": True, "items": field_schema(type_name[len("array<") : -1])}
    if type_name.startswith("struct<"):
        fields = [{**field_schema(t), "field": n} for n, t in _struct_fields(type_name)]
        return {"type": "struct", "optional": True, "fields": fields}
    return {"type": type_name, "optional": True}


def encode(value: Any, type_name: str, *, payload_only: bool = False) -> Any:
    """A Python value as the JSON value Debezium writes for a column of ``type_name``."""
    if value is None:
        return None
    decimal = _DECIMAL.match(type_name)
    if decimal:
        if payload_only:
            return float(value)
        unscaled = int(Decimal(value).scaleb(int(decimal.group(2))))
        size = max(1, (unscaled.bit_length() + 8) // 8)
        return base64.b64encode(unscaled.to_bytes(size, "big", signed=True)).decode()
    if type_name == "date":
        return (value - _EPOCH).days
    if type_name == "timestamp":
        delta = value - _EPOCH_TS
        return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
    if type_name.startswith("array<"):
        element = type_name[len("array<") : -1]
        return [encode(v, element, payload_only=payload_only) for v in value]
    if type_name.startswith("struct<"):
        fields = _struct_fields(type_name)
        return {n: encode(value.get(n), t, payload_only=payload_only) for n, t in fields}
    return value


def connect_schema(table: str, columns: Mapping[str, str]) -> dict[str, Any]:
    """The Connect schema of a Debezium envelope whose rows have ``columns`` (name → type)."""
    row = {
        "type": "struct",
        "optional": True,
        "name": f"dbserver1.inventory.{table}.Value",
        "fields": [{**field_schema(t), "field": c} for c, t in columns.items()],
    }
    source = {
        "type": "struct",
        "optional": False,
        "name": "io.debezium.connector.postgresql.Source",
        "field": "source",
        "fields": [
            {"type": "string", "optional": False, "field": "connector"},
            {"type": "string", "optional": False, "field": "table"},
            {"type": "int64", "optional": True, "field": "lsn"},
            {"type": "int64", "optional": False, "field": "ts_ms"},
        ],
    }
    return {
        "type": "struct",
        "optional": False,
        "name": f"dbserver1.inventory.{table}.Envelope",
        "fields": [
            {**row, "field": "before"},
            {**row, "field": "after"},
            source,
            {"type": "string", "optional": False, "field": "op"},
            {"type": "int64", "optional": True, "field": "ts_ms"},
        ],
    }


class EventWriter:
    """Builds and lands change events for a set of tables.

    Args:
        landing_root: the folder holding one landing folder per table.
        tables: per table, its columns and their types (see the module docstring).
        payload_only: tables whose events carry no Connect schema (``schemas.enable=false``).
    """

    def __init__(
        self,
        landing_root: str | os.PathLike[str],
        tables: Mapping[str, Mapping[str, str]],
        payload_only: Collection[str] = (),
    ) -> None:
        self.root = Path(landing_root)
        self.tables = {t: dict(cols) for t, cols in tables.items()}
        self.payload_only = set(payload_only)
        self._files = 0
        for t, cols in self.tables.items():
            for column, type_name in cols.items():
                try:
                    check_type(type_name)
                except ValueError as e:
                    raise ValueError(f"tables[{t!r}][{column!r}]: {e}") from None
            (self.root / t).mkdir(parents=True, exist_ok=True)

    def event(
        self,
        table: str,
        op: str,
        *,
        before: Mapping[str, Any] | None = None,
        after: Mapping[str, Any] | None = None,
        lsn: int,
        ts_ms: int | None = None,
    ) -> dict[str, Any]:
        """One event (op ``c``/``u``/``d``/``r``/``t``) with sequence ``lsn``."""
        ts = ts_ms if ts_ms is not None else 1_700_000_000_000 + lsn
        cols = self.tables[table]
        bare = table in self.payload_only
        payload = {
            "before": _row(cols, before, bare),
            "after": _row(cols, after, bare),
            "source": {"connector": "postgresql", "table": table, "lsn": lsn, "ts_ms": ts},
            "op": op,
            "ts_ms": ts,
        }
        return payload if bare else {"schema": connect_schema(table, cols), "payload": payload}

    def upsert(self, table: str, row: Mapping[str, Any], lsn: int, op: str = "u") -> dict[str, Any]:
        return self.event(table, op, after=row, lsn=lsn)

    def delete(self, table: str, row: Mapping[str, Any], lsn: int) -> dict[str, Any]:
        return self.event(table, "d", before=row, lsn=lsn)

    def write(self, table: str, events: Iterable[Mapping[str, Any] | str], name: str | None = None) -> Path:
        """Land events (dicts, or raw lines for garbage) as one JSON-lines file; return its path."""
        self._files += 1
        final = self.root / table / (name or f"{table}-{self._files:06d}.jsonl")
        tmp = final.with_name(f"_{final.name}.tmp")
        with tmp.open("w") as f:
            for e in events:
                f.write((e if isinstance(e, str) else json.dumps(e, separators=(",", ":"))) + "\n")
        os.replace(tmp, final)
        return final


def _row(
    columns: Mapping[str, str], values: Mapping[str, Any] | None, payload_only: bool
) -> dict[str, Any] | None:
    if values is None:
        return None
    unknown = set(values) - set(columns)
    if unknown:
        raise ValueError(f"values for undeclared columns {sorted(unknown)}")
    return {c: encode(values.get(c), columns[c], payload_only=payload_only) for c in columns}
