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
from cdc_join.changeset import collect
from cdc_join.config import PipelineConfig
from cdc_join.ingest import ingest_all
from cdc_join.report import RunReport, SparkJobs
from cdc_join.runlog import Checkpoint, RunStart, commit_run, run_lock
from cdc_join.session import get_spark
from cdc_join.storage import Storage, get_storage

REFRESH = "refresh"


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
        if not repair or found.ok:
            return found
        self.full_refresh(ingest=False)
        again = verify.verify(self.storage, self.config, samples=samples, source=source)
        return dataclasses.replace(again, repaired=again.ok)

    def _run(self, kind: str, ingest: bool, crash_after: str | None, plan: str) -> RunReport:
        with run_lock(self.config):
            started = datetime.now(timezone.utc)
            begin = runlog.start(self.storage, self.config)
            report = RunReport(begin.checkpoint.run_id + 1, kind, crash_after, self.progress)
            report.jobs = SparkJobs(self.spark)
            if ingest:
                with report.step("ingest") as counts:
                    for name, r in ingest_all(self.spark, self.storage, self.config).items():
                        counts[name] = {"files": r.files, "events": r.events, "quarantined": r.quarantined}
            checkpoint = self._join(begin, report, plan)
            commit_run(
                self.storage, self.config, checkpoint, kind, started, report.to_dict(), begin.log_version
            )
            return report

    def _join(self, begin: RunStart, report: RunReport, plan: str) -> Checkpoint:
        cfg, store, previous, run_id = self.config, self.storage, begin.checkpoint, report.run_id
        ready = bronze.prepare(store, cfg, report)
        if ready is None:
            return dataclasses.replace(previous, run_id=run_id)
        versions = ready.bronze_versions
        first_run = cfg.left not in previous.state_versions
        if plan == REFRESH or (
            first_run and plan != "incremental" and cost.rebuild_first(store, cfg, versions)
        ):
            pinned, watermarks = self._rebuild_states(versions, report)
            reason = "full refresh" if plan == REFRESH else f"first run of {cost.RECOMPUTE_MIN_ROWS}+ rows"
            report.steps["plan"] = {"decision": "recompute", "reason": f"{reason}: state rebuilt from bronze"}
            self._recompute(pinned, report, begin)
            return Checkpoint(run_id, versions, pinned, watermarks)
        applied = {}
        for name in cfg.sources:
            with report.step(f"state:{name}") as counts:
                events = bronze.increment(store, cfg, name, previous, versions[name])
                prior = state.Previous(
                    previous.state_versions.get(name), previous.watermarks.get(name), previous.run_id
                )
                applied[name] = state.apply(
                    store, cfg.state_path(name), cfg.sources[name], events, prior, run_id
                )
                counts.update(applied[name].as_counts())
        pinned = {name: a.version for name, a in applied.items()}
        with report.step("plan") as counts:
            decision = cost.decide(store, cfg, applied, pinned, plan, first_run=first_run)
            counts.update(decision.as_report())
        if decision.recompute:
            self._recompute(pinned, report, begin)
        else:
            self._incremental(applied, pinned, report, begin)
        return Checkpoint(
            run_id, versions, pinned, {n: a.watermark for n, a in applied.items() if a.watermark}
        )

    def _rebuild_states(
        self, versions: Mapping[str, int], report: RunReport
    ) -> tuple[dict[str, int], dict[str, str]]:
        """Every state table rebuilt from its bronze snapshot; the pinned versions and watermarks."""
        cfg, store = self.config, self.storage
        pinned, watermarks = {}, {}
        for name in cfg.sources:
            with report.step(f"state:{name}") as counts:
                events = store.read(cfg.bronze_path(name), versions[name])
                rows, watermark = state.rebuild(
                    store, cfg.state_path(name), cfg.sources[name], events, report.run_id
                )
                pinned[name] = store.version(cfg.state_path(name))
                counts.update(rebuilt=rows)
                if watermark:
                    watermarks[name] = watermark
        return pinned, watermarks

    def _incremental(
        self, applied: Mapping[str, state.Applied], pinned: dict[str, int], report: RunReport, begin: RunStart
    ) -> None:
        """The KIP-213 path: instructions and lookups for the changed keys only."""
        cfg, store, run_id = self.config, self.storage, report.run_id
        left_changes = applied[cfg.left].changes
        responses = {}
        for join in cfg.joins:
            with report.step(f"subscription:{join.alias}") as counts:
                messages, subscribed = subscription.subscribe(store, cfg, join, left_changes, run_id)
                counts.update(subscribed)
            with report.step(f"lookup:{join.alias}") as counts:
                right = lookup.changed_right_keys(applied[join.right].changes, cfg.sources[join.right], join)
                version = store.version(cfg.subscription_path(join))
                found, scans = lookup.responses(store, cfg, join, messages, right, pinned, version)
                responses[join.alias] = found
                counts.update(scans)
        with report.step("resolve") as counts:
            resolved = resolve.resolve(store, cfg, responses, pinned, run_id)
            counts.update(stale_dropped=resolved.stale_dropped, affected_keys=resolved.affected_keys)
        with report.step("silver") as counts:
            if resolved.rows is None:
                counts.update(silver.NOTHING)
            else:
                expected = silver.prepare(store, cfg, resolved.rows, begin.silver_version)
                counts.update(silver.merge(store, cfg, resolved.rows, expected_version=expected).as_counts())
        with report.step("cleanup") as counts:
            counts["stale_subscriptions_removed"] = sum(
                subscription.unsubscribe(
                    store, cfg.subscription_path(j), resolved.orphans[j.alias], cfg.left_source, j, run_id
                )
                for j in cfg.joins
                if j.alias in resolved.orphans
            )

    def _recompute(self, pinned: dict[str, int], report: RunReport, begin: RunStart) -> None:
        """The whole join from the pinned state: subscriptions rebuilt, silver's differences MERGEd."""
        cfg, store, run_id = self.config, self.storage, report.run_id
        left_path = cfg.state_path(cfg.left)
        left_rows = state.read_current(store, left_path, cfg.left_source.primary_key, pinned[cfg.left])
        for join in cfg.joins:
            with report.step(f"subscription:{join.alias}") as counts:
                path = cfg.subscription_path(join)
                subscription.prepare(store, path, cfg.left_source, join, store.schema(left_path))
                counts["rebuilt"] = subscription.rebuild(
                    store, path, left_rows, cfg.left_source, join, run_id
                )
            report.steps[f"lookup:{join.alias}"] = {
                "skipped": "recompute: right rows are joined on the current fk"
            }
        with report.step("resolve") as counts:
            rows = resolve.recompute(store, cfg, pinned, run_id)
            counts["affected_keys"] = "all"
        with report.step("silver") as counts:
            expected = silver.prepare(store, cfg, rows, begin.silver_version)
            changes = silver.differences(store, cfg, rows)
            if collect(changes).num_rows:
                counts.update(silver.merge(store, cfg, changes, expected_version=expected).as_counts())
            else:
                counts.update(silver.NOTHING)
        report.steps["cleanup"] = {"stale_subscriptions_removed": "none left: subscriptions were rebuilt"}
