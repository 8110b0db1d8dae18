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
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from cdc_join import lookup, resolve, state, subscription
from cdc_join.config import PipelineConfig
from cdc_join.ingest import ingest_all
from cdc_join.lookup import RIGHT, RIGHT_SEQ, ScanStats
from cdc_join.report import RunReport
from cdc_join.runlog import Checkpoint, commit_run, last_checkpoint, run_lock
from cdc_join.session import get_spark
from cdc_join.silver import merge_into_silver
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
    def run(self, *, ingest: bool = True, crash_after: str | None = None) -> RunReport:
        """Ingest new landing files, then one incremental join run."""
        with run_lock(self.config):
            return self._run("incremental", ingest, crash_after)

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

    def _run(self, kind: str, ingest: bool, crash_after: str | None) -> RunReport:
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
            self._join(previous, pinned, report)
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
    def _join(self, previous: Checkpoint, pinned: Versions, report: RunReport) -> None:
        cfg, store = self.config, self.storage
        left = cfg.left_source
        left_path = cfg.state_path(cfg.left)
        first_run = cfg.left not in previous.state_versions
        with report.step("left changes") as counts:
            changes = self._left_changes(previous, pinned).cache()
            counts["keys"] = changes.count()
        responses: dict[str, DataFrame] = {}
        for join in cfg.joins:
            right = cfg.sources[join.right]
            right_path, right_v = cfg.state_path(join.right), pinned.state[join.right]
            sub_path = cfg.subscription_path(join)
            with report.step(f"subscription:{join.alias}") as counts:
                left_schema = store.schema(left_path)
                store.create(sub_path, subscription.subscription_schema(left, join, left_schema), cdf=False)
                messages = subscription.instructions(changes, left, join).cache()
                counts["instructions"] = {
                    r[subscription.INSTRUCTION]: r["count"]
                    for r in messages.groupBy(subscription.INSTRUCTION).count().collect()
                }
                applied = subscription.apply_instructions(
                    store, sub_path, messages, left, join, report.run_id
                )
                counts.update(
                    subscribed=applied.subscribed, updated=applied.updated, unsubscribed=applied.unsubscribed
                )
            with report.step(f"lookup:{join.alias}") as counts:
                from_left, left_scan = lookup.left_driven_responses(
                    store, right_path, right_v, messages, left, join, right
                )
                joined = from_left
                sub_scan = ScanStats(0, 0)
                if not first_run and join.right in previous.state_versions:
                    right_changes = self._state_changes(join.right, previous, pinned)
                    keys = lookup.changed_right_keys(right_changes, right, join).cache()
                    counts["right_keys_changed"] = keys.count()
                    if counts["right_keys_changed"]:
                        from_right, sub_scan, _ = lookup.right_driven_responses(
                            store, sub_path, applied.version, right_path, right_v, keys, left, join, right
                        )
                        joined = from_left.unionByName(from_right)
                elif first_run:
                    counts["right_keys_changed"] = "skipped: first run, every left row is new"
                responses[join.alias] = joined.cache()
                counts.update(
                    responses=responses[join.alias].count(),
                    subscription_files_scanned=sub_scan.files_scanned,
                    subscription_files_total=sub_scan.files_total,
                    right_files_scanned=left_scan.files_scanned,
                    right_files_total=left_scan.files_total,
                )
        with report.step("resolve") as counts:
            rows, stale = self._resolve(responses, pinned, report.run_id, counts)
        with report.step("silver") as counts:
            merged = merge_into_silver(store, cfg, rows)
            counts.update(inserted=merged.inserted, updated=merged.updated, deleted=merged.deleted)
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

    def _left_changes(self, previous: Checkpoint, pinned: Versions) -> DataFrame:
        """Changed left keys with their old (last checkpoint) and new (pinned) values."""
        cfg, store = self.config, self.storage
        path, pk = cfg.state_path(cfg.left), list(cfg.left_source.primary_key)
        new_v = pinned.state[cfg.left]
        if cfg.left in previous.state_versions:
            keys = self._state_changes(cfg.left, previous, pinned).select(*pk).distinct()
            old_rows, _ = lookup.read_matching(
                store, path, keys, [(c, c) for c in pk], previous.state_versions[cfg.left]
            )
            new_rows, _ = lookup.read_matching(store, path, keys, [(c, c) for c in pk], new_v)
        else:
            new_rows = store.read(path, new_v)
            keys = new_rows.select(*pk)
            old_rows = new_rows.limit(0)
        values = [f.name for f in state.value_fields(new_rows.schema)]

        def image(rows: DataFrame, name: str) -> DataFrame:
            # An older snapshot may predate columns added since: those read as null.
            live = state.current_rows(rows)
            have = set(rows.columns)
            fields = [
                F.col(f"`{v}`") if v in have else F.lit(None).cast(new_rows.schema[v].dataType).alias(v)
                for v in values
            ]
            extra = [F.col(state.HASH).alias(subscription.NEW_HASH)] if name == subscription.NEW else []
            return live.select(*pk, F.struct(*fields).alias(name), *extra)

        old_img, new_img = image(old_rows, subscription.OLD), image(new_rows, subscription.NEW)
        return keys.join(old_img, pk, "left").join(new_img, pk, "left")

    def _resolve(
        self, responses: dict[str, DataFrame], pinned: Versions, run_id: int, counts: dict
    ) -> tuple[DataFrame, dict[str, DataFrame | None]]:
        cfg, store = self.config, self.storage
        left = cfg.left_source
        pks = subscription.pk_columns(left)
        all_keys = None
        for r in responses.values():
            k = r.select(*pks)
            all_keys = k if all_keys is None else all_keys.unionByName(k)
        assert all_keys is not None
        keys = all_keys.distinct().select(*[F.col(f"pk_{c}").alias(c) for c in left.primary_key])
        left_state, _ = lookup.read_matching(
            store, cfg.state_path(cfg.left), keys, [(c, c) for c in left.primary_key], pinned.state[cfg.left]
        )
        left_state = left_state.cache()
        valid: dict[str, DataFrame] = {}
        stale: dict[str, DataFrame | None] = {}
        dropped = 0
        for join in cfg.joins:
            checked = resolve.check_responses(responses[join.alias], left_state, cfg, join)
            valid[join.alias] = checked.valid.cache()
            n_stale = checked.stale.count()
            dropped += n_stale
            # Only leftover subscriptions (fk moved on, row gone) are removed; the left path
            # keeps the others current.
            orphans = checked.stale.filter((F.col("_origin") == "right") & F.col(resolve.ORPHAN))
            stale[join.alias] = orphans if n_stale else None
        affected = None
        for v in valid.values():
            k = v.select(*pks)
            affected = k if affected is None else affected.unionByName(k)
        assert affected is not None
        affected = affected.distinct()
        left_rows = resolve.left_struct(cfg, left_state).join(affected, pks, "left_semi").cache()
        right_by_alias = {
            join.alias: self._right_for(join, valid[join.alias], left_rows, pinned) for join in cfg.joins
        }
        rows = resolve.build_rows(cfg, left_rows, right_by_alias, run_id).cache()
        counts.update(stale_dropped=dropped, affected_keys=left_rows.count())
        return rows, stale

    def _right_for(self, join, valid: DataFrame, left_rows: DataFrame, pinned: Versions) -> DataFrame:  # type: ignore[no-untyped-def]
        """Right rows per affected key: the response's, else the one the current fk names."""
        cfg = self.config
        pks = subscription.pk_columns(cfg.left_source)
        have = valid.dropDuplicates(pks)
        need = left_rows.filter(~F.col(state.DELETED)).join(have.select(*pks), pks, "left_anti")
        fks = subscription.fk_columns(join)
        need_fk = need.select(
            *pks, *[F.col(f"{cfg.left}.`{c}`").alias(f) for c, f in zip(join.foreign_key, fks, strict=False)]
        )
        found, _ = lookup.right_rows(
            self.storage,
            cfg.state_path(join.right),
            cfg.sources[join.right],
            need_fk,
            fks,
            pinned.state[join.right],
        )
        looked_up = need_fk.join(found.dropDuplicates(fks), fks, "inner").select(*pks, RIGHT, RIGHT_SEQ)
        return have.select(*pks, RIGHT, RIGHT_SEQ).unionByName(looked_up)
