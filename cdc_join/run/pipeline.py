"""The one place that wires a run together:

ingest → plan (:mod:`cdc_join.run.plan` picks the path) → apply the state → the path
(:mod:`cdc_join.run.paths`: look up, resolve, silver, subscriptions, cleanup) → commit.

Every write of a run on state, subscriptions and silver names the version the run started from
(:mod:`cdc_join.run.fence`), and the run-log row that moves the checkpoint is committed last, so a
run killed anywhere, or one that lost a race, leaves work its rerun finishes: rerunning
converges to the silver an uninterrupted run would leave.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import cast

from pyspark.sql import SparkSession

from cdc_join.checkpoint import Checkpoint, settings
from cdc_join.checks import verify
from cdc_join.config import PipelineConfig, check_addressing
from cdc_join.join import apply, increment, rebuild, resolve
from cdc_join.landing import bronze
from cdc_join.landing.ingest import ingest_all, landed_bytes
from cdc_join.report import RunReport, SparkJobs
from cdc_join.run import cost, idle, runlog
from cdc_join.run import paths as run_paths
from cdc_join.run.fence import Fenced
from cdc_join.run.plan import REFRESH, RunPath, choose
from cdc_join.run.runlog import RunStart, commit_run, run_lock
from cdc_join.session import DeferredSession, get_spark
from cdc_join.silver import table as silver
from cdc_join.storage import Storage, commits, get_storage


class Pipeline:
    """Runs one configured pipeline.

    Args:
        config: the validated pipeline.
        spark: a session, or one started when first needed (default: :func:`cdc_join.session.get_spark`).
        storage: a storage backend (default: chosen by :func:`cdc_join.storage.get_storage`).
        progress: called with a line per step (e.g. ``print``).
    """

    def __init__(
        self,
        config: PipelineConfig,
        spark: SparkSession | DeferredSession | None = None,
        storage: Storage | None = None,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        # A DeferredSession stands in for the session it starts.
        self.spark = cast(SparkSession, spark) if spark is not None else get_spark()
        self.storage = storage or get_storage(self.spark)
        self.progress = progress
        check_addressing(config, self.storage.name)

    def run(self, *, ingest: bool = True, crash_after: str | None = None, plan: str = "auto") -> RunReport:
        """Ingest new landing files, then one join run; ``plan`` as in :mod:`cdc_join.run.cost`."""
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
        if isinstance(self.spark, DeferredSession):  # a session not started yet: for what is read
            self.spark.work_bytes = functools.partial(verify.read_bytes, self.config)
            self.spark.small_conf = dict(verify.SMALL_LAKE_CONF)
        found = verify.verify(self.storage, self.config, samples=samples, source=source)
        if not repair or found.ok or found.unfinished:  # a stopped run is finished by a run
            return found
        self.full_refresh(ingest=False)
        again = verify.verify(self.storage, self.config, samples=samples, source=source)
        return dataclasses.replace(again, repaired=again.ok)

    def _run(self, kind: str, ingest: bool, crash_after: str | None, plan: str) -> RunReport:
        if ingest and kind == "incremental" and isinstance(self.spark, DeferredSession):
            # A session not started yet starts for the landing files this run reads.
            self.spark.work_bytes = functools.partial(landed_bytes, self.storage, self.config)
        with run_lock(self.config):
            started = datetime.now(timezone.utc)
            begin = runlog.start(self.storage, self.config)
            if kind == "incremental" and plan in idle.PLANS:
                report = self._idle(begin, ingest, crash_after)
                if report is not None:
                    return report
            # Every write on state, subscriptions and silver names the version this run read.
            store = Fenced(self.storage, begin.tables, commits.run_note())
            report = RunReport(begin.checkpoint.run_id + 1, kind, crash_after, self.progress)
            report.jobs = SparkJobs(self.spark)
            if ingest:
                with report.step("ingest"):
                    report.ingested(ingest_all(self.spark, self.storage, self.config, progress=self.progress))
            checkpoint = self._join(store, begin, report, plan)
            with report.step("commit"):
                commit_run(
                    self.storage, self.config, checkpoint, kind, started, report.to_dict(), begin.log_version
                )
            return report

    def _idle(self, begin: RunStart, ingest: bool, crash_after: str | None) -> RunReport | None:
        """The report of a run with nothing to do (:mod:`cdc_join.run.idle`), which writes
        nothing and needs no Spark; ``None`` when the run may have something to do."""
        started = time.perf_counter()
        found = idle.nothing_to_do(self.storage, self.config, begin, ingest)
        if found is None:  # no step recorded: the run's own ingest comes next
            return None
        report = RunReport(begin.checkpoint.run_id + 1, "incremental", crash_after, self.progress)
        name = "ingest" if ingest else "idle"
        with report.step(name):
            report.idle, ingested = found
            if ingest:
                report.ingested(ingested)
        report.seconds[name] = round(time.perf_counter() - started, 3)  # the check's reads too
        return report

    def _join(self, store: Fenced, begin: RunStart, report: RunReport, requested: str) -> Checkpoint:
        cfg, previous, run_id = self.config, begin.checkpoint, report.run_id
        ready = bronze.prepare(store, cfg, report)
        if ready is None:
            return dataclasses.replace(previous, run_id=run_id)
        versions = ready.bronze_versions
        resolve.select_schema(store, cfg)  # a bad select fails here, before any state or silver write
        types = silver.source_types(store, cfg, versions)
        changes = functools.cache(lambda: increment.plan_all(store, cfg, previous, versions, run_id))
        with report.step("plan") as counts:
            keys = lambda: {name: c.keys.rows for name, c in changes().items()}  # noqa: E731
            plan = choose(store, cfg, previous, versions, types, requested, keys)
            counts.update(plan.as_report())
        run = run_paths.Run(store, cfg, report, begin.silver_version)

        def checkpoint(pinned: dict[str, int], watermarks: dict[str, str]) -> Checkpoint:
            definition = silver.definition(cfg, types)
            tables, applied = store.tables(), settings(cfg)
            return Checkpoint(run_id, versions, pinned, watermarks, definition, tables, applied)

        if plan.path is RunPath.REBUILD:
            pinned, watermarks = rebuild.rebuild_all(store, cfg, versions, run_id, report.step)
            run_paths.recompute(run, pinned, replace=plan.replace_silver)
            return checkpoint(pinned, watermarks)
        subscribers = run_paths.lookups(run, changes()) if plan.path is RunPath.INCREMENTAL else {}
        applied, current = apply.apply_all(store, cfg, changes(), subscribers, previous, run_id, report.step)
        pinned = {name: a.version for name, a in applied.items()}
        changed = {name: applied[name].changes for name in cfg.hop_sources}
        if plan.path is RunPath.RECOMPUTE:
            run_paths.recompute(run, pinned, None if plan.rebuild_subscriptions else changed)
        elif plan.path is RunPath.RECOMPUTE_AFFECTED:
            run_paths.recompute_affected(run, applied, pinned)
        else:
            run_paths.incremental(run, changed, current, subscribers, pinned)
        return checkpoint(pinned, {n: a.watermark for n, a in applied.items() if a.watermark})
