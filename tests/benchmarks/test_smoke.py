"""Smoke test of the benchmark: the whole runner at a tiny scale, in seconds.

The TPC-H workload at scale 0.001 (1,500 orders, 150 customers): snapshot, initial run, a
forced ``optimize``, then one change batch of every refresh function with duplicates, followed
by the incremental run, the Spark full refresh and the DuckDB full join, whose outputs must
agree row for row. The real measurements are ``python -m benchmarks.run`` (see
``benchmarks/README.md``); they are not part of the test suite. A deep check: CI runs it
(``python -m pytest -m deep``), the default run leaves it out.
"""

from __future__ import annotations

import json

import pytest

from benchmarks import chain, nested, process_profile
from benchmarks.run import bench_scale
from cdc_join.config import load_config
from cdc_join.run.maintenance import optimize_pipeline


@pytest.mark.deep
def test_benchmark_runs_end_to_end_and_outputs_agree(tmp_path, spark, storage):
    lines: list[str] = []
    result = bench_scale(
        spark,
        storage,
        0.001,
        [0.01],
        repeat=1,
        changes=None,
        work=tmp_path,
        seed=1,
        optimize_after_load=True,
        progress=lines.append,
        rf3a_customers=0,
    )
    (row,) = result["results"]
    assert row["verify"], lines
    assert row["left_rows"] == 1500 and row["right_rows"] == 150
    assert row["changed_rows"] == 15 + 15 + 15 + 1  # RF1 + RF2 + RF3b orders, RF3a customers
    for key in ("incremental_s", "full_refresh_s", "duckdb_full_s", "speedup", "silver_rows_written"):
        assert row[key] is not None and row[key] > 0, key
    assert 0 < row["silver_rows_changed"] <= row["silver_rows_written"]
    (batch,) = result["batches"]
    assert batch["plan"] == "incremental"
    assert batch["subscription_files_total"] >= batch["subscription_files_scanned"] > 0
    # A small batch's rows are folded and joined in one partition: no shuffle and no broadcast,
    # so each of the steps that run Spark runs one job.
    jobs = batch["spark_jobs_by_step"]
    assert {step: jobs[step] for step in ("lookup", "state", "resolve")} == dict.fromkeys(
        ("lookup", "state", "resolve"), 1
    ), jobs
    subscriptions = [a for a in result["optimize"]["actions"] if "/subscription/" in a["path"]]
    assert subscriptions and all(a["action"] == "compact" for a in subscriptions)
    # A run that finds nothing new costs no Spark job (the bound is 5).
    idle = result["idle_run"]
    assert idle["spark_jobs"] == 0, idle
    config = load_config(tmp_path / "sf0.001" / "pipeline.yml")
    assert all("action" in a for a in optimize_pipeline(storage, config))  # the policy on a healthy lake
    json.dumps(result, default=str)


@pytest.mark.deep
def test_the_chain_benchmark_runs_end_to_end_and_verifies_every_run(tmp_path, spark, storage):
    lines: list[str] = []
    result = chain.bench(spark, storage, 0.001, 1, tmp_path, lines.append)
    assert result["rows"] == {"region": 5, "nation": 25, "customer": 150, "orders": 1500}
    runs = {kind: found["runs"][0] for kind, found in result["kinds"].items()}
    assert all(run["verify_ok"] for run in runs.values()), lines
    assert runs["region_rename"]["affected_keys"] > runs["nation_rename"]["affected_keys"] > 0
    assert 0 < runs["customer_move"]["affected_keys"] <= 30


@pytest.mark.deep
def test_the_nested_benchmark_runs_end_to_end_and_verifies_every_run(tmp_path, spark, storage):
    lines: list[str] = []
    result = nested.bench(spark, storage, 0.001, 1, tmp_path, lines.append)
    assert result["rows"] == {"customer": 150, "orders": 1500}
    runs = {kind: found["runs"][0] for kind, found in result["kinds"].items()}
    assert all(run["verify_ok"] for run in runs.values()), lines
    assert runs["customer_rename"]["affected_keys"] == 1
    assert 1 <= runs["order_move"]["affected_keys"] <= 2  # the order's old and new customer
    # all 1,500 orders change: every customer with orders (TPC-H: two in three, plus the one the
    # moved order may have gone to), and no other
    assert runs["orders_1500"]["affected_keys"] in (100, 101), lines


@pytest.mark.deep
def test_the_process_profile_times_each_phase_and_a_cold_and_a_warm_run(backend):
    # A new process (as `cdc-join run` from a scheduler) on the backend of this test session:
    # every phase before the run is timed, and both runs report every step with its jobs.
    found = process_profile.profile(backend)
    assert list(found["phases"]) == ["imports", "config", "spark session", "storage", "run 1", "run 2"]
    assert all(run["wall"] >= max(run["seconds"].values()) for run in found["runs"]), found
    assert all(seconds >= 0 for seconds in found["phases"].values()), found
    cold, warm = found["runs"]
    assert {"ingest", "plan", "silver", "commit"} <= set(cold["seconds"]) == set(warm["seconds"]), found
    assert cold["spark_jobs"]["ingest"] > 0 and warm["spark_jobs"]["ingest"] > 0, found
    assert found["wall"] > sum(found["phases"].values()) > 0
    table = process_profile.table(backend, [found])
    assert "| spark session |" in table and "| ingest |" in table and "| the whole run |" in table, table
