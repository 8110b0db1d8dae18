"""Writes Debezium-shaped change events into landing folders — for the demo, tests, benchmarks.

Events carry the Kafka Connect ``schema``/``payload`` envelope of a PostgreSQL connector, so
types are explicit and parsing does not depend on inference. Files are written under a
temporary name starting with ``_`` and renamed into place, the way a landing tool must do it.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

#: Column types accepted in declarations: Kafka Connect types, and ``date`` (Debezium's
#: ``io.debezium.time.Date``: an int32 of days since the epoch; give ``datetime.date`` values).
CONNECT_TYPES = ("int32", "int64", "string", "double", "boolean", "date")
_EPOCH = datetime.date(1970, 1, 1)


def connect_schema(table: str, columns: Mapping[str, str]) -> dict[str, Any]:
    """The Connect schema of a Debezium envelope whose rows have ``columns`` (name → type)."""
    row = {
        "type": "struct",
        "optional": True,
        "name": f"dbserver1.inventory.{table}.Value",
        "fields": [_field(c, t) for c, t in columns.items()],
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
        tables: per table, its columns and their Connect types (the first ones usually the key).
    """

    def __init__(self, landing_root: str | os.PathLike[str], tables: Mapping[str, Mapping[str, str]]) -> None:
        self.root = Path(landing_root)
        self.tables = {t: dict(cols) for t, cols in tables.items()}
        self._files = 0
        for t, cols in self.tables.items():
            bad = {c: ty for c, ty in cols.items() if ty not in CONNECT_TYPES}
            if bad:
                raise ValueError(f"tables[{t!r}]: unsupported Connect types {bad}; use {CONNECT_TYPES}")
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
        payload = {
            "before": _row(cols, before),
            "after": _row(cols, after),
            "source": {"connector": "postgresql", "table": table, "lsn": lsn, "ts_ms": ts},
            "op": op,
            "ts_ms": ts,
        }
        return {"schema": connect_schema(table, cols), "payload": payload}

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


def _field(column: str, type_name: str) -> dict[str, Any]:
    if type_name == "date":
        return {
            "type": "int32",
            "optional": True,
            "name": "io.debezium.time.Date",
            "version": 1,
            "field": column,
        }
    return {"type": type_name, "optional": True, "field": column}


def _row(columns: Mapping[str, str], values: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if values is None:
        return None
    unknown = set(values) - set(columns)
    if unknown:
        raise ValueError(f"values for undeclared columns {sorted(unknown)}")
    return {c: _encode(values.get(c), columns[c]) for c in columns}


def _encode(value: Any, type_name: str) -> Any:
    if type_name == "date" and isinstance(value, datetime.date):
        return (value - _EPOCH).days
    return value
