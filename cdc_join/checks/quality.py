"""Data quality of silver after a run, checked with great-expectations (the last step of a run).

The checks look at what a run touched: the silver rows whose key the run wrote (``_run_id``),
read from the whole silver table with a keyed semi-join, so a key duplicated by an older row is
still caught. Built-in checks, all on those rows:

- ``pk_unique`` / ``pk_not_null`` on the merge key (``_pk_*``), severity ``fail``;
- ``right_present:<alias>`` for every inner join: no row lacks its right side, severity ``fail``;
- ``orphan_rate:<alias>`` for every left join: the share of rows whose (non-null) foreign key
  names no right row, against ``quality.orphan_rate_max`` (reported only when not set);
- ``freshness``: minutes between the newest source event processed (``_cdc_ts_ms`` of the
  state tables at the run's checkpoint) and the wall clock, when ``quality.freshness_max_minutes``
  is set;
- ``quarantine:<source>``: lines of that source the run's ingest quarantined, against
  ``quality.quarantine_max`` (only for the sources it names; one number covers every source);
- ``expectation:<name>``: any great-expectations expectation from the pipeline YAML.

The ``quality:`` section that configures them is parsed by :mod:`cdc_join.checks.quality_config`.
Every result becomes one row of the quality-results Delta table (``config.quality_path``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import great_expectations as gx
import pandas as pd
import pyarrow as pa
from great_expectations.expectations import Expectation
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import BooleanType, LongType, StringType, StructField, StructType, TimestampType

from cdc_join.changeset import arrow_schema, from_arrow
from cdc_join.checkpoint import Checkpoint
from cdc_join.checks.quality_config import (
    COLUMN_KWARGS,
    FAIL,
    GX_SEVERITY,
    SEVERITY_OF_GX,
    WARN,
    QualitySettings,
    parse_quality,
)
from cdc_join.columns import DELETED, RUN_ID, TS_MS, silver_key_columns
from cdc_join.config import JoinConfig, JoinType, PipelineConfig
from cdc_join.errors import ConfigError
from cdc_join.join.state import newest
from cdc_join.schemas import quoted
from cdc_join.storage import Storage
from cdc_join.storage.pruning import read_keyed

RESULTS_SCHEMA = StructType(
    [
        StructField("run_id", LongType(), False),
        StructField("check", StringType(), False),
        StructField("column", StringType(), True),
        StructField("success", BooleanType(), False),
        StructField("severity", StringType(), False),
        StructField("observed", StringType(), True),
        StructField("details", StringType(), True),
        StructField("checked_at", TimestampType(), False),
    ]
)


# -- results ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckResult:
    """One expectation's outcome (one row of the quality-results table)."""

    check: str
    column: str | None
    success: bool
    severity: str
    observed: str
    details: Mapping[str, Any]


@dataclass(frozen=True)
class QualityReport:
    """The checks of one run. ``failed`` holds the failures of severity ``fail``."""

    run_id: int | None
    rows_checked: int
    results: tuple[CheckResult, ...] = ()
    note: str = ""
    first_run_id: int | None = None
    """The first run of those checked together (runs since the last check), when several."""

    @property
    def failed(self) -> list[CheckResult]:
        return [r for r in self.results if not r.success and r.severity == FAIL]

    @property
    def warnings(self) -> list[CheckResult]:
        return [r for r in self.results if not r.success and r.severity == WARN]

    @property
    def ok(self) -> bool:
        return not self.failed

    def summary(self) -> str:
        """A few lines a person reads after a run."""
        if not self.results:
            return f"quality: nothing checked ({self.note})"
        runs = (
            f"runs {self.first_run_id}-{self.run_id}"
            if self.first_run_id is not None and self.run_id is not None and self.first_run_id < self.run_id
            else f"run {self.run_id}"
        )
        head = (
            f"quality of {runs}: {len(self.results)} checks on {self.rows_checked} touched rows, "
            f"{len(self.failed)} failed, {len(self.warnings)} warnings"
        )
        lines = [head]
        for r in self.results:
            status = "ok" if r.success else ("FAIL" if r.severity == FAIL else "WARN")
            where = f" ({r.column})" if r.column else ""
            lines.append(f"  {status:<5} {r.check}{where}: {r.observed}")
        return "\n".join(lines)


# -- running the checks ----------------------------------------------------------------------


def check(
    config: PipelineConfig,
    storage: Storage,
    *,
    run_id: int | None = None,
    now: datetime | None = None,
    write: bool = True,
) -> QualityReport:
    """Check the silver rows a run touched; append the results to the quality table.

    Args:
        config: the pipeline (its ``quality:`` section configures the checks).
        storage: the storage backend.
        run_id: the run to check (default: the newest in the run log).
        now: the wall clock for freshness (default: the current time).
        write: whether to append the results to ``config.quality_path``.

    Returns:
        The results; ``report.ok`` is false when an expectation of severity ``fail`` failed.

    Raises:
        ConfigError: the ``quality:`` section is invalid.
        ConfigError: ``run_id`` is not in the run log.
    """
    settings = parse_quality(config)
    found = _runs_to_check(storage, config, run_id)
    if found is None:
        return QualityReport(run_id, 0, note="no completed run in the run log yet")
    run, run_reports, since = found
    context = _context()  # suites attach to the current context, so it comes first
    results = _check_quarantine(context, settings, run_reports) if settings.quarantine_max else []
    count = 0
    if storage.exists(config.silver_path):
        rows = touched_rows(config, storage, run, since=since).cache()
        try:
            count = rows.count()
            results += _validate(context, rows, _row_suite(config, settings), count)
        finally:
            rows.unpersist()
        if settings.freshness_max_minutes is not None:
            clock = now or datetime.now(timezone.utc)
            results.append(_check_freshness(context, config, storage, run, settings, clock))
    note = "" if storage.exists(config.silver_path) else "silver does not exist yet (sources still waiting)"
    report = QualityReport(run.run_id, count, tuple(results), note=note, first_run_id=since + 1)
    if write:
        write_results(config, storage, report)
    return report


def touched_rows(
    config: PipelineConfig, storage: Storage, run: Checkpoint, *, since: int | None = None
) -> DataFrame:
    """Silver rows whose key the run wrote (with ``since``: any run after run ``since`` up to
    this one), with ``_has_right_<alias>`` per left join.

    ``_has_right_<alias>`` is true when the row has its right side, false when its foreign key
    names no right row (an orphan), and null when the foreign key is null (nothing to find).
    """
    keys = silver_key_columns(config)
    silver = storage.read(config.silver_path)
    first = run.run_id if since is None else since + 1
    written = silver.filter(F.col(RUN_ID).between(first, run.run_id)).select(*keys).distinct()
    # The whole table, restricted to the written keys: an older row sharing a key is a duplicate.
    # Null-safe, so a row written with a null key reaches the not-null check.
    wanted = written.select(*[F.col(k).alias(f"_written{k}") for k in keys])
    same_key = [silver[k].eqNullSafe(wanted[f"_written{k}"]) for k in keys]
    rows = silver.join(wanted, same_key, "left_semi")
    lefts = [j for j in config.joins if j.type is JoinType.LEFT]
    if not lefts:
        return rows
    fks = _foreign_keys(config, storage, run, written)
    rows = rows.join(fks, keys, "left")
    for join in lefts:
        fk_null = _any_null([F.col(f"_fk_{join.alias}_{c}") for c in join.foreign_key])
        has_right = F.when(fk_null, F.lit(None)).otherwise(F.col(f"_seq_{join.alias}").isNotNull())
        rows = rows.withColumn(f"_has_right_{join.alias}", has_right)
    return rows.drop(*[c for c in rows.columns if c.startswith("_fk_")])


def _foreign_keys(config: PipelineConfig, storage: Storage, run: Checkpoint, written: DataFrame) -> DataFrame:
    """The left-join foreign keys of the written keys (``_fk_<alias>_<column>``), from the state
    the run processed: a chained join's from the rows of the source it hangs off, reached hop
    by hop (a row missing on the way leaves its foreign key null, as in silver)."""
    pk = config.left_source.primary_key
    wanted = written.select(*[F.col(f"_pk_{c}").alias(c) for c in pk])
    version = run.state_versions.get(config.left)
    stored, _ = read_keyed(storage, config.state_path(config.left), wanted, [(c, c) for c in pk], version)
    live = newest(stored, pk).filter(~F.col(DELETED))
    rows = live.select(
        *[F.col(f"`{c}`").alias(f"_pk_{c}") for c in pk], F.struct(*quoted(live.columns)).alias(config.left)
    )
    lefts = [j for j in config.joins if j.type is JoinType.LEFT]
    for join in _on_the_way(config, {j.source for j in lefts}):
        right = config.sources[join.right]
        current = newest(
            storage.read(config.state_path(join.right), run.state_versions.get(join.right)), right.primary_key
        )
        current = current.filter(~F.col(DELETED))
        keys = [f"__{join.alias}_{c}" for c in right.primary_key]
        current = current.select(
            *[F.col(f"`{c}`").alias(k) for c, k in zip(right.primary_key, keys, strict=True)],
            F.struct(*quoted(current.columns)).alias(join.alias),
        )
        on = [
            F.col(f"`{join.source}`.`{c}`") == current[k] for c, k in zip(join.foreign_key, keys, strict=True)
        ]
        rows = rows.join(current, functools.reduce(operator.and_, on), "left").drop(*keys)
    return rows.select(
        *[f"_pk_{c}" for c in pk],
        *[F.col(f"`{j.source}`.`{c}`").alias(f"_fk_{j.alias}_{c}") for j in lefts for c in j.foreign_key],
    )


def _on_the_way(config: PipelineConfig, aliases: set[str]) -> list[JoinConfig]:
    """The joins that reach ``aliases`` from the left source, in join order."""
    needed, pending = set(), [a for a in aliases if a != config.left]
    while pending:
        alias = pending.pop()
        if alias not in needed:
            needed.add(alias)
            source = config.join_for_alias(alias).source
            if source != config.left:
                pending.append(source)
    return [j for j in config.joins if j.alias in needed]


def _any_null(columns: Sequence[Column]) -> Column:
    out = F.lit(False)
    for c in columns:
        out = out | c.isNull()
    return out


def _row_suite(config: PipelineConfig, settings: QualitySettings) -> gx.ExpectationSuite:
    """Built-in and user expectations over :func:`touched_rows`."""
    expect = gx.expectations
    keys = silver_key_columns(config)
    unique_meta = _meta("pk_unique", ",".join(keys))
    critical = GX_SEVERITY[FAIL]
    items: list[Expectation] = [
        expect.ExpectColumnValuesToBeUnique(column=keys[0], meta=unique_meta, severity=critical)
        if len(keys) == 1
        else expect.ExpectCompoundColumnsToBeUnique(column_list=keys, meta=unique_meta, severity=critical)
    ]
    items += [
        expect.ExpectColumnValuesToNotBeNull(column=k, meta=_meta("pk_not_null", k), severity=critical)
        for k in keys
    ]
    for join in config.joins:
        seq = f"_seq_{join.alias}"
        if join.type is JoinType.INNER:
            meta = _meta(f"right_present:{join.alias}", seq)
            items.append(expect.ExpectColumnValuesToNotBeNull(column=seq, meta=meta, severity=critical))
        elif join.type is JoinType.LEFT:
            items.append(_orphan_expectation(join.alias, settings))
    items += [e.build(_meta(f"expectation:{e.name}", _columns_of(e.kwargs))) for e in settings.expectations]
    suite = gx.ExpectationSuite(name=f"{config.name}_silver")
    for item in items:
        suite.add_expectation(item)
    return suite


def _orphan_expectation(alias: str, settings: QualitySettings) -> Expectation:
    """Orphan rate = false / non-null of ``_has_right_<alias>``; ``mostly`` caps it."""
    limit = settings.orphan_rate_max.get(alias)
    meta = _meta(f"orphan_rate:{alias}", f"_seq_{alias}", kind="orphan_rate")
    meta["threshold"] = limit
    return gx.expectations.ExpectColumnValuesToBeInSet(
        column=f"_has_right_{alias}",
        value_set=[True],
        mostly=1.0 - (1.0 if limit is None else limit),
        meta=meta,
        severity=GX_SEVERITY[settings.severity["orphan_rate"]],
    )


def _meta(check_name: str, column: str | None, kind: str = "") -> dict[str, Any]:
    """What a result is reported under: the check's name, its column, what kind of check."""
    return {"check": check_name, "column": column, "kind": kind}


def _columns_of(kwargs: Mapping[str, Any]) -> str | None:
    names = [str(kwargs[k]) for k in COLUMN_KWARGS if k in kwargs] + [
        str(c) for c in kwargs.get("column_list") or []
    ]
    return ",".join(names) or None


def _context() -> Any:
    context = gx.get_context(mode="ephemeral")
    # Job logs are read by people; a progress bar per metric batch is noise there.
    context.variables.progress_bars = {"globally": False}
    return context


def _run_suite(context: Any, data: Any, asset: str, frame: Any, suite: gx.ExpectationSuite) -> Any:
    """Validate ``frame`` against ``suite`` with a validation definition (great-expectations'
    "this data, these expectations") in the run's ephemeral context."""
    batches = data.add_dataframe_asset(asset).add_batch_definition_whole_dataframe("run")
    validation = context.validation_definitions.add(
        gx.ValidationDefinition(name=f"{suite.name}_{asset}", data=batches, suite=context.suites.add(suite))
    )
    return validation.run(batch_parameters={"dataframe": frame}, result_format="SUMMARY")


def _validate(context: Any, rows: DataFrame, suite: gx.ExpectationSuite, count: int) -> list[CheckResult]:
    outcome = _run_suite(context, context.data_sources.add_spark("silver"), "touched_rows", rows, suite)
    results = [_result(r, {"rows_checked": count}) for r in outcome.results]
    order = {(e.meta or {}).get("check"): i for i, e in enumerate(suite.expectations)}
    # great-expectations groups results by domain; the suite's order reads better.
    return sorted(results, key=lambda r: (order.get(r.check, len(order)), r.column or ""))


def _result(gx_result: Any, extra: Mapping[str, Any]) -> CheckResult:
    cfg = gx_result.expectation_config
    meta = dict(cfg.meta or {})
    result = dict(gx_result.result or {})
    error = (gx_result.exception_info or {}).get("exception_message")
    success = bool(gx_result.success) and not error
    details = {
        "expectation": cfg.type,
        "kwargs": {k: v for k, v in cfg.kwargs.items() if k != "batch_id"},
        "result": result,
        "exception": error,
        **extra,
    }
    if meta.get("kind") in ("orphan_rate", "quarantine"):
        details["threshold"] = meta.get("threshold")
    severity = SEVERITY_OF_GX[str(getattr(cfg.severity, "value", cfg.severity)).lower()]
    return CheckResult(
        meta["check"], meta.get("column"), success, severity, _observed(meta, result, error), details
    )


def _observed(meta: Mapping[str, Any], result: Mapping[str, Any], error: str | None) -> str:
    if error:
        return f"error: {error.splitlines()[0][:200]}"
    if meta.get("kind") == "orphan_rate":
        rate = (result.get("unexpected_percent") or 0.0) / 100
        limit = meta.get("threshold")
        bound = "no threshold" if limit is None else f"max {limit:g}"
        return f"orphan rate {rate:.4f} ({result.get('unexpected_count') or 0} rows), {bound}"
    if meta.get("kind") == "quarantine":
        lines = int(result.get("observed_value") or 0)
        return f"{lines} line(s) quarantined by the run, max {meta['threshold']}"
    if meta.get("kind") == "freshness":
        lag = result.get("observed_value", float("nan"))
        return f"newest event {_age(lag)} old, max {_age(meta['threshold'])}"
    if "observed_value" in result:
        return f"observed {result['observed_value']}"
    if "element_count" in result:
        return f"{result.get('unexpected_count') or 0} of {result['element_count']} rows unexpected"
    return ""


# -- freshness -------------------------------------------------------------------------------


def _age(minutes: float) -> str:
    """Minutes as a person reads them: ``42 min``, ``5.1 h``, ``1104.6 days``."""
    if minutes != minutes:  # NaN: nothing observed
        return "unknown"
    if abs(minutes) < 120:
        return f"{minutes:.0f} min"
    if abs(minutes) < 48 * 60:
        return f"{minutes / 60:.1f} h"
    return f"{minutes / 1440:.1f} days"


def _check_freshness(
    context: Any,
    config: PipelineConfig,
    storage: Storage,
    run: Checkpoint,
    settings: QualitySettings,
    now: datetime,
) -> CheckResult:
    """Minutes from the newest event the run processed (any source) to ``now``."""
    newest = {s: _newest_event_ms(storage, config.state_path(s), v) for s, v in run.state_versions.items()}
    known = {s: ms for s, ms in newest.items() if ms is not None}
    limit = settings.freshness_max_minutes
    severity = settings.severity["freshness"]
    if not known:
        return CheckResult(
            "freshness", TS_MS, False, severity, "no source event carries ts_ms", {"newest_ms": newest}
        )
    now_ms = now.timestamp() * 1000
    frame = pd.DataFrame(
        {"source": list(known), "lag_minutes": [(now_ms - ms) / 60_000 for ms in known.values()]}
    )
    meta = _meta("freshness", TS_MS, kind="freshness")
    meta["threshold"] = limit
    expectation = gx.expectations.ExpectColumnMinToBeBetween(
        column="lag_minutes", max_value=limit, meta=meta, severity=GX_SEVERITY[severity]
    )
    suite = gx.ExpectationSuite(name="freshness", expectations=[expectation])
    outcome = _run_suite(context, context.data_sources.add_pandas("sources"), "newest_events", frame, suite)
    return _result(outcome.results[0], {"newest_ms": known, "now": now.isoformat()})


def _newest_event_ms(storage: Storage, path: str, version: int) -> int | None:
    """Largest ``_cdc_ts_ms`` of a state table version, from file statistics when all have it."""
    if not storage.exists(path):
        return None
    files = [f for f in storage.files(path, version) if f.num_records != 0]
    maxima = [f.max_values.get(TS_MS) for f in files]
    if files and all(m is not None for m in maxima):
        return max(int(m) for m in maxima if m is not None)
    row = storage.read(path, version).agg(F.max(TS_MS).alias("newest")).first()
    return None if row is None or row["newest"] is None else int(row["newest"])


# -- quarantine ------------------------------------------------------------------------------


def _check_quarantine(
    context: Any, settings: QualitySettings, run_reports: Sequence[Mapping[str, Any]]
) -> list[CheckResult]:
    """Per source named by ``quarantine_max``: the lines the checked runs' ingests quarantined."""
    counts = {s: 0 for s in settings.quarantine_max}
    reasons: dict[str, dict[str, int]] = {s: {} for s in counts}
    for run_report in run_reports:
        ingest = (run_report.get("steps") or {}).get("ingest") or {}
        for source in counts:
            counts[source] += int((ingest.get(source) or {}).get("quarantined") or 0)
            for reason, n in ((ingest.get(source) or {}).get("reasons") or {}).items():
                reasons[source][reason] = reasons[source].get(reason, 0) + int(n)
    severity = settings.severity["quarantine"]
    suite = gx.ExpectationSuite(name="quarantine")
    for source, limit in settings.quarantine_max.items():
        meta = {**_meta(f"quarantine:{source}", None, kind="quarantine"), "threshold": limit}
        suite.add_expectation(
            gx.expectations.ExpectColumnMaxToBeBetween(
                column=source, max_value=limit, meta=meta, severity=GX_SEVERITY[severity]
            )
        )
    frame = pd.DataFrame({s: [n] for s, n in counts.items()})
    data = context.data_sources.add_pandas("ingest")
    outcome = _run_suite(context, data, "quarantined_lines", frame, suite)
    results = [_result(r, {}) for r in outcome.results]
    results = [
        dataclasses.replace(r, details={**r.details, "reasons": reasons[r.check.split(":", 1)[1]]})
        for r in results
    ]
    order = list(settings.quarantine_max)
    return sorted(results, key=lambda r: order.index(r.check.split(":", 1)[1]))


# -- the run and the results table -----------------------------------------------------------


def _runs_to_check(
    storage: Storage, config: PipelineConfig, run_id: int | None
) -> tuple[Checkpoint, list[Mapping[str, Any]], int] | None:
    """The checkpoint of the run to check, the reports of every run checked with it, and the
    run after which they start.

    ``run_id`` checks that run alone. By default, the newest run and every run since the last
    check (from the quality-results table): a run retried after it exited with an error (a
    quarantine, say) must not hide what the failed attempt wrote. Before the first check, the
    newest run alone.
    """
    if not storage.exists(config.runs_path):
        if run_id is not None:
            raise ConfigError(
                f"run {run_id} is not in the run log {config.runs_path} (no run yet)", key="--run-id"
            )
        return None
    runs = storage.read(config.runs_path)
    if run_id is None:
        newest = runs.agg(F.max("run_id").alias("n")).first()
        if newest is None or newest["n"] is None:
            return None
        last = int(newest["n"])
        checked = _last_checked(storage, config)
        since = last - 1 if checked is None or checked >= last else checked
    else:
        last, since = run_id, run_id - 1
    rows = (
        runs.filter(F.col("run_id").between(since + 1, last))
        .orderBy("run_id")
        .select("run_id", "checkpoint", "report")
        .collect()
    )
    if not rows or rows[-1]["run_id"] != last:
        if run_id is not None:
            raise ConfigError(f"run {run_id} is not in the run log {config.runs_path}", key="--run-id")
        return None
    reports = [json.loads(r["report"] or "{}") for r in rows]
    return Checkpoint.from_json(rows[-1]["checkpoint"]), reports, since


def _last_checked(storage: Storage, config: PipelineConfig) -> int | None:
    """The newest run the quality-results table has results for."""
    if not storage.exists(config.quality_path):
        return None
    found = storage.read(config.quality_path).agg(F.max("run_id").alias("n")).first()
    return None if found is None or found["n"] is None else int(found["n"])


def write_results(config: PipelineConfig, storage: Storage, report: QualityReport) -> None:
    """Append one row per result to the quality-results table (created on first use)."""
    if not report.results or report.run_id is None:
        return
    checked_at = datetime.now(timezone.utc)
    rows = [
        (report.run_id, r.check, r.column, r.success, r.severity, r.observed, _json(r.details), checked_at)
        for r in report.results
    ]
    storage.create(config.quality_path, RESULTS_SCHEMA, cdf=False)
    table = pa.Table.from_pylist(
        [dict(zip(RESULTS_SCHEMA.names, r, strict=True)) for r in rows], arrow_schema(RESULTS_SCHEMA)
    )
    storage.append(config.quality_path, from_arrow(storage.spark, RESULTS_SCHEMA, table))


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)
