"""The one place that wires a run together: ingest → state → subscriptions/lookups → resolve →
silver → checkpoint (DESIGN.md §1).

Crash safety, commit by commit: bronze writes are insert-only MERGEs keyed by file and line,
state MERGEs are sequence-guarded, subscription MERGEs are derived from the left state as of
the last checkpoint (so a rerun issues the same ones), silver MERGEs write rows computed from
pinned state versions and update only what differs, and the run-log row that moves the
checkpoint is committed last. Killing a run anywhere and rerunning converges to the same silver.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.types import StructType

from cdc_join import cost, lookup, resolve, state, subscription
from cdc_join.changeset import ChangeSet, collect, distinct_rows, from_arrow, materialize
from cdc_join.config import PipelineConfig
from cdc_join.ingest import ingest_all
from cdc_join.lookup import RIGHT, RIGHT_SEQ, ScanStats
from cdc_join.maintenance import table_properties
from cdc_join.report import RunReport
from cdc_join.runlog import Checkpoint, commit_run, last_checkpoint, run_lock
from cdc_join.session import get_spark
from cdc_join.silver import merge_into_silver, only_changes
from cdc_join.storage import Storage, get_storage


@dataclass(frozen=True)
class VerifyReport:
    """How silver differs from a from-scratch join of the current state tables."""

    expected_rows: int
    silver_rows: int
    missing: int
    extra: int
    different: int
    samples: tuple[str, ...] = ()
    repaired: bool = False

    @property
    def ok(self) -> bool:
        return self.missing == self.extra == self.different == 0

    def summary(self) -> str:
        head = (
            "silver matches the join of the current sources"
            if self.ok
            else "silver DIFFERS from a full recompute"
        )
        lines = [
            f"{head}: expected {self.expected_rows} rows, silver has {self.silver_rows}; "
            f"missing {self.missing}, extra {self.extra}, different {self.different}"
        ]
        lines += [f"  e.g. {s}" for s in self.samples]
        if self.repaired:
            lines.append("  repaired: silver now equals the recompute")
        return "\n".join(lines)


@dataclass(frozen=True)
class Versions:
    """State table versions a run reads, pinned once so every step sees the same snapshot."""

    state: dict[str, int]


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

    # -- runs ------------------------------------------------------------------------------
    def run(self, *, ingest: bool = True, crash_after: str | None = None, plan: str = "auto") -> RunReport:
        """Ingest new landing files, then one incremental join run.

        ``plan`` is ``auto`` (the cost rule of :mod:`cdc_join.cost` decides), ``incremental`` or
        ``recompute`` (the rule is overridden; the report says so). Both plans give the same
        silver; they differ in cost only.
        """
        if plan not in cost.PLANS:
            raise ValueError(f"plan must be one of {', '.join(cost.PLANS)}, not {plan!r}")
        with run_lock(self.config):
            return self._run("incremental", ingest, crash_after, plan)

    def full_refresh(self, *, ingest: bool = True, crash_after: str | None = None) -> RunReport:
        """Rebuild state, subscriptions and silver from bronze."""
        with run_lock(self.config):
            return self._run("full_refresh", ingest, crash_after)

    def expected_silver(self) -> DataFrame:
        """The join of the current state tables, from scratch (DESIGN.md §2's oracle)."""
        cfg, store = self.config, self.storage
        left_rows = resolve.left_struct(cfg, state.current_rows(store.read(cfg.state_path(cfg.left))))
        pks = subscription.pk_columns(cfg.left_source)
        none = left_rows.select(*pks).limit(0)
        pinned = Versions({s: store.version(cfg.state_path(s)) for s in cfg.sources})
        right_by_alias = {}
        for join in cfg.joins:
            empty = none.select(*pks, F.lit(None).alias(RIGHT), F.lit(None).alias(RIGHT_SEQ))
            right_by_alias[join.alias] = self._right_for(join, empty, left_rows, pinned)
        rows = resolve.build_rows(cfg, left_rows, right_by_alias, run_id=0)
        return rows.filter(F.col(resolve.ACTION) == "upsert")

    def verify(self, *, repair: bool = False, samples: int = 5) -> VerifyReport:
        """Compare silver with :meth:`expected_silver` row for row; optionally fix silver."""
        cfg, store = self.config, self.storage
        keys = resolve.silver_key_columns(cfg)
        cols = [*keys, *resolve.output_columns(cfg)]
        expected = self.expected_silver().cache()
        exp = expected.select(*cols)
        act = store.read(cfg.silver_path).select(*cols) if store.exists(cfg.silver_path) else exp.limit(0)
        only_exp, only_act = exp.exceptAll(act).cache(), act.exceptAll(exp).cache()
        missing = only_exp.join(act, keys, "left_anti")
        extra = only_act.join(exp, keys, "left_anti")
        different = only_exp.join(act, keys, "left_semi")
        shown = [f"missing {r.asDict()}" for r in missing.limit(samples).collect()]
        shown += [f"extra {r.asDict()}" for r in extra.limit(samples).collect()]
        shown += [f"different {r.asDict()}" for r in different.limit(samples).collect()]
        report = VerifyReport(
            expected_rows=exp.count(),
            silver_rows=act.count(),
            missing=missing.count(),
            extra=extra.count(),
            different=different.count(),
            samples=tuple(shown),
        )
        if repair and not report.ok:
            deletes = extra.select(*keys).join(expected.drop(resolve.ACTION), keys, "left")
            fixes = expected.unionByName(deletes.withColumn(resolve.ACTION, F.lit("delete")))
            merge_into_silver(store, cfg, fixes)
            return dataclasses.replace(report, repaired=True)
        return report

    def _run(self, kind: str, ingest: bool, crash_after: str | None, plan: str = "auto") -> RunReport:
        started = datetime.now(timezone.utc)
        previous = last_checkpoint(self.storage, self.config)
        report = RunReport(
            run_id=previous.run_id + 1, kind=kind, crash_after=crash_after, progress=self.progress
        )
        if ingest:
            with report.step("ingest") as counts:
                for name, r in ingest_all(self.spark, self.storage, self.config).items():
                    counts[name] = {"files": r.files, "events": r.events, "quarantined": r.quarantined}
        if kind == "full_refresh":
            self._reset_internal_tables()
            previous = Checkpoint(run_id=previous.run_id)
        bronze_versions, watermarks = self._apply_bronze(previous, report)
        state_versions = dict(previous.state_versions)
        waiting = [s for s in self.config.sources if not self.storage.exists(self.config.state_path(s))]
        if waiting:
            report.steps["join"] = {"waiting_for_first_events_of": waiting}
        else:
            pinned = Versions(
                {s: self.storage.version(self.config.state_path(s)) for s in self.config.sources}
            )
            self._join(previous, pinned, report, plan)
            state_versions = pinned.state
        checkpoint = Checkpoint(report.run_id, bronze_versions, state_versions, watermarks)
        commit_run(self.storage, self.config, checkpoint, kind, started, report.to_dict())
        return report

    def _reset_internal_tables(self) -> None:
        """Empty state and subscriptions; silver is kept and merged, so only real changes show."""
        for path in [
            *(self.config.state_path(s) for s in self.config.sources),
            *(self.config.subscription_path(j) for j in self.config.joins),
        ]:
            if self.storage.exists(path):
                self.storage.delete(path)

    # -- bronze → state ----------------------------------------------------------------------
    def _apply_bronze(self, previous: Checkpoint, report: RunReport) -> tuple[dict[str, int], dict[str, str]]:
        bronze_versions = dict(previous.bronze_versions)
        watermarks = dict(previous.watermarks)
        for name, source in self.config.sources.items():
            bronze = self.config.bronze_path(name)
            if not self.storage.exists(bronze):
                continue
            with report.step(f"state:{name}") as counts:
                end = self.storage.version(bronze)
                start = previous.bronze_versions.get(name, -1) + 1
                if end >= start:
                    events = self.storage.read_changes(bronze, start, end).filter(
                        F.col("_change_type") == "insert"
                    )
                    applied = state.apply_changes(
                        self.storage, self.config.state_path(name), source, events, watermarks.get(name)
                    )
                    counts.update(events=applied.events, keys_changed=applied.keys_changed)
                    if applied.truncate_watermark is not None:
                        watermarks[name] = applied.truncate_watermark
                bronze_versions[name] = end
        return bronze_versions, watermarks

    # -- the join ----------------------------------------------------------------------------
    def _join(self, previous: Checkpoint, pinned: Versions, report: RunReport, plan: str = "auto") -> None:
        cfg, store = self.config, self.storage
        first_run = cfg.left not in previous.state_versions
        with report.step("plan") as counts:
            left_cdf = changed_left = None
            if not first_run:
                # The left state's change feed since the last run, once: its keys are the changed
                # left keys, and its images are their old and new values (see _left_changes).
                pk = list(cfg.left_source.primary_key)
                left_cdf = materialize(self._state_feed(cfg.left, previous, pinned))
                changed_left = left_cdf.distinct(pk)
            right_keys = {
                j.alias: materialize(
                    lookup.changed_right_keys(
                        self._state_changes(j.right, previous, pinned), cfg.sources[j.right], j
                    )
                )
                for j in cfg.joins
                if not first_run and j.right in previous.state_versions
            }
            decision = cost.choose_plan(
                first_run=first_run,
                left_rows=_rows(store, cfg.state_path(cfg.left), pinned.state[cfg.left]),
                changed_left_keys=None if changed_left is None else changed_left.rows,
                changed_right_keys={a: k.rows for a, k in right_keys.items()},
                subscription_rows={
                    j.alias: _rows(store, cfg.subscription_path(j))
                    for j in cfg.joins
                    if j.alias in right_keys
                },
                right_rows={
                    j.alias: _rows(store, cfg.state_path(j.right), pinned.state[j.right])
                    for j in cfg.joins
                    if j.alias in right_keys
                },
            )
            if plan != "auto" and not first_run and decision.recompute != (plan == "recompute"):
                reason = f"forced by plan={plan} (the rule said: {decision.reason})"
                decision = dataclasses.replace(decision, recompute=plan == "recompute", reason=reason)
            counts.update(decision.as_report())
        if decision.recompute:
            self._recompute(pinned, report)
            return
        if (
            changed_left is not None
            and changed_left.rows == 0
            and not any(k.rows for k in right_keys.values())
        ):
            # Nothing changed since the last run: every step below would read and write nothing.
            for name in (
                "left changes",
                *(f"{p}:{j.alias}" for j in cfg.joins for p in ("subscription", "lookup")),
            ):
                report.steps[name] = {"skipped": "no changes"}
                if name.startswith("subscription:"):
                    report.steps[name]["instructions"] = {}
            for name in ("resolve", "silver", "cleanup"):
                with report.step(name) as counts:
                    counts["skipped"] = "no changes"
            return
        self._incremental(previous, pinned, report, left_cdf, right_keys)

    def _recompute(self, pinned: Versions, report: RunReport) -> None:
        """The whole join from the pinned state: subscriptions rebuilt, every row MERGEd into silver."""
        cfg, store = self.config, self.storage
        left = cfg.left_source
        left_path = cfg.state_path(cfg.left)
        left_state = store.read(left_path, pinned.state[cfg.left])
        left_schema = store.schema(left_path)
        for join in cfg.joins:
            sub_path = self._create_subscription_table(join, left_schema)
            with report.step(f"subscription:{join.alias}") as counts:
                counts["rebuilt"] = subscription.rebuild(
                    store, sub_path, left_state, left, join, report.run_id
                )
            with report.step(f"lookup:{join.alias}") as counts:
                counts["skipped"] = "recompute: right rows are joined on the current fk"
        with report.step("resolve") as counts:
            left_rows = resolve.left_struct(cfg, left_state)
            right_rows = {
                join.alias: lookup.all_right_rows(
                    store,
                    cfg.state_path(join.right),
                    cfg.sources[join.right],
                    subscription.fk_columns(join),
                    pinned.state[join.right],
                )
                for join in cfg.joins
            }
            rows = resolve.build_rows_by_fk(cfg, left_rows, right_rows, report.run_id)
            counts["affected_keys"] = "all"
        with report.step("silver") as counts:
            # Only the rows that differ from silver go into the MERGE (one Spark join on the key).
            changes = only_changes(store, cfg, rows)
            if collect(changes).num_rows or not store.exists(cfg.silver_path):
                self._merge_silver(changes, counts)
            else:
                counts.update(inserted=0, updated=0, deleted=0, rows_written=0)
        with report.step("cleanup") as counts:
            counts["stale_subscriptions_removed"] = "none left: subscriptions were rebuilt"

    def _create_subscription_table(self, join, left_schema: StructType) -> str:  # type: ignore[no-untyped-def]
        """Create the join's subscription table if absent; return its path."""
        path = self.config.subscription_path(join)
        self.storage.create(
            path,
            subscription.subscription_schema(self.config.left_source, join, left_schema),
            cdf=False,
            properties=table_properties("subscription"),
        )
        return path

    def _merge_silver(self, rows: DataFrame, counts: dict) -> None:
        merged = merge_into_silver(self.storage, self.config, rows)
        counts.update(
            inserted=merged.inserted,
            updated=merged.updated,
            deleted=merged.deleted,
            rows_written=merged.rows_written,
            files_added=merged.files_added,
            files_removed=merged.files_removed,
        )

    def _incremental(
        self,
        previous: Checkpoint,
        pinned: Versions,
        report: RunReport,
        left_cdf: ChangeSet | None,
        right_keys: dict[str, ChangeSet],
    ) -> None:
        """The KIP-213 path: instructions and lookups for the changed keys only."""
        cfg, store = self.config, self.storage
        left = cfg.left_source
        first_run = cfg.left not in previous.state_versions
        with report.step("left changes") as counts:
            changes = materialize(self._left_changes(previous, pinned, left_cdf))
            counts["keys"] = changes.rows
        left_schema = store.schema(cfg.state_path(cfg.left))
        responses: dict[str, ChangeSet | None] = {}
        for join in cfg.joins:
            right = cfg.sources[join.right]
            right_path, right_v = cfg.state_path(join.right), pinned.state[join.right]
            sub_path = self._create_subscription_table(join, left_schema)
            first_fk = subscription.fk_columns(join)[0]
            with report.step(f"subscription:{join.alias}") as counts:
                messages = materialize(subscription.instructions(changes.frame, left, join))
                counts["instructions"] = messages.value_counts(subscription.INSTRUCTION)
                applied = (
                    subscription.apply_instructions(
                        store, sub_path, messages.frame, left, join, report.run_id
                    )
                    if messages.rows
                    else subscription.SubscriptionReport(0, 0, 0, store.version(sub_path))
                )
                counts.update(
                    subscribed=applied.subscribed, updated=applied.updated, unsubscribed=applied.unsubscribed
                )
            with report.step(f"lookup:{join.alias}") as counts:
                parts: list[DataFrame] = []
                left_scan = sub_scan = ScanStats(0, 0)
                if messages.rows:
                    from_left, left_scan = lookup.left_driven_responses(
                        store,
                        right_path,
                        right_v,
                        messages.frame,
                        left,
                        join,
                        right,
                        messages.values(first_fk),
                    )
                    parts.append(from_left)
                if join.alias in right_keys:
                    keys = right_keys[join.alias]
                    counts["right_keys_changed"] = keys.rows
                    if keys.rows:
                        from_right, sub_scan, _ = lookup.right_driven_responses(
                            store,
                            sub_path,
                            applied.version,
                            right_path,
                            right_v,
                            keys.frame,
                            left,
                            join,
                            right,
                            keys.values(first_fk),
                        )
                        parts.append(from_right)
                elif first_run:
                    counts["right_keys_changed"] = "skipped: first run, every left row is new"
                found = materialize(functools.reduce(DataFrame.unionByName, parts)) if parts else None
                responses[join.alias] = found
                counts.update(
                    responses=found.rows if found is not None else 0,
                    subscription_files_scanned=sub_scan.files_scanned,
                    subscription_files_total=sub_scan.files_total,
                    right_files_scanned=left_scan.files_scanned,
                    right_files_total=left_scan.files_total,
                )
        with report.step("resolve") as counts:
            rows, stale = self._resolve(responses, pinned, report.run_id, counts)
        with report.step("silver") as counts:
            if rows is not None:
                self._merge_silver(rows, counts)
            else:
                counts.update(inserted=0, updated=0, deleted=0, rows_written=0)
        with report.step("cleanup") as counts:
            counts["stale_subscriptions_removed"] = sum(
                subscription.remove_subscriptions(store, cfg.subscription_path(j), stale[j.alias], left, j)
                for j in cfg.joins
                if stale[j.alias] is not None
            )

    def _state_changes(self, source: str, previous: Checkpoint, pinned: Versions) -> DataFrame:
        """State rows changed since the last checkpoint (post-images), up to the pinned version."""
        path = self.config.state_path(source)
        start = previous.state_versions[source] + 1
        if pinned.state[source] < start:
            return self.storage.read(path).limit(0)
        changes = self.storage.read_changes(path, start, pinned.state[source])
        return changes.filter(F.col("_change_type").isin("insert", "update_postimage", "delete"))

    def _state_feed(self, source: str, previous: Checkpoint, pinned: Versions) -> DataFrame:
        """The state table's change feed since the last checkpoint, up to the pinned version."""
        path = self.config.state_path(source)
        start = previous.state_versions[source] + 1
        if pinned.state[source] < start:
            return self.storage.read_changes(path, start, start - 1)  # an empty feed, same columns
        return self.storage.read_changes(path, start, pinned.state[source])

    def _left_changes(
        self, previous: Checkpoint, pinned: Versions, feed: ChangeSet | None = None
    ) -> DataFrame:
        """Changed left keys with their old (last checkpoint) and new (pinned) values.

        The images come from the left state's change feed since the last checkpoint (``feed``,
        read here when not given), not from reading the state table at two versions: per key,
        the old row is the pre-image of its first change in the feed (none if that change
        inserted it) and the new row the post-image of its last. Delta's change feed holds
        exactly those images, so this equals reading both versions, for the cost of the
        changes instead of two scans of the files holding the changed keys.
        """
        cfg, store = self.config, self.storage
        path, pk = cfg.state_path(cfg.left), list(cfg.left_source.primary_key)
        new_v = pinned.state[cfg.left]
        if cfg.left in previous.state_versions:
            if feed is None:
                feed = materialize(self._state_feed(cfg.left, previous, pinned))
            changes = feed.frame
            by_key = Window.partitionBy(*[F.col(f"`{c}`") for c in pk])
            version, kind = F.col("_commit_version"), F.col("_change_type")
            bounded = changes.withColumn("_first", F.min(version).over(by_key)).withColumn(
                "_last", F.max(version).over(by_key)
            )
            old_rows = bounded.filter((version == F.col("_first")) & kind.isin("update_preimage", "delete"))
            new_rows = bounded.filter((version == F.col("_last")) & kind.isin("insert", "update_postimage"))
            keys = changes.select(*pk).distinct()
            schema = store.schema(path)
        else:
            new_rows = store.read(path, new_v)
            keys = new_rows.select(*pk)
            old_rows = new_rows.limit(0)
            schema = new_rows.schema
        values_ = [f.name for f in state.value_fields(schema)]

        def image(rows: DataFrame, name: str) -> DataFrame:
            # The feed is read with the current schema: columns added since read as null.
            live = state.current_rows(rows)
            have = set(rows.columns)
            fields = [
                F.col(f"`{v}`") if v in have else F.lit(None).cast(schema[v].dataType).alias(v)
                for v in values_
            ]
            extra = [F.col(state.HASH).alias(subscription.NEW_HASH)] if name == subscription.NEW else []
            return live.select(*pk, F.struct(*fields).alias(name), *extra)

        old_img, new_img = image(old_rows, subscription.OLD), image(new_rows, subscription.NEW)
        return keys.join(old_img, pk, "left").join(new_img, pk, "left")

    def _resolve(
        self, responses: dict[str, ChangeSet | None], pinned: Versions, run_id: int, counts: dict
    ) -> tuple[DataFrame | None, dict[str, DataFrame | None]]:
        """Stale-check the responses and build the silver rows of the affected keys.

        Returns the rows to MERGE into silver (``None`` when no key is affected) and, per join,
        the leftover subscriptions to remove (``None`` when there are none).
        """
        cfg, store = self.config, self.storage
        left = cfg.left_source
        pks = subscription.pk_columns(left)
        stale: dict[str, DataFrame | None] = {j.alias: None for j in cfg.joins}
        present = [r for r in responses.values() if r is not None and r.rows]
        if not present:
            counts.update(stale_dropped=0, affected_keys=0)
            return None, stale
        renamed = [F.col(p).alias(c) for p, c in zip(pks, left.primary_key, strict=True)]
        keys = from_arrow(
            present[0].frame.select(*renamed),
            distinct_rows(_concat([r.table for r in present], pks), pks).rename_columns(
                list(left.primary_key)
            ),
        )
        left_state, _ = lookup.read_matching(
            store,
            cfg.state_path(cfg.left),
            keys.frame,
            [(c, c) for c in left.primary_key],
            pinned.state[cfg.left],
            keys.values(left.primary_key[0]),
        )
        current = materialize(left_state)
        valid: dict[str, DataFrame | None] = {}
        valid_keys: list[pa.Table] = []
        dropped = 0
        for join in cfg.joins:
            found = responses[join.alias]
            if found is None or not found.rows:
                valid[join.alias] = None
                continue
            checked = materialize(resolve.flag_responses(found.frame, current.frame, cfg, join))
            split = resolve.split_checked(checked.frame, cfg, join)
            n_stale = checked.count_true(resolve.STALE)
            dropped += n_stale
            valid[join.alias] = split.valid
            valid_keys.append(_valid_keys(checked.table, pks))
            # Only leftover subscriptions (fk moved on, row gone) are removed; the left path
            # keeps the others current.
            orphans = split.stale.filter((F.col("_origin") == "right") & F.col(resolve.ORPHAN))
            stale[join.alias] = orphans if n_stale else None
        affected = from_arrow(present[0].frame.select(*pks), distinct_rows(_concat(valid_keys, pks), pks))
        in_scope = resolve.left_struct(cfg, current.frame).join(affected.frame, pks, "left_semi")
        left_rows = materialize(in_scope)
        counts.update(stale_dropped=dropped, affected_keys=left_rows.rows)
        if not left_rows.rows:
            return None, stale
        right_by_alias = {
            join.alias: self._right_for(join, valid[join.alias], left_rows.frame, pinned, small=True)
            for join in cfg.joins
        }
        rows = resolve.build_rows(cfg, left_rows.frame, right_by_alias, run_id)
        collect(rows)
        return rows, stale

    def _right_for(  # type: ignore[no-untyped-def]
        self, join, valid: DataFrame | None, left_rows: DataFrame, pinned: Versions, *, small: bool = False
    ) -> DataFrame:
        """Right rows per affected key: the response's, else the one the current fk names.

        ``valid`` may be ``None`` (the join sent no response). With ``small`` the keys to look
        up are a change set, materialized once so their values drive file pruning.
        """
        cfg = self.config
        pks = subscription.pk_columns(cfg.left_source)
        live = left_rows.filter(~F.col(state.DELETED))
        need = live if valid is None else live.join(valid.select(*pks), pks, "left_anti")
        fks = subscription.fk_columns(join)
        need_fk = need.select(
            *pks, *[F.col(f"{cfg.left}.`{c}`").alias(f) for c, f in zip(join.foreign_key, fks, strict=False)]
        )
        values = None
        if small:
            needed = materialize(need_fk)
            need_fk, values = needed.frame, needed.values(fks[0])
        found, _ = lookup.right_rows(
            self.storage,
            cfg.state_path(join.right),
            cfg.sources[join.right],
            need_fk,
            fks,
            pinned.state[join.right],
            values,
        )
        looked_up = need_fk.join(found.dropDuplicates(fks), fks, "inner").select(*pks, RIGHT, RIGHT_SEQ)
        if valid is None:
            return looked_up
        return valid.dropDuplicates(pks).select(*pks, RIGHT, RIGHT_SEQ).unionByName(looked_up)


def _rows(storage: Storage, path: str, version: int | None = None) -> int:
    """Rows of a table from its file statistics (no Spark job); 0 when it does not exist yet."""
    if version is None and not storage.exists(path):
        return 0
    return sum(f.num_records or 0 for f in storage.files(path, version))


def _concat(tables: list[pa.Table], columns: list[str]) -> pa.Table:
    """``columns`` of several Arrow tables stacked (their types agree; nullability may not)."""
    return pa.table(
        {
            c: pa.chunked_array([k for t in tables for k in t.column(c).chunks], tables[0].column(c).type)
            for c in columns
        }
    )


def _valid_keys(checked: pa.Table, pks: list[str]) -> pa.Table:
    """Keys of the valid, propagating responses of a flagged response table."""
    stale = pc.fill_null(checked[resolve.STALE], True)
    propagates = pc.or_(pc.is_valid(checked[RIGHT]), pc.fill_null(checked[lookup.PROPAGATE_IF_NULL], False))
    return checked.filter(pc.and_(pc.invert(stale), propagates)).select(pks)
