"""The state step of a run: every source's changes applied to its state table in one Spark job.

Per source with changes, :func:`frames` computes what applying them writes: a hop's left side
(the left source, a chain's middle sources) and a source a new truncate hits get their old and
new images (:mod:`cdc_join.join.images`), any other source the newest row per key of its
increment. One Spark job materializes them all; each source's rows are then appended (one
commit per source) and :class:`Applied` says what changed, which the later hops read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame

from cdc_join.changeset import (
    ChangeSet,
    empty,
    from_arrow,
    materialize_all,
    rows_of_struct,
)
from cdc_join.columns import (
    OP,
    pk_columns,
)
from cdc_join.config import PipelineConfig, SourceConfig
from cdc_join.join.images import NEW, appended, changed, changes_schema, images
from cdc_join.join.increment import Previous, SourceChanges
from cdc_join.report import Step
from cdc_join.storage import Storage

if TYPE_CHECKING:
    from cdc_join.checkpoint import Checkpoint


def append(storage: Storage, path: str, rows: pa.Table) -> int:
    """Append state rows (already on the driver); returns the table's version afterwards."""
    if not rows.num_rows:
        return storage.version(path)
    return storage.append(path, from_arrow(storage.spark, storage.schema(path), rows)).version


@dataclass(frozen=True)
class Applied:
    """What a run applied to one state table. ``changes`` holds one row per key whose current
    row changed (for a source on the left side of a hop, with its ``_old`` and ``_new`` rows)."""

    changes: ChangeSet
    events: int
    appended: int
    truncated: int
    watermark: str | None
    version: int
    truncate_applied: bool = False
    unfinished: int = 0

    def as_counts(self) -> dict[str, int]:
        """The run report's counts for this source."""
        return {
            "events": self.events,
            "keys_changed": self.changes.rows,
            "appended": self.appended,
            "truncated": self.truncated,
            "truncate_applied": int(self.truncate_applied),
            "unfinished_keys": self.unfinished,
        }


def apply_all(
    storage: Storage,
    config: PipelineConfig,
    changes: Mapping[str, SourceChanges],
    subscribers: Mapping[str, ChangeSet],
    previous: Checkpoint,
    run_id: int,
    step: Step,
) -> tuple[dict[str, Applied], dict[str, ChangeSet]]:
    """Apply every source's changes (one Spark job for all, then one append per source).

    Returns what was applied per source, and per source on the left side of a hop
    (:attr:`~cdc_join.config.PipelineConfig.hop_sources`) the current rows of every key of it
    the run may affect: its changed keys and the subscribers of its hops' changed right keys.
    """
    with step("state"):
        before = {name: Previous.of(previous, name) for name in config.sources}
        planned = frames(storage, config, changes, subscribers, before, run_id)
        done = dict(zip(planned, materialize_all(list(planned.values())), strict=True)) if planned else {}
    out = {}
    for name in config.sources:
        with step(f"state:{name}") as counts:
            out[name] = applied(
                storage, config.state_path(name), config.sources[name], changes[name], done.get(name)
            )
            counts.update(out[name].as_counts())
    held = {name: current(storage, config.state_path(name), done.get(name)) for name in config.hop_sources}
    return out, held


def frames(
    storage: Storage,
    config: PipelineConfig,
    changes: Mapping[str, SourceChanges],
    subscribers: Mapping[str, ChangeSet],
    previous: Mapping[str, Previous],
    run_id: int,
) -> dict[str, DataFrame]:
    """Per source with changes, the frame that applying them writes, to run all in one job.

    A source on the left side of a hop (the left source, a chain's middle sources) and a source
    a new truncate hits get :func:`images`; a hop's images are also read for the keys of the
    subscribers of its changed right keys, so one read of the table gives both the old rows of
    changed keys (their subscriptions move) and the current rows of affected ones (the stale
    check). Any other source gets the increment's newest row per key: appending it is enough,
    since readers keep the newest row of a key (an older row appended changes nothing).
    """
    out = {}
    for name, planned in changes.items():
        source, path = config.sources[name], config.state_path(name)
        key = list(source.primary_key)
        if name in config.hop_sources:
            pks = dict(zip(pk_columns(source), key, strict=True))
            extra = [
                found.distinct(list(pks)).renamed(pks)
                for alias, found in subscribers.items()
                if config.hop_left(config.join_for_alias(alias)).name == name
            ]
            keys = ChangeSet.concat([planned.keys, *extra], key) if extra else planned.keys
            if keys.rows:
                out[name] = images(storage, path, source, keys, planned, previous[name], run_id)
        elif planned.truncating:
            out[name] = images(storage, path, source, planned.keys, planned, previous[name], run_id)
        elif planned.keys.rows:
            out[name] = planned.rows
    return out


def applied(
    storage: Storage, path: str, source: SourceConfig, planned: SourceChanges, done: ChangeSet | None
) -> Applied:
    """Append what :func:`frames` computed for one source; what was applied."""
    schema = storage.schema(path)
    if done is None:
        nothing = empty(storage.spark, changes_schema(schema, source.primary_key))
        return Applied(
            nothing,
            planned.events,
            0,
            0,
            planned.watermark,
            storage.version(path),
            planned.truncating,
            planned.unfinished,
        )
    if NEW in done.schema.names:  # images: write the rows that changed, report the keys that did
        rows, keys = appended(done), changed(done)
    else:
        rows, keys = done.table, planned.keys
    version = append(storage, path, rows)
    truncated = (
        int(pc.sum(pc.cast(pc.equal(rows.column(OP), "t"), pa.int64())).as_py() or 0) if rows.num_rows else 0
    )
    return Applied(
        keys,
        planned.events,
        rows.num_rows,
        truncated,
        planned.watermark,
        version,
        planned.truncating,
        planned.unfinished,
    )


def current(storage: Storage, path: str, done: ChangeSet | None) -> ChangeSet:
    """The current rows (``_new``) of materialized images: every key of the source the run may
    affect."""
    schema = storage.schema(path)
    if done is None:
        return empty(storage.spark, schema)
    table = done.table.filter(pc.is_valid(done.table.column(NEW)))
    return from_arrow(storage.spark, schema, rows_of_struct(table, NEW, schema=schema))
