"""Table maintenance: the policy behind ``cdc-join optimize``, from file statistics alone.

Runs only ever append to the state and subscription tables (merge-on-read), so over many runs:

- **superseded rows pile up.** A key changed in ten runs has ten rows; readers fold them
  (newest per key), but every read pays for all of them. Compaction rewrites the table with
  one current row per key (:func:`cdc_join.join.state.compact`, :func:`cdc_join.join.subscription.compact`).
- **clustering decays.** Right-driven lookups read only the subscription files whose fk range
  can hold a changed right key, and keyed reads of a state table only the files whose key
  range can hold a wanted key. Appended files span the whole range, so lookups read more and
  more files. Compaction writes rows in fk (subscriptions) or key (state) order into
  right-sized files, which restores narrow, disjoint ranges.
- **small files pile up** in silver, whose MERGEs write a few files per run.

The policy, per table, from its file statistics (no data is read to decide):

- a subscription table is compacted in fk order, a state table in key order, once the files
  outside its key order (:func:`loose`: what runs appended since the last compaction, as far as
  the statistics tell) hold :data:`MAX_LOOSE_SHARE` of its bytes, or number more than
  :data:`MAX_LOOSE_FILES`. Each keyed read may open every loose file and reads their superseded
  rows, so their bytes are what a compaction saves every later run; a compaction rewrites the
  whole table, so waiting until they are a share of it keeps its cost a fixed fraction of the
  runs' appends at any table size. (An earlier rule, "ranges overlap more than 4 deep", fired
  after 2–4 runs whatever the appends weighed: at SF 1 of the benchmark the maintenance then
  cost more than the runs, benchmarks/CHANGELOG.md, 2026-11-28);
- silver is compacted (Delta OPTIMIZE) when it has more than :data:`MAX_SMALL_FILES` small files;
- a table whose deletion vectors hide :data:`MAX_DELETED_SHARE` of its stored rows has them
  purged (``REORG TABLE … APPLY (PURGE)``): silver's MERGEs on delta-spark mark updated and
  deleted rows instead of rewriting files, and OPTIMIZE never picks a file that fills a bin by
  itself, so over 200 runs of the SF 1 benchmark silver came to store 2.38 M rows for 1.5 M
  live ones, every MERGE reading them all (benchmarks/README.md, longevity);
- so are the tables every run appends a small file to, which would otherwise grow by a file per
  run for the life of the pipeline: bronze, the run log, the ingest log, the quarantine and the
  quality results. OPTIMIZE only rewrites files (no data change), so change-feed readers of
  bronze see nothing new.

A compaction is one overwrite that commits only if the table did not move while it was
rewritten (so a run appending meanwhile makes it give up, never lose the run's rows), and it
keeps, per key, the row an unfinished run still needs as its old image. A state or subscription
table that a run which did not commit wrote to since the last completed run is not compacted
until a run has looked at those rows again (they are found by the files they were appended in,
:mod:`cdc_join.storage.commits`); the report says so. It never vacuums, so
pinned versions of running jobs stay readable. With ``tombstone_horizon_days`` in the pipeline
YAML, state compaction also drops delete tombstones whose event is older than that (default:
kept forever, see :func:`cdc_join.join.state.compact` for what dropping them allows).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cdc_join.checkpoint import Checkpoint, last_checkpoint
from cdc_join.columns import fk_columns, target_file_size
from cdc_join.config import PipelineConfig
from cdc_join.join import state, subscription
from cdc_join.storage import FileStats, Storage, commits

#: Compact a state or subscription table once its loose files hold this share of its bytes ...
MAX_LOOSE_SHARE = 0.1
#: ... or once it has more than this many loose files.
MAX_LOOSE_FILES = 64
#: Compact any other table with more than this many small files.
MAX_SMALL_FILES = 16
#: Purge a table's deletion vectors once they hide this share of the rows its files store.
MAX_DELETED_SHARE = 0.2


@dataclass(frozen=True)
class TableHealth:
    """What the policy sees in one table's file statistics."""

    path: str
    files: int
    small_files: int
    overlap: float | None
    action: str | None
    loose_files: int | None = None
    loose_share: float | None = None
    deleted_share: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "files": self.files,
            "small_files": self.small_files,
            "overlap": None if self.overlap is None else round(self.overlap, 2),
            "loose_files": self.loose_files,
            "loose_share": None if self.loose_share is None else round(self.loose_share, 3),
            "deleted_share": round(self.deleted_share, 3),
            "action": self.action,
        }


def overlap(files: list[FileStats], column: str) -> float | None:
    """Average number of files whose ``column`` range holds each file's minimum (1.0 = disjoint).

    Files holding a single value (min = max) count only for themselves: with few distinct
    values (1,000 clerks for 1.5 M orders) one value fills several files however well the
    table is clustered, and those files are not what makes a lookup read more.
    """
    ranged = [
        f for f in files if f.min_values.get(column) is not None and f.max_values.get(column) is not None
    ]
    if not ranged:
        return None
    spans = [f for f in ranged if f.min_values[column] != f.max_values[column]]
    try:
        lows = sorted(f.min_values[column] for f in spans)
        highs = sorted(f.max_values[column] for f in spans)
        # Spanning files covering v: those starting at or before v, minus those ending before v.
        depth = [
            bisect.bisect_right(lows, f.min_values[column])
            - bisect.bisect_left(highs, f.min_values[column])
            + (1 if f.min_values[column] == f.max_values[column] else 0)
            for f in ranged
        ]
    except TypeError:
        return None
    return sum(depth) / len(depth)


def loose(files: list[FileStats], column: str) -> list[FileStats] | None:
    """The files outside the table's key order: all but the heaviest set (by bytes) of files
    whose ranges of ``column`` do not overlap (ends may touch), and every file without a range.
    ``None`` when the values do not compare.

    A compaction writes files in ``column`` order, which leaves no loose file; each run's
    append then adds files spanning the keys it changed, which are loose.
    """
    ranged = [
        f for f in files if f.min_values.get(column) is not None and f.max_values.get(column) is not None
    ]
    try:
        ranged.sort(key=lambda f: f.max_values[column])
        highs = [f.max_values[column] for f in ranged]
        # Weighted interval scheduling: best[i] is the heaviest disjoint set among the first i.
        best = [0] * (len(ranged) + 1)
        for i, f in enumerate(ranged, 1):
            before = bisect.bisect_right(highs, f.min_values[column], 0, i - 1)
            best[i] = max(best[i - 1], f.size_bytes + best[before])
    except TypeError:
        return None
    kept: set[int] = set()
    i = len(ranged)
    while i > 0:
        f = ranged[i - 1]
        before = bisect.bisect_right(highs, f.min_values[column], 0, i - 1)
        if f.size_bytes + best[before] >= best[i - 1]:
            kept.add(id(f))
            i = before
        else:
            i -= 1
    return [f for f in files if id(f) not in kept]


def inspect(storage: Storage, path: str, target_size: int, cluster_by: list[str] | None) -> TableHealth:
    """Apply the policy to one table: which action, if any, is due."""
    files = storage.files(path)
    small = sum(1 for f in files if f.size_bytes < target_size // 4)
    deleted = deleted_share(files)
    depth = overlap(files, cluster_by[0]) if cluster_by else None
    outside = loose(files, cluster_by[0]) if cluster_by else None
    if outside is None:  # no order to keep: deleted rows and small files decide
        action = "purge" if deleted >= MAX_DELETED_SHARE else "compact" if small > MAX_SMALL_FILES else None
        return TableHealth(path, len(files), small, depth, action, deleted_share=deleted)
    total = sum(f.size_bytes for f in files)
    share = sum(f.size_bytes for f in outside) / total if total else 0.0
    # A compaction rewrites the whole table in key order, deleted rows gone with the rest.
    due = share >= MAX_LOOSE_SHARE or len(outside) > MAX_LOOSE_FILES or deleted >= MAX_DELETED_SHARE
    action = "compact" if due else None
    return TableHealth(path, len(files), small, depth, action, len(outside), share, deleted)


def deleted_share(files: list[FileStats]) -> float:
    """The share of the rows stored in ``files`` that deletion vectors hide (0 without counts)."""
    counted = [f for f in files if f.num_records is not None]
    deleted = sum(f.deleted_rows for f in counted)
    stored = deleted + sum(f.num_records or 0 for f in counted)
    return deleted / stored if stored else 0.0


def pipeline_tables(config: PipelineConfig) -> list[tuple[str, str, list[str] | None]]:
    """``(path, kind, cluster columns)`` of every table the policy looks after."""
    tables: list[tuple[str, str, list[str] | None]] = [
        (config.subscription_path(j), "subscription", fk_columns(j)) for j in config.joins
    ]
    tables += [(config.state_path(s), "state", list(src.primary_key)) for s, src in config.sources.items()]
    tables.append((config.silver_path, "silver", None))
    # A bronze table another tool writes (``bronze:``) is that tool's to maintain.
    tables += [
        (config.bronze_path(s), "log", None) for s, src in config.sources.items() if src.bronze is None
    ]
    tables += [
        (path, "log", None)
        for path in (config.runs_path, config.ingest_log_path, config.quarantine_path, config.quality_path)
    ]
    return tables


def optimize_pipeline(
    storage: Storage, config: PipelineConfig, *, force: bool = False
) -> list[dict[str, Any]]:
    """Run the maintenance policy over the pipeline's tables; return what it saw and did.

    Args:
        storage: the storage seam.
        config: the pipeline.
        force: compact every table, whatever the policy says (e.g. after a large initial load).
    """
    checkpoint = last_checkpoint(storage, config)
    last_run = checkpoint.run_id
    done = []
    for path, kind, cluster_by in pipeline_tables(config):
        if not storage.exists(path):
            continue
        health = inspect(storage, path, target_file_size(kind), cluster_by)
        action = health.action or ("compact" if force else None)
        entry = health.as_dict()
        keyed = kind in ("state", "subscription")
        if action is not None and keyed and _unfinished(storage, path, checkpoint):
            entry["skipped"] = UNFINISHED
            action = None
        entry["action"] = action
        if action is not None:
            entry["rows_kept"] = _compact(storage, config, path, kind, last_run, purge=action == "purge")
            after = inspect(storage, path, target_file_size(kind), cluster_by)
            entry.update(
                files_after=after.files,
                overlap_after=None if after.overlap is None else round(after.overlap, 2),
                loose_share_after=None if after.loose_share is None else round(after.loose_share, 3),
                deleted_share_after=round(after.deleted_share, 3),
            )
        done.append(entry)
    return done


#: Why a table is left uncompacted: a run's rows are in it and it has not committed.
UNFINISHED = (
    "a run that did not commit (killed, beaten by another, or still going) wrote to it since the "
    "last completed run: the next run looks at those rows again; compact after it"
)


def _unfinished(storage: Storage, path: str, checkpoint: Checkpoint) -> bool:
    """Whether a run that did not commit wrote rows to the table: the next run finds them by the
    files they were appended in, which a compaction would rewrite (:mod:`cdc_join.storage.commits`)."""
    return commits.unfinished_since(storage, path, checkpoint.tables.get(path))


def _compact(
    storage: Storage, config: PipelineConfig, path: str, kind: str, last_run: int, *, purge: bool = False
) -> int | None:
    if kind == "state":
        name = next(n for n in config.sources if config.state_path(n) == path)
        horizon = config.tombstone_horizon_days
        before = None if horizon is None else int((time.time() - horizon * 86_400) * 1000)
        return state.compact(storage, path, config.sources[name].primary_key, last_run, before)
    if kind == "subscription":
        join = next(j for j in config.joins if config.subscription_path(j) == path)
        return subscription.compact(storage, path, join, config.hop_left(join), last_run)
    storage.optimize(path, target_size=target_file_size(kind), purge=purge)
    return None


def summary(results: list[Mapping[str, Any]]) -> str:
    """Lines a person reads after ``cdc-join optimize``."""
    lines = []
    for r in results:
        shown = f"{r['path']}: {r['files']} files ({r['small_files']} small)"
        if r.get("loose_share") is not None:
            shown += f", {r['loose_files']} outside key order ({r['loose_share']:.0%} of the bytes)"
        if r.get("deleted_share"):
            shown += f", {r['deleted_share']:.0%} of its stored rows deleted"
        if r.get("skipped"):
            shown += f" → not compacted: {r['skipped']}"
        elif r.get("action"):
            shown += f" → {r['action']}: {r.get('files_after')} files"
            if r.get("loose_share_after") is not None:
                shown += f", {r['loose_share_after']:.0%} outside key order"
            if r.get("deleted_share"):
                shown += f", {r.get('deleted_share_after') or 0:.0%} deleted"
        else:
            shown += " → nothing to do"
        lines.append(shown)
    return "\n".join(lines)
