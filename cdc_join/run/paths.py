"""What each path of a run (:mod:`cdc_join.run.plan`) does once the state is applied.

- :func:`incremental`: KIP-213. Instructions for the changed left keys, the stale check on the
  subscribers of changed right keys, silver rows for the affected keys only, then the
  subscription appends and the removal of leftover subscriptions.
- :func:`recompute_affected`: the same rows, found by joining whole state tables in Spark
  instead of looking subscriptions up (the cost rule's choice for large batches).
- :func:`recompute`: the whole join, silver's differences MERGEd (or its rows replaced).

Each writes silver before the subscriptions: a run stopped between the two leaves
subscriptions of the last completed run, which the stale check makes harmless, and its rerun
writes them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pyspark.sql import DataFrame

from cdc_join.changeset import ChangeSet, materialize
from cdc_join.config import PipelineConfig
from cdc_join.join import apply, increment, lookup, resolve, state, subscription
from cdc_join.report import RunReport
from cdc_join.silver import table as silver
from cdc_join.storage import Storage

_SCANNED = "recompute: the left rows naming changed right keys are found by a scan of the left state"
_JOINED = "recompute: right rows are joined on the current fk"
_UNCHECKED = {"stale_subscriptions_removed": "not checked in a recompute"}


@dataclass(frozen=True)
class Run:
    """What every path writes with: the run's storage, config, report, and silver's version at
    the run's start."""

    store: Storage
    config: PipelineConfig
    report: RunReport
    silver_version: int | None

    @property
    def run_id(self) -> int:
        return self.report.run_id


def lookups(run: Run, changes: Mapping[str, increment.SourceChanges]) -> dict[str, ChangeSet]:
    """Per join, the subscribers of its changed right keys (the prefix-range lookup)."""
    with run.report.step("lookup") as counts:
        return lookup.all_subscribers(run.store, run.config, changes, counts)


def incremental(
    run: Run,
    changed: Mapping[str, ChangeSet],
    current: Mapping[str, ChangeSet],
    subscribers: Mapping[str, ChangeSet],
    pinned: Mapping[str, int],
) -> None:
    """The KIP-213 path: instructions, responses and rows for the changed keys only.
    ``changed`` and ``current``: per source on the left side of a hop, as
    :func:`cdc_join.join.resolve.incremental` takes them."""
    store, cfg, report = run.store, run.config, run.report
    with report.step("resolve") as counts:
        resolved = resolve.incremental(store, cfg, changed, current, subscribers, pinned, run.run_id)
        counts.update(stale_dropped=resolved.stale_dropped, affected_keys=resolved.affected_keys)
    _merge_silver(run, resolved.rows)
    subscription.write_all(store, cfg, resolved.instructions, run.run_id, report.step)
    with report.step("cleanup") as counts:
        counts["stale_subscriptions_removed"] = subscription.remove_orphans(
            store, cfg, resolved.orphans, run.run_id
        )


def recompute_affected(run: Run, applied: Mapping[str, apply.Applied], pinned: Mapping[str, int]) -> None:
    """The cost rule's recompute: the rows of the keys the changes affect, found and built by
    joining whole state tables in Spark; the subscriptions get the changed left keys'
    instructions, as in an incremental run."""
    store, cfg, report = run.store, run.config, run.report
    changed = {name: a.changes for name, a in applied.items()}
    report.steps.update({f"lookup:{j.alias}": {"skipped": _SCANNED} for j in cfg.joins})
    found = resolve.recompute_affected(store, cfg, changed, pinned, run.run_id)
    if found is not None and silver.reshapes(store, cfg, found):
        # A column silver cannot take as it is: the whole join replaces silver's rows.
        recompute(run, pinned, changed)
        return
    with report.step("resolve") as counts:
        rows = None if found is None else materialize(found)
        counts["affected_keys"] = 0 if rows is None else rows.rows
    _merge_silver(run, rows if rows is not None and rows.rows else None)
    instructions = subscription.instructions_all(changed, cfg)
    subscription.write_all(store, cfg, instructions, run.run_id, report.step)
    report.steps["cleanup"] = dict(_UNCHECKED)


def recompute(
    run: Run,
    pinned: Mapping[str, int],
    changed: Mapping[str, ChangeSet] | None = None,
    replace: str | None = None,
) -> None:
    """The whole join from the pinned state, silver's differences MERGEd (with ``replace``, the
    reason, silver's rows replaced). Subscriptions are rebuilt from the state of each hop's
    left side when ``changed`` is ``None``, else they get the changed keys' instructions."""
    store, cfg, report = run.store, run.config, run.report
    if changed is None:

        def rows_of(name: str) -> DataFrame:
            return state.read_current(
                store, cfg.state_path(name), cfg.sources[name].primary_key, pinned[name]
            )

        subscription.rebuild_all(store, cfg, rows_of, run.run_id, report.step)
    report.steps.update({f"lookup:{j.alias}": {"skipped": _JOINED} for j in cfg.joins})
    with report.step("resolve") as counts:
        rows = resolve.recompute(store, cfg, pinned, run.run_id)
        counts["affected_keys"] = "all"
    with report.step("silver") as counts:
        counts.update(silver.write_all(store, cfg, rows, run.silver_version, replace=replace))
    if changed is not None:
        instructions = subscription.instructions_all(changed, cfg)
        subscription.write_all(store, cfg, instructions, run.run_id, report.step)
    report.steps["cleanup"] = dict(_UNCHECKED)


def _merge_silver(run: Run, rows: ChangeSet | None) -> None:
    """MERGE the affected keys' rows into silver (created or widened first)."""
    with run.report.step("silver") as counts:
        if rows is None:
            counts.update(silver.NOTHING)
            return
        expected = silver.prepare(run.store, run.config, rows, run.silver_version)
        counts.update(silver.merge(run.store, run.config, rows, expected_version=expected).as_counts())
