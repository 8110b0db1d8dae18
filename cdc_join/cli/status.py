"""What a pipeline has done, and what its next run would do: ``cdc-join status`` and ``cdc-join plan``.

Both only read: the run log, file statistics, the landing folders and the ingest log (plus, for
the plan, the bronze events not yet applied). Nothing is written, no table is created.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import pyarrow.compute as pc

from cdc_join.checkpoint import Checkpoint, last_checkpoint
from cdc_join.checks import verify
from cdc_join.config import PipelineConfig
from cdc_join.landing import bronze
from cdc_join.landing.ingest import logged_files
from cdc_join.landing.listing import landing_files, list_folders
from cdc_join.run.maintenance import pipeline_tables
from cdc_join.run.plan import RunPath, choose
from cdc_join.silver import table as silver
from cdc_join.storage import Storage

#: Runs ``status`` shows, newest first.
RUNS_SHOWN = 5


@dataclass(frozen=True)
class Status:
    """The last runs, an unfinished one, and per source and table what is there now."""

    runs: list[dict[str, Any]]
    unfinished: list[str]
    sources: dict[str, dict[str, Any]]
    tables: dict[str, dict[str, Any]]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        lines = ["last runs (newest first):"] if self.runs else ["no run has completed yet"]
        lines += [
            f"  run {r['run_id']} {r['kind']} finished {r['finished_at']} in {r['seconds']}s: {r['silver']}"
            + (f", {r['warnings']} warning(s)" if r["warnings"] else "")
            for r in self.runs
        ]
        if self.unfinished:
            lines.append(f"unfinished run: it wrote {', '.join(self.unfinished)}; `cdc-join run` finishes it")
        lines.append("sources:")
        for name, s in self.sources.items():
            lag = "no events yet" if s["lag_minutes"] is None else f"newest event {age(s['lag_minutes'])}"
            lines.append(
                f"  {name}: {lag}; {s['pending_files']} landing file(s) not ingested yet; "
                f"{s['quarantined']} line(s) quarantined"
            )
        lines.append("tables:")
        lines += [
            f"  {path}: {t['rows']} rows in {t['files']} files, {t['bytes']} bytes"
            for path, t in self.tables.items()
        ]
        return "\n".join(lines)


@dataclass(frozen=True)
class NextRun:
    """What the next ``cdc-join run`` would do: the files it would ingest, its path and why, and
    the tables it would write."""

    pending: dict[str, dict[str, int]]
    path: str | None
    reason: str
    events_to_apply: dict[str, int] = field(default_factory=dict)
    writes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        files = ", ".join(f"{n}: {p['files']} file(s), {p['bytes']} bytes" for n, p in self.pending.items())
        applied = ", ".join(f"{n}: {c} event(s)" for n, c in self.events_to_apply.items() if c)
        lines = [
            f"to ingest: {files or 'nothing'}",
            f"ingested, not yet applied: {applied or 'no events'}",
            f"path: {self.path or ('chosen after the ingest' if self.pending else 'none')} ({self.reason})",
        ]
        if self.pending:
            lines.append("  (the files still to ingest may change the path: their events are not counted)")
        lines.append(f"writes: {', '.join(self.writes) or 'nothing'}")
        return "\n".join(lines)


def status(storage: Storage, config: PipelineConfig) -> Status:
    """The pipeline as it stands (see :class:`Status`)."""
    checkpoint = last_checkpoint(storage, config)
    pending = _pending(storage, config)
    quarantined = _quarantined(storage, config)
    sources = {
        name: {
            "lag_minutes": _lag_minutes(storage, config.bronze_path(name)),
            "pending_files": pending.get(name, {}).get("files", 0),
            "quarantined": quarantined.get(name, 0),
        }
        for name in config.sources
    }
    tables = {path: _size(storage, path) for path, _, _ in pipeline_tables(config) if storage.exists(path)}
    return Status(_runs(storage, config), verify.unfinished(storage, config, checkpoint), sources, tables)


def next_run(storage: Storage, config: PipelineConfig) -> NextRun:
    """What the next run would do (see :class:`NextRun`)."""
    pending = _pending(storage, config)
    previous = last_checkpoint(storage, config)
    missing = [n for n in config.sources if not storage.exists(config.bronze_path(n))]
    if missing:
        return _before_bronze(config, pending, previous, missing)
    versions = {n: storage.version(config.bronze_path(n)) for n in config.sources}
    events = {n: _events_since(storage, config, n, previous, versions[n]) for n in config.sources}
    types = silver.source_types(storage, config)
    plan = choose(storage, config, previous, versions, types, "auto", lambda: events)
    changed = (
        [n for n, c in events.items() if c] if plan.path is not RunPath.REBUILD else list(config.sources)
    )
    writes = [*_ingest_writes(config, pending), *_join_writes(config, changed)]
    return NextRun(pending, plan.path.value, plan.reason, events, writes)


def _before_bronze(
    config: PipelineConfig, pending: Mapping[str, Any], previous: Checkpoint, missing: list[str]
) -> NextRun:
    """What the next run does while sources have no bronze table yet: nothing to join until
    the left source has events; a new pipeline's first run once its landing files hold them."""
    ingest = _ingest_writes(config, pending)
    if config.left in missing and config.left not in pending:
        reason = f"source {config.left!r} (the left side) has no events yet: nothing to join"
        return NextRun(dict(pending), None, reason, writes=ingest)
    if previous.run_id == 0 and pending:
        files = sum(p["files"] for p in pending.values())
        reason = (
            f"the first run: it ingests {files} landing file(s), then builds every state table, "
            "the subscriptions and silver from all of bronze (recompute; rebuild if bronze is large)"
        )
        return NextRun(dict(pending), None, reason, writes=[*ingest, *_join_writes(config, config.sources)])
    reason = f"source(s) {', '.join(missing)} have no events in bronze yet"
    return NextRun(dict(pending), None, reason, writes=ingest)


def age(minutes: float) -> str:
    """How long ago, as a person reads it: minutes, hours, then days with the date (UTC)."""
    if minutes < 1:
        return "under a minute ago"
    if minutes < 60:
        return f"{minutes:.0f} min ago"
    if minutes < 24 * 60:
        hours, rest = divmod(round(minutes), 60)
        return f"{hours} h {rest} min ago"
    when = datetime.now(timezone.utc) - timedelta(minutes=minutes)
    days = round(minutes / (24 * 60))
    return f"{days} day{'s' if days != 1 else ''} ago ({when:%Y-%m-%d %H:%M} UTC)"


def _join_writes(config: PipelineConfig, changed: Iterable[str]) -> list[str]:
    """The tables a run writes after its ingest: the state of each ``changed`` source, every
    join's subscriptions, silver and the run log."""
    return [
        *(config.state_path(n) for n in changed),
        *(config.subscription_path(j) for j in config.joins),
        config.silver_path,
        config.runs_path,
    ]


def _ingest_writes(config: PipelineConfig, pending: Mapping[str, Any]) -> list[str]:
    if not pending:
        return []
    return [*(config.bronze_path(n) for n in pending), config.quarantine_path, config.ingest_log_path]


def _pending(storage: Storage, config: PipelineConfig) -> dict[str, dict[str, int]]:
    """Per source with landing files the ingest log does not name yet: how many, how large."""
    listed = {name: landing_files(found) for name, found in list_folders(storage.spark, config).items()}
    done = logged_files(storage, config, listed)
    out = {}
    for name, files in listed.items():
        new = [f for f in files if f.name not in done.get(name, {})]
        if new:
            out[name] = {"files": len(new), "bytes": sum(f.size for f in new)}
    return out


def _events_since(
    storage: Storage, config: PipelineConfig, name: str, previous: Checkpoint, version: int
) -> int:
    """Bronze events of a source after the version the last run applied (an upper bound of the
    keys they change).

    Counted from the tables' file statistics where bronze was only appended to since (every
    file of the applied version still there, each new file with its row count): then the rows
    of the new files are the change feed's inserts, and no Spark job is needed (delta-spark
    reads a local table's statistics from its log). Otherwise read as the run reads them."""
    counted = bronze.appended_rows(storage, config, name, previous, version)
    if counted is not None:
        return counted
    found = bronze.increment(storage, config, name, previous, version)
    if found is None:
        return 0
    return found.arrow.num_rows if found.arrow is not None else found.frame.count()


def _runs(storage: Storage, config: PipelineConfig) -> list[dict[str, Any]]:
    if not storage.exists(config.runs_path):
        return []
    columns = ["run_id", "kind", "finished_at", "seconds", "report"]
    rows = sorted(
        storage.read_arrow(config.runs_path, columns=columns).to_pylist(), key=lambda r: -r["run_id"]
    )
    shown = []
    for row in rows[:RUNS_SHOWN]:
        report = json.loads(row["report"] or "{}")
        counts = report.get("steps", {}).get("silver") or {}
        silver_line = ", ".join(f"{counts.get(k) or 0} {k}" for k in ("inserted", "updated", "deleted"))
        finished = row["finished_at"]
        shown.append(
            {
                "run_id": row["run_id"],
                "kind": row["kind"],
                "finished_at": finished.isoformat(timespec="seconds")
                if isinstance(finished, datetime)
                else finished,
                "seconds": row["seconds"],
                "silver": silver_line or "no silver change",
                "warnings": len(report.get("warnings") or []),
            }
        )
    return shown


def _lag_minutes(storage: Storage, path: str) -> float | None:
    """Minutes since the newest event in bronze (its ``ts_ms``), from file statistics."""
    if not storage.exists(path):
        return None
    newest = [f.max_values.get("_ts_ms") for f in storage.files(path)]
    newest_ms = max((n for n in newest if isinstance(n, int)), default=None)
    return None if newest_ms is None else round((time.time() * 1000 - newest_ms) / 60_000, 1)


#: Longer string statistics may be truncated prefixes (Delta keeps 32 characters).
_WHOLE_STATISTIC = 32


def _quarantined(storage: Storage, config: PipelineConfig) -> dict[str, int]:
    """Quarantined lines per source: a data file holding one source's lines counts from its
    statistics, the others' ``source`` column is read (no Spark job where the backend can)."""
    path = config.quarantine_path
    if not storage.exists(path):
        return {}
    counts: Counter[str] = Counter()
    mixed = []
    for f in storage.files(path):
        low, high = f.min_values.get("source"), f.max_values.get("source")
        one = isinstance(low, str) and low == high and len(low) < _WHOLE_STATISTIC
        if one and f.num_records is not None and not f.null_counts.get("source"):
            counts[str(low)] += f.num_records
        elif f.num_records != 0:
            mixed.append(f.path)
    if mixed:
        sources = storage.read_arrow(path, columns=["source"], files=mixed).column("source")
        for found in pc.value_counts(sources).to_pylist():
            if found["values"] is not None:
                counts[str(found["values"])] += int(found["counts"])
    return {name: n for name, n in counts.items() if n}


def _size(storage: Storage, path: str) -> dict[str, Any]:
    files = storage.files(path)
    return {
        "files": len(files),
        "rows": sum(f.num_records or 0 for f in files),
        "bytes": sum(f.size_bytes for f in files),
    }
