"""Data-quality checks on silver (cdc_join.checks.quality): the quality YAML, each check, ``cdc-join check``.

One pipeline (``lhs`` inner-joined to ``rhs`` on ``fk``, left-joined to ``cust`` on ``cid``) runs
twice and is shared by the module: run 1 writes k1..k4, run 2 only changes k4. Failures are
injected into a copy of that lake, so the clean lake stays clean whatever order tests run in.
"""

from __future__ import annotations

import dataclasses
import shutil
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import yaml
from pyspark.sql import functions as F

from cdc_join.checks.quality import RESULTS_SCHEMA, QualityReport, _check_quarantine, _context, check
from cdc_join.checks.quality_config import parse_quality
from cdc_join.cli import main as cli
from cdc_join.config import parse_config
from cdc_join.errors import ConfigError, ConfigErrors
from tests.support import make_pipeline

TABLES = {
    "lhs": {"id": "string", "fk": "int64", "cid": "int64", "v": "int64"},
    "rhs": {"id": "int64", "value": "string"},
    "cust": {"id": "int64", "name": "string"},
}
JOINS = [
    {"right": "rhs", "foreign_key": ["fk"], "type": "inner"},
    {"right": "cust", "foreign_key": ["cid"], "type": "left"},
]
SELECT = {"key": "lhs.id", "v": "lhs.v", "value": "rhs.value", "name": "cust.name"}
# EventWriter stamps ts_ms = 1_700_000_000_000 + lsn; "now" is ten minutes after the last event.
NOW = datetime.fromtimestamp(1_700_000_000 + 600, timezone.utc)
V_NOT_NEGATIVE = {
    "expectation": "expect_column_values_to_be_between",
    "kwargs": {"column": "v", "min_value": 0},
    "severity": "fail",
    "name": "v_not_negative",
}
# The same check at warn severity (equal arguments twice are rejected: a suite keeps only one).
V_WARN = {**V_NOT_NEGATIVE, "kwargs": {"column": "v", "min_value": -1}, "severity": "warn"}
CLEAN_QUALITY = {
    "orphan_rate_max": {"cust": 0.6},
    "freshness_max_minutes": 60,
    "expectations": [V_NOT_NEGATIVE],
}


@pytest.fixture(scope="module")
def lake(tmp_path_factory, spark, storage):
    """The pipeline after two runs; run 1 wrote k1, k2, k3 (k4 was rewritten by run 2)."""
    root = tmp_path_factory.mktemp("quality")
    pipeline, w = make_pipeline(root, spark, storage, tables=TABLES, joins=JOINS, select=SELECT)
    w.write("rhs", [w.upsert("rhs", {"id": 1, "value": "a"}, 1), w.upsert("rhs", {"id": 2, "value": "b"}, 2)])
    w.write("cust", [w.upsert("cust", {"id": 10, "name": "x"}, 3)])
    w.write(
        "lhs",
        [
            w.upsert("lhs", {"id": "k1", "fk": 1, "cid": 10, "v": 1}, 4),
            w.upsert("lhs", {"id": "k2", "fk": 2, "cid": None, "v": 2}, 5),
            w.upsert("lhs", {"id": "k3", "fk": 1, "cid": 99, "v": -5}, 6),  # orphan: no cust 99
            w.upsert("lhs", {"id": "k4", "fk": 1, "cid": 10, "v": 3}, 7),
        ],
    )
    pipeline.run()
    w.write("lhs", [w.upsert("lhs", {"id": "k4", "fk": 1, "cid": 10, "v": 4}, 8)])
    pipeline.run()
    return pipeline


def _with_quality(pipeline, quality: dict[str, Any], lake: str | None = None):
    return dataclasses.replace(pipeline.config, quality=quality, lake=lake or pipeline.config.lake)


def _by_check(report: QualityReport) -> dict[str, Any]:
    return {r.check: r for r in report.results}


# -- the quality: section ---------------------------------------------------------------------


def _raw_config(quality: Any) -> dict[str, Any]:
    return {
        "name": "q",
        "lake": "/tmp/lake",
        "sources": {
            t: {"landing": f"landing/{t}", "primary_key": [next(iter(c))]} for t, c in TABLES.items()
        },
        "left": "lhs",
        "joins": JOINS,
        "select": SELECT,
        "output": "out",
        "quality": quality,
    }


def _config(quality: Any):
    return parse_config(_raw_config(quality), base_dir=Path("/tmp"), check_paths=False)


def test_quality_section_is_parsed_with_defaults():
    settings = parse_quality(_config({"orphan_rate_max": 0.1, "expectations": [V_NOT_NEGATIVE]}))
    assert settings.orphan_rate_max == {"cust": 0.1}  # one number applies to every left join
    assert settings.freshness_max_minutes is None
    assert settings.severity == {"orphan_rate": "fail", "freshness": "warn", "quarantine": "fail"}
    assert settings.quarantine_max == {}
    assert parse_quality(_config({"quarantine_max": 0})).quarantine_max == {"lhs": 0, "rhs": 0, "cust": 0}
    assert [(e.name, e.expectation, e.severity) for e in settings.expectations] == [
        ("v_not_negative", "expect_column_values_to_be_between", "fail")
    ]


def test_user_expectations_carry_great_expectations_own_severity():
    settings = parse_quality(_config({"expectations": [V_NOT_NEGATIVE, {**V_WARN, "name": "w"}]}))
    built = [e.build({}) for e in settings.expectations]
    assert [str(getattr(b.severity, "value", b.severity)) for b in built] == ["critical", "warning"]


@pytest.mark.parametrize(
    ("quality", "key", "message"),
    [
        ({"orphan_rate": 0.1}, "quality.orphan_rate", "unknown key"),
        ({"orphan_rate_max": {"rhs": 0.1}}, "quality.orphan_rate_max.rhs", "not a left join"),
        ({"orphan_rate_max": {"cust": 1.5}}, "quality.orphan_rate_max.cust", "from 0 to 1"),
        ({"freshness_max_minutes": 0}, "quality.freshness_max_minutes", "positive"),
        ({"severity": {"freshness": "error"}}, "quality.severity.freshness", "'warn' or 'fail'"),
        ({"quarantine_max": {"orders": 0}}, "quality.quarantine_max.orders", "not a source"),
        ({"quarantine_max": {"lhs": -1}}, "quality.quarantine_max.lhs", "whole number"),
        ({"quarantine_max": 0.5}, "quality.quarantine_max", "whole number"),
        (
            {"expectations": [{"expectation": "expect_unicorns"}]},
            "quality.expectations[0].expectation",
            "unknown",
        ),
        (
            {"expectations": [{**V_NOT_NEGATIVE, "severity": "fatal"}]},
            "quality.expectations[0].severity",
            "'warn' or 'fail'",
        ),
        (
            {"expectations": [{**V_NOT_NEGATIVE, "kwargs": {"column": "quantity", "min_value": 0}}]},
            "quality.expectations[0].kwargs.column",
            "silver has no column 'quantity'",
        ),
        (
            {"expectations": [{**V_NOT_NEGATIVE, "kwargs": {"column": "v", "minimum": 0}}]},
            "quality.expectations[0].kwargs",
            "rejects these arguments",
        ),
        ({"expectations": [V_NOT_NEGATIVE, V_NOT_NEGATIVE]}, "quality.expectations[1].name", "named"),
        (
            {"expectations": [V_NOT_NEGATIVE, {**V_NOT_NEGATIVE, "name": "again"}]},
            "quality.expectations[1]",
            "same arguments",
        ),
    ],
)
def test_invalid_quality_section_names_the_key(quality, key, message):
    with pytest.raises(ConfigError) as err:
        parse_quality(_config(quality))
    assert err.value.key == key
    assert message in str(err.value)


def test_every_mistake_of_the_quality_section_is_reported_at_once():
    quality = {
        "orphan": 1,
        "freshness_max_minutes": 0,
        "expectations": [{"expectation": "expect_unicorns"}, V_NOT_NEGATIVE, V_NOT_NEGATIVE],
    }
    with pytest.raises(ConfigErrors) as err:
        parse_quality(_config(quality))
    assert [p.key for p in err.value.problems] == [
        "quality.orphan",
        "quality.freshness_max_minutes",
        "quality.expectations[0].expectation",
        "quality.expectations[2].name",
    ]


# -- the checks ---------------------------------------------------------------------------------


def test_clean_run_passes_every_check_and_appends_one_row_per_check(lake, storage):
    config = _with_quality(lake, CLEAN_QUALITY)
    before = storage.read(config.quality_path).count() if storage.exists(config.quality_path) else 0
    report = check(config, storage, now=NOW)
    assert report.ok and not report.warnings, report.summary()
    assert report.run_id == 2
    assert report.rows_checked == 1  # run 2 touched k4 only
    assert set(_by_check(report)) == {
        "pk_unique",
        "pk_not_null",
        "right_present:rhs",
        "orphan_rate:cust",
        "expectation:v_not_negative",
        "freshness",
    }
    table = storage.read(config.quality_path)
    assert table.columns == RESULTS_SCHEMA.fieldNames()
    assert table.count() - before == len(report.results)
    assert table.filter(F.col("run_id") == 2).filter(~F.col("success")).count() == 0


def test_checks_look_only_at_the_rows_their_run_touched(lake, storage):
    config = _with_quality(lake, CLEAN_QUALITY)
    run1 = _by_check(check(config, storage, run_id=1, now=NOW, write=False))
    # k3 (v = -5) was written by run 1: run 1's check sees it, run 2's (above) does not.
    assert not run1["expectation:v_not_negative"].success
    # Run 1 still owns k1 (cust found), k2 (cid null: not counted) and k3 (orphan): 1 of 2.
    assert run1["orphan_rate:cust"].success
    assert run1["orphan_rate:cust"].observed.startswith("orphan rate 0.5000 (1 rows)")


@pytest.fixture(scope="module")
def faulty(lake, storage, tmp_path_factory):
    """A copy of the lake with a duplicate key, a null key and an inner-join row without its right side."""
    copy = str(tmp_path_factory.mktemp("faulty") / "lake")
    shutil.copytree(lake.config.lake, copy)
    config = _with_quality(lake, {}, lake=copy)
    silver = storage.read(config.silver_path)
    # An older row (run 0) sharing k1's key: only a check over the whole table can see it.
    duplicate = silver.filter(F.col("_pk_id") == "k1").withColumn("_run_id", F.lit(0).cast("long"))
    no_right = (
        silver.filter(F.col("_pk_id") == "k1")
        .withColumn("_pk_id", F.lit("k9"))
        .withColumn("key", F.lit("k9"))
        .withColumn("_seq_rhs", F.lit(None).cast("string"))
    )
    no_key = silver.filter(F.col("_pk_id") == "k1").withColumn("_pk_id", F.lit(None).cast("string"))
    faults = duplicate.unionByName(no_right).unionByName(no_key).localCheckpoint()
    storage.append(config.silver_path, faults)
    quality = {
        "orphan_rate_max": {"cust": 0.25},
        "expectations": [V_NOT_NEGATIVE, {**V_WARN, "name": "v_warn"}],
    }
    config = _with_quality(lake, quality, lake=copy)
    return config, check(config, storage, run_id=1, now=NOW, write=False)


def test_duplicate_primary_key_fails_pk_unique(faulty):
    result = _by_check(faulty[1])["pk_unique"]
    assert not result.success and result.severity == "fail"
    assert result.observed.startswith("2 of ")


def test_null_primary_key_fails_pk_not_null(faulty):
    result = _by_check(faulty[1])["pk_not_null"]
    assert not result.success and result.severity == "fail"
    assert result.observed.startswith("1 of ")


def test_inner_join_row_without_its_right_side_fails(faulty):
    result = _by_check(faulty[1])["right_present:rhs"]
    assert not result.success
    assert result.observed.startswith("1 of ")


def test_orphan_rate_above_its_threshold_fails(faulty):
    result = _by_check(faulty[1])["orphan_rate:cust"]
    assert not result.success and result.severity == "fail"
    assert result.details["threshold"] == 0.25
    # k1 (twice, cust found) and k3 (orphan) name a customer; k2 and k9 have no cid.
    assert result.observed.startswith("orphan rate 0.3333 (1 rows)")


def test_user_expectation_fails_with_its_severity(faulty):
    report = faulty[1]
    checks = _by_check(report)
    assert not checks["expectation:v_not_negative"].success
    assert not checks["expectation:v_warn"].success
    assert checks["expectation:v_warn"] in report.warnings
    assert {r.check for r in report.failed} == {
        "pk_unique",
        "pk_not_null",
        "right_present:rhs",
        "orphan_rate:cust",
        "expectation:v_not_negative",
    }


def test_freshness_compares_the_newest_event_with_the_wall_clock(lake, storage):
    quality = {"freshness_max_minutes": 5, "severity": {"freshness": "fail"}}
    late = _by_check(check(_with_quality(lake, quality), storage, now=NOW, write=False))["freshness"]
    assert not late.success and late.severity == "fail"
    assert late.observed.startswith("newest event 10 min old")
    fresh = check(_with_quality(lake, {"freshness_max_minutes": 11}), storage, now=NOW, write=False)
    assert _by_check(fresh)["freshness"].success


def test_quarantine_max_counts_the_lines_the_run_quarantined_per_source(lake, storage):
    quality = {"quarantine_max": {"lhs": 0, "rhs": 3}}
    clean = _by_check(check(_with_quality(lake, quality), storage, now=NOW, write=False))
    assert clean["quarantine:lhs"].success and clean["quarantine:rhs"].success
    assert clean["quarantine:lhs"].observed == "0 line(s) quarantined by the run, max 0"

    # What a run that quarantined lines records in its report (the run log's ``report`` column).
    settings = parse_quality(_with_quality(lake, {**quality, "severity": {"quarantine": "warn"}}))
    reasons = {"not JSON": 4}
    run_report = {"steps": {"ingest": {"lhs": {"events": 9, "quarantined": 4, "reasons": reasons}}}}
    results = {r.check: r for r in _check_quarantine(_context(), settings, [run_report])}
    assert not results["quarantine:lhs"].success and results["quarantine:lhs"].severity == "warn"
    assert results["quarantine:lhs"].observed == "4 line(s) quarantined by the run, max 0"
    assert results["quarantine:lhs"].details["reasons"] == reasons
    assert results["quarantine:rhs"].success  # no ingest counts for rhs: nothing quarantined


def test_a_check_covers_every_run_since_the_last_check(tmp_path, spark, storage):
    # A run that quarantined lines exits 3; its retry quarantines nothing and exits 0. The check
    # after the retry must still see the lines and the rows of the failed attempt.
    pipeline, w = make_pipeline(tmp_path, spark, storage, join_type="left")
    raw = yaml.safe_load(pipeline.config.config_path.read_text())
    raw["quality"] = {"quarantine_max": {"lhs": 0}}
    pipeline.config.config_path.write_text(yaml.safe_dump(raw))
    config = parse_config(raw, base_dir=tmp_path, config_path=pipeline.config.config_path)
    w.write("rhs", [w.upsert("rhs", {"id": 1, "value": "one"}, 1)])
    w.write("lhs", [w.upsert("lhs", {"id": "a", "fk": 1, "v": 1}, 2)])
    pipeline.run()
    assert check(config, storage, now=NOW).ok
    w.write("lhs", [w.upsert("lhs", {"id": "b", "fk": 1, "v": 1}, 3), "not json"])
    pipeline.run()  # exits 3 from the CLI
    # The retry quarantines nothing and exits 0 (an event that touches no silver row lands, or
    # the retry would have nothing to do and record no run: cdc_join.run.idle).
    w.write("rhs", [w.upsert("rhs", {"id": 2, "value": "two"}, 4)])
    pipeline.run()
    retried = check(config, storage, now=NOW)
    assert (retried.first_run_id, retried.run_id, retried.rows_checked) == (2, 3, 1)
    assert not _by_check(retried)["quarantine:lhs"].success
    assert "quality of runs 2-3" in retried.summary()
    w.write("rhs", [w.upsert("rhs", {"id": 3, "value": "three"}, 5)])
    pipeline.run()
    again = check(config, storage, now=NOW)  # run 4 alone: checked runs are not checked twice
    assert (again.run_id, again.rows_checked) == (4, 0) and again.ok


# -- cdc-join check ---------------------------------------------------------------------------------


def _write_config(pipeline, folder: Path, lake: str, quality: dict[str, Any]) -> Path:
    raw = yaml.safe_load(Path(pipeline.config.config_path).read_text())
    base = Path(pipeline.config.config_path).parent
    for source in raw["sources"].values():
        source["landing"] = str(base / source["landing"])
    path = folder / "pipeline.yml"
    path.write_text(yaml.safe_dump({**raw, "lake": lake, "quality": quality}))
    return path


def test_cdc_join_check_exits_1_when_a_fail_expectation_fails(faulty, lake, tmp_path, capsys):
    config, _ = faulty
    path = _write_config(lake, tmp_path, config.lake, {"expectations": [V_NOT_NEGATIVE]})
    assert cli.main(["--storage", "delta-rs", "check", str(path), "--run-id", "1"]) == 1
    assert "FAIL  expectation:v_not_negative (v)" in capsys.readouterr().out


def test_cdc_join_check_exits_0_when_only_warnings_fail(lake, tmp_path, capsys):
    warn_only = {
        "expectations": [{**V_NOT_NEGATIVE, "kwargs": {"column": "v", "min_value": 100}, "severity": "warn"}]
    }
    path = _write_config(lake, tmp_path, lake.config.lake, warn_only)
    assert cli.main(["--storage", "delta-rs", "check", str(path)]) == 0
    assert "WARN  expectation:v_not_negative (v)" in capsys.readouterr().out


def test_cdc_join_check_exits_2_on_an_invalid_quality_section(tmp_path, capsys):
    for table in TABLES:
        (tmp_path / "landing" / table).mkdir(parents=True)
    raw = _raw_config({"freshness_max_minutes": -1})
    path = tmp_path / "pipeline.yml"
    path.write_text(yaml.safe_dump({**raw, "lake": str(tmp_path / "lake")}))
    assert cli.main(["--storage", "delta-rs", "check", str(path)]) == 2
    assert "quality.freshness_max_minutes" in capsys.readouterr().err
