"""The checkpoint: what the last completed run processed, as the run log's newest row says.

The row records, per source, the last bronze version applied to state, the state version the
join has processed and the truncate watermark; what defined silver's rows; and the version of
every table the run wrote or read as it left it, which the next run reads "the tables of the
last completed run" at (by time travel) and after which every commit is a later run's
(:mod:`cdc_join.storage.commits`). Runs write the log (:mod:`cdc_join.run.runlog`); every step
that needs the last checkpoint reads it here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pyspark.sql.types import LongType, StringType, StructField, StructType, TimestampType

from cdc_join.config import PipelineConfig
from cdc_join.storage import Storage

RUNS_SCHEMA = StructType(
    [
        StructField("run_id", LongType(), False),
        StructField("kind", StringType(), False),
        StructField("started_at", TimestampType(), True),
        StructField("finished_at", TimestampType(), True),
        StructField("seconds", StringType(), True),
        StructField("checkpoint", StringType(), False),
        StructField("report", StringType(), True),
    ]
)


@dataclass(frozen=True)
class Checkpoint:
    """What the last completed run processed."""

    run_id: int = 0
    bronze_versions: Mapping[str, int] = field(default_factory=dict)
    state_versions: Mapping[str, int] = field(default_factory=dict)
    watermarks: Mapping[str, str] = field(default_factory=dict)
    silver: Mapping[str, Any] | None = None
    """What defined silver's rows (left, joins, select, output) when they were written."""
    tables: Mapping[str, int] = field(default_factory=dict)
    """The version of every table the run wrote or read as it left it (state, subscriptions,
    silver), by path: what the next run reads as "the tables of the last completed run"."""
    settings: Mapping[str, Any] = field(default_factory=dict)
    """The pipeline's settings a run applies whatever its data (:func:`settings`), as it did."""

    def to_json(self) -> str:
        return json.dumps(
            {
                "run_id": self.run_id,
                "bronze_versions": dict(self.bronze_versions),
                "state_versions": dict(self.state_versions),
                "watermarks": dict(self.watermarks),
                "silver": None if self.silver is None else dict(self.silver),
                "tables": dict(self.tables),
                "settings": dict(self.settings),
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> Checkpoint:
        raw = json.loads(text)
        return cls(
            run_id=int(raw["run_id"]),
            bronze_versions={k: int(v) for k, v in raw.get("bronze_versions", {}).items()},
            state_versions={k: int(v) for k, v in raw.get("state_versions", {}).items()},
            watermarks=dict(raw.get("watermarks", {})),
            silver=raw.get("silver"),
            tables={k: int(v) for k, v in (raw.get("tables") or {}).items()},
            settings=dict(raw.get("settings") or {}),
        )


def settings(config: PipelineConfig) -> dict[str, Any]:
    """The settings a run applies to the tables whatever it changes: silver's change feed,
    turned on or off by every run that writes silver."""
    return {"silver_change_feed": bool(config.silver_change_feed)}


def last_checkpoint(storage: Storage, config: PipelineConfig) -> Checkpoint:
    """The checkpoint of the newest completed run, or an empty one before the first run.

    Reads one data file: the one whose statistics hold the greatest run id.
    """
    if not storage.exists(config.runs_path):
        return Checkpoint()
    files = storage.files(config.runs_path)
    if not files:
        return Checkpoint()
    newest = max(
        files, key=lambda f: (f.max_values.get("run_id") is not None, f.max_values.get("run_id") or 0)
    )
    chosen = [newest.path] if newest.max_values.get("run_id") is not None else None
    rows = storage.read_arrow(config.runs_path, columns=["run_id", "checkpoint"], files=chosen)
    if not rows.num_rows:
        return Checkpoint()
    last = max(range(rows.num_rows), key=lambda i: rows.column("run_id")[i].as_py())
    return Checkpoint.from_json(rows.column("checkpoint")[last].as_py())
