"""Table maintenance: file sizes, and the policy behind ``cdc-join optimize``.

Every MERGE rewrites the files holding the keys it touches and writes its inserts to new
files. Over many runs two things decay:

- **clustering.** Right-driven lookups read only the subscription files whose fk range can
  hold a changed right key, and keyed reads of a state table only the files whose key range
  can hold a wanted key. Inserts land in new files spanning the whole range, and rewritten
  files mix the ranges they came from, so lookups read more and more files. Z-ordering by the
  fk (subscriptions) or the primary key (state) restores narrow, disjoint ranges.
- **file count.** Small files pile up (one or more per run and table), and every read pays a
  per-file cost. Compaction merges them.

The policy, per table, from its file statistics alone (no data is read to decide):

- a subscription table is Z-ordered by its fk columns, and a state table by its primary key,
  when its *overlap* — how many files' ranges of that column cover a value, on average over
  the files' own minimums — exceeds :data:`MAX_OVERLAP`, or when it has more than
  :data:`MAX_SMALL_FILES` small files (smaller than a quarter of its target file size);
- silver is compacted when it has more than :data:`MAX_SMALL_FILES` small files.

Target file sizes are table properties (``delta.targetFileSize``) set when the pipeline
creates a table (see :func:`table_properties`), so MERGE, compaction and Z-order all write
files of that size. Subscription files are small on purpose: a lookup of a few fk values reads
one small file per value, and there are enough files that a batch touching a hundred right
keys reads a small share of them.

Optimizing only rearranges files (no data change), so it is safe next to runs: the run reads
pinned versions, and Delta's optimistic concurrency makes a conflicting writer retry. It never
vacuums, so pinned versions of running jobs stay readable.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cdc_join.config import PipelineConfig
from cdc_join.storage import FileStats, Storage

TARGET_FILE_SIZE_PROPERTY = "delta.targetFileSize"
#: Subscription tables: small files, so fk lookups read little.
SUBSCRIPTION_TARGET_FILE_SIZE = 16 * 1024
#: State and silver tables: MERGEs rewrite whole files, so smaller than Delta's 100+ MB
#: default; large enough that the file count of a big table stays in the hundreds.
TABLE_TARGET_FILE_SIZE = 8 * 1024 * 1024
#: Z-order a subscription table when fk ranges overlap more than this on average.
MAX_OVERLAP = 4.0
#: Compact a table with more than this many small files.
MAX_SMALL_FILES = 16


def table_properties(kind: str) -> dict[str, str]:
    """Properties for a new internal table of ``kind`` (``subscription``, ``state`` or ``silver``)."""
    size = SUBSCRIPTION_TARGET_FILE_SIZE if kind == "subscription" else TABLE_TARGET_FILE_SIZE
    return {TARGET_FILE_SIZE_PROPERTY: str(size)}


@dataclass(frozen=True)
class TableHealth:
    """What the policy sees in one table's file statistics."""

    path: str
    files: int
    small_files: int
    overlap: float | None
    action: str | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "files": self.files,
            "small_files": self.small_files,
            "overlap": None if self.overlap is None else round(self.overlap, 2),
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


def inspect(storage: Storage, path: str, target_size: int, cluster_by: list[str] | None) -> TableHealth:
    """Apply the policy to one table: which action, if any, is due."""
    files = storage.files(path)
    small = sum(1 for f in files if f.size_bytes < target_size // 4)
    depth = overlap(files, cluster_by[0]) if cluster_by else None
    action = None
    if cluster_by and ((depth is not None and depth > MAX_OVERLAP) or small > MAX_SMALL_FILES):
        action = "zorder"
    elif not cluster_by and small > MAX_SMALL_FILES:
        action = "compact"
    return TableHealth(path, len(files), small, depth, action)


def _target_size(kind: str) -> int:
    return int(table_properties(kind)[TARGET_FILE_SIZE_PROPERTY])


def pipeline_tables(config: PipelineConfig) -> list[tuple[str, str, list[str] | None]]:
    """``(path, kind, cluster columns)`` of every table the policy looks after."""
    from cdc_join.subscription import fk_columns  # subscription → state → this module

    tables: list[tuple[str, str, list[str] | None]] = [
        (config.subscription_path(j), "subscription", fk_columns(j)) for j in config.joins
    ]
    tables += [(config.state_path(s), "state", list(src.primary_key)) for s, src in config.sources.items()]
    tables.append((config.silver_path, "silver", None))
    return tables


def optimize_pipeline(
    storage: Storage, config: PipelineConfig, *, force: bool = False
) -> list[dict[str, Any]]:
    """Run the maintenance policy over the pipeline's tables; return what it saw and did.

    Args:
        storage: the storage seam.
        config: the pipeline.
        force: Z-order every subscription and state table and compact silver, whatever the
            policy says (e.g. right after a large initial load).
    """
    done = []
    for path, kind, cluster_by in pipeline_tables(config):
        if not storage.exists(path):
            continue
        size = _target_size(kind)
        health = inspect(storage, path, size, cluster_by)
        action = health.action or (("zorder" if cluster_by else "compact") if force else None)
        entry = health.as_dict()
        entry["action"] = action
        if action is not None:
            metrics = storage.optimize(
                path, zorder_by=cluster_by if action == "zorder" else None, target_size=size
            )
            after = inspect(storage, path, size, cluster_by)
            entry.update(
                files_after=after.files,
                overlap_after=None if after.overlap is None else round(after.overlap, 2),
                files_added=metrics.files_added,
                files_removed=metrics.files_removed,
            )
        done.append(entry)
    return done


def summary(results: list[Mapping[str, Any]]) -> str:
    """Lines a person reads after ``cdc-join optimize``."""
    lines = []
    for r in results:
        shown = f"{r['path']}: {r['files']} files ({r['small_files']} small)"
        if r.get("overlap") is not None:
            shown += f", fk overlap {r['overlap']}"
        if r.get("action"):
            shown += f" → {r['action']}: {r.get('files_after')} files"
            if r.get("overlap_after") is not None:
                shown += f", fk overlap {r['overlap_after']}"
        else:
            shown += " → nothing to do"
        lines.append(shown)
    return "\n".join(lines)
