"""The one place that wires a run together (DESIGN.md §1):

ingest → apply (state) → plan → per join: subscribe, look up → resolve → silver → cleanup → commit.

Crash safety, write by write: bronze and quarantine writes are insert-only MERGEs keyed by file
and line; state and subscription tables only ever get rows appended, derived from the last
checkpoint, so a rerun appends at most copies of rows already there; a full refresh replaces a
whole table in one commit; silver MERGEs write rows computed from pinned state versions and
update only what differs; and the run-log row that moves the checkpoint is committed last.
Killing a run anywhere and rerunning converges to the silver an uninterrupted run would leave.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from datetime import datetime, timezone

from pyspark.sql import SparkSession

from cdc_join import bronze, cost, lookup, resolve, runlog, silver, state, subscription, verify
from cdc_join.changeset import ChangeSet, materialize
from cdc_join.config import PipelineConfig
from cdc_join.errors import ConfigError
from cdc_join.fence import Fenced
from cdc_join.ingest import ingest_all
from cdc_join.report import RunReport, SparkJobs
from cdc_join.runlog import Checkpoint, RunStart, commit_run, run_lock
from cdc_join.session import get_spark
from cdc_join.storage import Storage, get_storage
from cdc_join.storage.base import is_table_name

REFRESH = "refresh"


def _check_addressing(config: PipelineConfig, storage: Storage) -> None:
    """Tables by name need the delta-spark backend: on delta-rs that is a mistake in the
    config (exit 2), said before anything is read, not a storage failure in the first write."""
    if getattr(storage, "name", None) != "delta-rs":
        return
    hint = "give 'lake:' (or --lake DIR) to address the tables by path, or use the delta-spark backend"
    if config.tables:
        raise ConfigError(
            f"{config.tables!r} addresses tables by name, which the delta-rs backend cannot; {hint}",
            key="tables",
            path=config.config_path,
        )
    for name, source in config.sources.items():
        if source.bronze is not None and is_table_name(source.bronze):
            raise ConfigError(
                f"{source.bronze!r} names a table, which the delta-rs backend cannot address; {hint}",
                key=f"sources.{name}.bronze",
                path=config.config_path,
            )


class Pipeline:
    """Runs one configured pipeline.

    Args:
        config: the validated pipeline.
        spark: a session (default: :func:`cdc_join.session.get_spark`).
        storage: a storage backend (default: chosen by :func:`cdc_join.storage.get_storage`).
        progress: called with a line per step (e.g. ``print``).
    """

    def __init__(
        self,
        config: PipelineConfig,
        spark: SparkSession | None = None,
        storage: Storage | None = None,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self.spark = spark or get_spark()
        self.storage = storage or get_storage(self.spark)
        self.progress = progress
        _check_addressing(config, self.storage)

    def run(self, *, ingest: bool = True, crash_after: str | None = None, plan: str = "auto") -> RunReport:
        """Ingest new landing files, then one join run; ``plan`` as in :mod:`cdc_join.cost`."""
        if plan not in cost.PLANS:
            raise ValueError(f"plan must be one of {', '.join(cost.PLANS)}, not {plan!r}")
        return self._run("incremental", ingest, crash_after, plan)

    def full_refresh(self, *, ingest: bool = True, crash_after: str | None = None) -> RunReport:
        """Rebuild state and subscriptions from bronze, then silver (only its differences)."""
        return self._run("full_refresh", ingest, crash_after, REFRESH)

    def verify(
        self, *, repair: bool = False, samples: int = 5, source: str = "bronze"
    ) -> verify.VerifyReport:
        """Compare silver with a recompute from bronze; with ``repair``, full-refresh and recheck."""
        found = verify.verify(self.storage, self.config, samples=samples, source=source)
        if not repair or found.ok or found.unfinished:  # a stopped run is finished by a run
            return found
        self.full_refresh(ingest=False)
        again = verify.verify(self.storage, self.config, samples=samples, source=source)
        return dataclasses.replace(again, repaired=again.ok)

    def _run(self, kind: str, ingest: bool, crash_after: str | None, plan: str) -> RunReport:
        with run_lock(self.config):
            started = datetime.now(timezone.utc)
            begin = runlog.start(self.storage, self.config)
            # Every write on state, subscriptions and silver names the version this run read.
            store = Fenced(self.storage, begin.tables)
            report = RunReport(begin.checkpoint.run_id + 1, kind, crash_after, self.progress)
            report.jobs = SparkJobs(self.spark)
            if ingest:
                with report.step("ingest") as counts:
                    for name, r in ingest_all(
                        self.spark, self.storage, self.config, progress=self.progress
                    ).items():
                        counts[name] = {"files": r.files, "events": r.events, "quarantined": r.quarantined}
                        if r.reasons:
                            counts[name]["reasons"] = dict(r.reasons)
                        if r.unavailable:
                            counts[name]["unavailable_values"] = dict(r.unavailable)
                        if r.unread:
                            counts[name]["unread_files"] = len(r.unread)
                        report.warnings += r.warnings()
            checkpoint = self._join(store, begin, report, plan)
            with report.step("commit"):
                commit_run(
                    self.storage, self.config, checkpoint, kind, started, report.to_dict(), begin.log_version
                )
            return report

    def _join(self, store: Fenced, begin: RunStart, report: RunReport, plan: str) -> Checkpoint:
        cfg, previous, run_id = self.config, begin.checkpoint, report.run_id
        ready = bronze.prepare(store, cfg, report)
        if ready is None:
            return dataclasses.replace(previous, run_id=run_id)
        versions = ready.bronze_versions
        resolve.select_schema(store, cfg)  # a bad select fails here, before any state or silver write
        types = silver.source_types(store, cfg)
        first_run = cfg.left not in previous.state_versions
        # A full refresh stopped after it rebuilt a state table: its rerun finishes it, whatever
        # this run was asked for (a rebuilt left state re-hashed every left row, so the
        # subscriptions it did not get to rebuild would make every response stale).
        resumed = not first_run and any(
            state.rebuilt_since(store, cfg.state_path(name), previous.state_versions[name], previous.run_id)
            for name in cfg.sources
            if name in previous.state_versions
        )
        # A new left source or primary key: state rows and silver's rows are keyed otherwise.
        restated = silver.restated(previous.silver, cfg)
        if (
            plan == REFRESH
            or resumed
            or restated
            or (first_run and plan != "incremental" and cost.rebuild_first(store, cfg, versions))
        ):
            pinned, watermarks = state.rebuild_all(store, cfg, versions, run_id, report.step)
            reason = (
                "full refresh"
                if plan == REFRESH
                else "full refresh resumed (the last one stopped before it committed)"
                if resumed
                else restated or f"first run of {cost.RECOMPUTE_MIN_ROWS}+ rows"
            )
            report.steps["plan"] = {"decision": "recompute", "reason": f"{reason}: state rebuilt from bronze"}
            self._recompute(store, pinned, report, begin, replace=restated)
            return Checkpoint(
                run_id, versions, pinned, watermarks, silver.definition(cfg, types), store.tables()
            )
        with report.step("plan") as counts:
            changes = {
                name: state.plan(
                    store,
                    cfg.state_path(name),
                    cfg.sources[name],
                    bronze.increment(store, cfg, name, previous, versions[name]),
                    state.Previous.of(previous, name),
                    run_id,
                )
                for name in cfg.sources
            }
            decision = cost.decide(store, cfg, {n: c.keys.rows for n, c in changes.items()}, plan, first_run)
            redefined = silver.redefined(previous.silver, cfg, types)
            if redefined and not first_run:
                decision = dataclasses.replace(decision, recompute=True, reason=f"{redefined}: every row")
            counts.update(decision.as_report())
        subscribers = {}
        if not decision.recompute:
            with report.step("lookup") as counts:
                subscribers = lookup.all_subscribers(store, cfg, changes, counts)
        applied, left_current = state.apply_all(
            store, cfg, changes, subscribers, previous, run_id, report.step
        )
        pinned = {name: a.version for name, a in applied.items()}
        if decision.recompute and (first_run or redefined):
            # New or changed joins have no subscriptions for the rows that did not change:
            # rebuild them all from the current left rows, as a full refresh does.
            rebuild = not first_run and silver.joins_redefined(previous.silver, cfg)
            self._recompute(store, pinned, report, begin, None if rebuild else applied[cfg.left].changes)
        elif decision.recompute:
            self._recompute_affected(store, applied, pinned, report, begin)
        else:
            changed = applied[cfg.left].changes
            self._incremental(store, changed, left_current, subscribers, pinned, report, begin)
        watermarks = {n: a.watermark for n, a in applied.items() if a.watermark}
        return Checkpoint(run_id, versions, pinned, watermarks, silver.definition(cfg, types), store.tables())

    def _incremental(
        self,
        store: Fenced,
        left_changed: ChangeSet,
        left_current: ChangeSet,
        subscribers: Mapping[str, ChangeSet],
        pinned: dict[str, int],
        report: RunReport,
        begin: RunStart,
    ) -> None:
        """The KIP-213 path: instructions, responses and rows for the changed keys only."""
        cfg, run_id = self.config, report.run_id
        with report.step("resolve") as counts:
            resolved = resolve.incremental(
                store, cfg, left_changed, left_current, subscribers, pinned, run_id
            )
            counts.update(stale_dropped=resolved.stale_dropped, affected_keys=resolved.affected_keys)
        with report.step("silver") as counts:
            if resolved.rows is not None:
                expected = silver.prepare(store, cfg, resolved.rows, begin.silver_version)
                merged = silver.merge(store, cfg, resolved.rows, expected_version=expected)
                counts.update(merged.as_counts())
            else:
                counts.update(silver.NOTHING)
        subscription.write_all(store, cfg, resolved.instructions, run_id, report.step)
        with report.step("cleanup") as counts:
            removed = subscription.remove_orphans(store, cfg, resolved.orphans, run_id)
            counts["stale_subscriptions_removed"] = removed

    def _recompute_affected(
        self,
        store: Fenced,
        applied: Mapping[str, state.Applied],
        pinned: dict[str, int],
        report: RunReport,
        begin: RunStart,
    ) -> None:
        """The cost rule's recompute: the rows of the keys the changes affect, found and built
        by joining whole state tables in Spark instead of looking up subscriptions; the
        subscriptions get the changed left keys' instructions, as in an incremental run."""
        cfg, run_id = self.config, report.run_id
        left_changed = applied[cfg.left].changes
        scanned = "recompute: the left rows naming changed right keys are found by a scan of the left state"
        for join in cfg.joins:
            report.steps[f"lookup:{join.alias}"] = {"skipped": scanned}
        right_changed = {j.alias: applied[j.right].changes for j in cfg.joins}
        found = resolve.recompute_affected(store, cfg, left_changed, right_changed, pinned, run_id)
        if found is not None and silver.reshapes(store, cfg, found):
            # A column silver cannot take as it is: the whole join replaces silver's rows.
            self._recompute(store, pinned, report, begin, left_changed)
            return
        with report.step("resolve") as counts:
            rows = None if found is None else materialize(found)
            counts["affected_keys"] = 0 if rows is None else rows.rows
        with report.step("silver") as counts:
            if rows is not None and rows.rows:
                expected = silver.prepare(store, cfg, rows, begin.silver_version)
                counts.update(silver.merge(store, cfg, rows, expected_version=expected).as_counts())
            else:
                counts.update(silver.NOTHING)
        changed = subscription.instructions_all(left_changed, cfg)
        subscription.write_all(store, cfg, changed, run_id, report.step)
        report.steps["cleanup"] = {"stale_subscriptions_removed": "not checked in a recompute"}

    def _recompute(
        self,
        store: Fenced,
        pinned: dict[str, int],
        report: RunReport,
        begin: RunStart,
        left_changed: ChangeSet | None = None,
        replace: str | None = None,
    ) -> None:
        """The whole join from the pinned state, silver's differences MERGEd (with ``replace``,
        the reason, silver's rows replaced). Subscriptions are rebuilt when the state was
        (``left_changed`` is ``None``), else they get the changed left keys' instructions, as in
        an incremental run."""
        cfg, run_id = self.config, report.run_id
        if left_changed is None:
            left_rows = state.read_current(
                store, cfg.state_path(cfg.left), cfg.left_source.primary_key, pinned[cfg.left]
            )
            subscription.rebuild_all(store, cfg, left_rows, run_id, report.step)
        for join in cfg.joins:
            report.steps[f"lookup:{join.alias}"] = {
                "skipped": "recompute: right rows are joined on the current fk"
            }
        with report.step("resolve") as counts:
            rows = resolve.recompute(store, cfg, pinned, run_id)
            counts["affected_keys"] = "all"
        with report.step("silver") as counts:
            counts.update(silver.write_all(store, cfg, rows, begin.silver_version, replace=replace))
        if left_changed is not None:
            changed = subscription.instructions_all(left_changed, cfg)
            subscription.write_all(store, cfg, changed, run_id, report.step)
        report.steps["cleanup"] = {"stale_subscriptions_removed": "not checked in a recompute"}
