"""A run with nothing to do (cdc_join.run.idle): it writes nothing and starts no Spark; and each
thing a run may have to do makes the next run an ordinary one."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from cdc_join.checkpoint import last_checkpoint
from cdc_join.checks.verify import read_bytes
from cdc_join.config import load_config
from cdc_join.errors import InputError
from cdc_join.landing.ingest import ingest_all, landed_bytes
from cdc_join.report import SimulatedCrash
from cdc_join.run.pipeline import Pipeline
from cdc_join.session import DeferredSession
from tests.support import make_pipeline, silver_rows

_NO_SPARK = textwrap.dedent(
    """
    import sys
    from cdc_join.cli import main as cli
    code = cli.main(sys.argv[1:])
    from pyspark import SparkContext
    from pyspark.sql import SparkSession
    started = SparkContext._gateway is not None or SparkSession.getActiveSession() is not None
    print("spark started" if started else "no spark", code)
    """
)


def _lake_files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def _joined(tmp_path, spark, storage):
    pipeline, w = make_pipeline(tmp_path, spark, storage, join_type="left")
    w.write("rhs", [w.upsert("rhs", {"id": 1, "value": "one"}, 1)])
    w.write("lhs", [w.upsert("lhs", {"id": k, "fk": 1, "v": 0}, 2 + n) for n, k in enumerate("ab")])
    assert pipeline.run().idle is None
    return pipeline, w


@pytest.mark.core
@pytest.mark.storage_path  # each backend reads the logs its own way (delta-spark: through delta-rs)
def test_a_run_with_nothing_to_do_writes_nothing_and_starts_no_spark(tmp_path, spark, storage):
    pipeline, w = _joined(tmp_path, spark, storage)
    (tmp_path / "landing" / "lhs" / "notes.txt").write_text("not events")  # said in a warning
    lake = tmp_path / "lake"
    before = _lake_files(lake)
    before_landing = list((tmp_path / "landing" / "lhs").rglob("*.json*"))
    config = str(pipeline.config.config_path)
    found = subprocess.run(
        [sys.executable, "-c", _NO_SPARK, "--storage", storage.name, "run", config],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert found.stdout.splitlines()[-1] == "no spark 0", found.stdout + found.stderr
    said = "cdc_join run 2: nothing to do (no new landing files, every table as run 1 left it)"
    assert said in found.stdout
    assert "1 file(s) in its landing folder are not read" in found.stdout
    assert _lake_files(lake) == before  # not a byte written: no run-log row either
    assert last_checkpoint(storage, pipeline.config).run_id == 1
    # In this process too (a session is running here): the same report, and nothing written.
    report = pipeline.run()
    assert report.idle == "no new landing files, every table as run 1 left it"
    counts = {"files": 0, "events": 0, "quarantined": 0, "unread_files": 1}
    assert report.to_dict()["steps"]["ingest"]["lhs"] == counts
    assert _lake_files(lake) == before
    assert landed_bytes(storage, pipeline.config) == 0
    w.write("lhs", [w.upsert("lhs", {"id": "c", "fk": 1, "v": 0}, 9)])
    (landed,) = set((tmp_path / "landing" / "lhs").rglob("*.json*")) - set(before_landing)
    assert landed_bytes(storage, pipeline.config) == landed.stat().st_size
    # A session not started yet is told the bytes of the run it starts for (small work).
    deferred = DeferredSession()
    report = Pipeline(pipeline.config, deferred, storage).run()
    assert report.idle is None and deferred.work_bytes is not None and deferred.work_bytes() == 0
    assert ("c", 1, 0, "one") in silver_rows(pipeline)
    assert last_checkpoint(storage, pipeline.config).run_id == 2
    # A verify's session is told the bytes of the tables a verify reads (bronze and silver).
    deferred = DeferredSession()
    assert Pipeline(pipeline.config, deferred, storage).verify().ok
    assert deferred.work_bytes is not None and deferred.work_bytes() == read_bytes(pipeline.config) > 0


def _rewrite(pipeline: Pipeline, **changes) -> Pipeline:
    path = Path(pipeline.config.config_path)
    spec = yaml.safe_load(path.read_text())
    for key, value in changes.items():
        spec[key] = value
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return Pipeline(load_config(path), pipeline.spark, pipeline.storage)


@pytest.mark.scenario
def test_each_thing_a_run_may_have_to_do_makes_it_an_ordinary_run(tmp_path, spark, storage):
    pipeline, w = _joined(tmp_path, spark, storage)
    assert pipeline.run().idle is not None

    # Bronze filled by another tool (an ingest without a join run): a run without ingest joins it.
    w.write("rhs", [w.upsert("rhs", {"id": 1, "value": "uno"}, 10)])
    ingest_all(spark, storage, pipeline.config)
    assert pipeline.run(ingest=False).idle is None
    assert silver_rows(pipeline) == {("a", 1, 0, "uno"), ("b", 1, 0, "uno")}
    assert pipeline.run(ingest=False).idle is not None

    # A full refresh stopped after it rebuilt a state table: bronze did not move, the state did.
    with pytest.raises(SimulatedCrash):
        pipeline.full_refresh(crash_after="state:lhs")
    report = pipeline.run()
    assert report.idle is None and "full refresh resumed" in report.steps["plan"]["reason"]
    assert pipeline.run().idle is not None

    # silver's definition changed: every row recomputed.
    select = {"key": "lhs.id", "fk": "lhs.fk", "v": "lhs.v", "value": "upper(rhs.value)"}
    pipeline = _rewrite(pipeline, select=select)
    report = pipeline.run()
    assert report.idle is None and report.steps["plan"]["path"] == "recompute"
    assert silver_rows(pipeline) == {("a", 1, 0, "UNO"), ("b", 1, 0, "UNO")}

    # silver's change feed turned off: a run turns it off, though no row changes.
    pipeline = _rewrite(pipeline, silver_change_feed=False)
    assert pipeline.run().idle is None
    assert last_checkpoint(storage, pipeline.config).settings == {"silver_change_feed": False}
    assert pipeline.run().idle is not None

    # A forced recompute recomputes.
    assert pipeline.run(plan="recompute").idle is None

    # A landing file changed after it was read: the run stops on it, as an ordinary run does.
    landed = sorted((tmp_path / "landing" / "lhs").rglob("*.json*"))[0]
    landed.write_text(landed.read_text() + "\n")
    with pytest.raises(InputError, match="changed"):
        pipeline.run()


@pytest.mark.scenario
def test_a_checkpoint_of_an_earlier_version_is_not_taken_for_nothing_to_do(tmp_path, spark, storage):
    # Checkpoints written before runs recorded their settings: the next run is an ordinary one.
    pipeline, _ = _joined(tmp_path, spark, storage)
    from cdc_join.run import idle, runlog

    begin = runlog.start(storage, pipeline.config)
    assert idle.nothing_to_do(storage, pipeline.config, begin, True) is not None
    older = dataclasses.replace(begin, checkpoint=dataclasses.replace(begin.checkpoint, settings={}))
    assert idle.nothing_to_do(storage, pipeline.config, older, True) is None


def test_a_run_told_to_stop_after_its_ingest_ingests_first(tmp_path, spark, storage):
    # The check for nothing to do comes before the ingest and is no step of its own.
    pipeline, w = _joined(tmp_path, spark, storage)
    bronze = pipeline.config.bronze_path("lhs")
    before = storage.version(bronze)
    w.write("lhs", [w.upsert("lhs", {"id": "c", "fk": 1, "v": 0}, 9)])
    with pytest.raises(SimulatedCrash):
        pipeline.run(crash_after="ingest")
    assert storage.version(bronze) > before


@pytest.mark.core
@pytest.mark.storage_path  # each backend reads bronze's file statistics its own way
def test_plan_counts_the_events_bronze_holds_for_the_next_run_without_spark(tmp_path, spark, storage):
    import json

    from cdc_join.cli.status import next_run
    from cdc_join.landing import bronze

    pipeline, w = _joined(tmp_path, spark, storage)
    w.write("lhs", [w.upsert("lhs", {"id": k, "fk": 1, "v": 5}, 10 + n) for n, k in enumerate("cd")])
    ingest_all(spark, storage, pipeline.config)  # in bronze, not yet applied
    w.write("rhs", [w.upsert("rhs", {"id": 2, "value": "two"}, 20)])  # landed, not yet ingested
    found = subprocess.run(
        [
            sys.executable,
            "-c",
            _NO_SPARK,
            "--storage",
            storage.name,
            "--json",
            "plan",
            str(pipeline.config.config_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    lines = found.stdout.splitlines()
    assert lines[-1] == "no spark 0", found.stdout + found.stderr
    plan = json.loads(lines[-2])
    assert plan["events_to_apply"] == {"lhs": 2, "rhs": 0}, plan
    assert plan["pending"]["rhs"]["files"] == 1 and plan["path"] == "incremental", plan
    # What the run applies, read as it reads it (the change feed): the same two events.
    previous = last_checkpoint(storage, pipeline.config)
    version = storage.version(pipeline.config.bronze_path("lhs"))
    assert bronze.increment(storage, pipeline.config, "lhs", previous, version).frame.count() == 2
    assert next_run(storage, pipeline.config).events_to_apply == plan["events_to_apply"]
    # A compaction rewrites bronze's files: its rows are no events, and the count says so.
    from cdc_join.run.maintenance import optimize_pipeline

    optimize_pipeline(storage, pipeline.config, force=True)
    assert next_run(storage, pipeline.config).events_to_apply == {"lhs": 2, "rhs": 0}
