"""Runs as a user sees them: crashes and reruns, the lock, full refresh, verify, the CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from pyspark.sql import functions as F
from pyspark.sql.types import LongType

from cdc_join.checkpoint import last_checkpoint
from cdc_join.cli.main import main
from cdc_join.errors import ConcurrentRunError
from cdc_join.report import SimulatedCrash
from cdc_join.run.runlog import run_lock
from tests.support import make_pipeline, silver_rows


@pytest.mark.kill
def test_a_run_killed_after_any_step_and_rerun_ends_like_an_uninterrupted_run(tmp_path, spark, storage):
    pipeline, w = make_pipeline(tmp_path, spark, storage, join_type="left")
    w.write("rhs", [w.upsert("rhs", {"id": i, "value": f"r{i}"}, i) for i in (1, 2, 3)])
    w.write("lhs", [w.upsert("lhs", {"id": k, "fk": 1, "v": 0}, 10 + n) for n, k in enumerate("abcd")])
    pipeline.run()
    batches = {
        "state:lhs": [("lhs", {"id": "a", "fk": 2, "v": 1}), ("rhs", {"id": 1, "value": "r1*"})],
        "subscription:rhs": [("lhs", {"id": "b", "fk": 3, "v": 1}), ("lhs", {"id": "c", "fk": None, "v": 1})],
        "silver": [("rhs", {"id": 2, "value": "r2*"}), ("lhs", {"id": "d", "fk": 2, "v": 5})],
        "cleanup": [("lhs", {"id": "a", "fk": 1, "v": 2}), ("rhs", {"id": 3, "value": "r3*"})],
    }
    expected = {
        "a": ("a", 1, 0, "r1"),
        "b": ("b", 1, 0, "r1"),
        "c": ("c", 1, 0, "r1"),
        "d": ("d", 1, 0, "r1"),
    }
    rhs = {1: "r1", 2: "r2", 3: "r3"}
    lsn = 100
    for step, changes in batches.items():
        for table, row in changes:
            lsn += 1
            w.write(table, [w.upsert(table, row, lsn)])
            if table == "rhs":
                rhs[row["id"]] = row["value"]
            else:
                expected[row["id"]] = (row["id"], row["fk"], row["v"], None)
        with pytest.raises(SimulatedCrash):
            pipeline.run(crash_after=step)
        pipeline.run()
        want = {(k, fk, v, rhs.get(fk)) for k, fk, v, _ in expected.values()}
        assert silver_rows(pipeline) == want, step
    assert pipeline.verify().ok
    assert last_checkpoint(storage, pipeline.config).run_id == 1 + len(batches)


def test_a_second_run_fails_fast_while_one_holds_the_lock(tmp_path, spark, storage):
    pipeline, _ = make_pipeline(tmp_path, spark, storage)
    with run_lock(pipeline.config), pytest.raises(ConcurrentRunError, match="another run"):
        pipeline.run()


def test_a_lock_left_by_a_dead_process_is_taken_over(tmp_path, spark, storage):
    pipeline, _ = make_pipeline(tmp_path, spark, storage)
    lock = pipeline.config.lock_path
    os.makedirs(os.path.dirname(lock), exist_ok=True)
    with open(lock, "w") as f:
        json.dump({"pid": 2**22 + 12345, "host": os.uname().nodename, "since": 0}, f)
    with run_lock(pipeline.config):
        assert json.loads(Path(lock).read_text())["pid"] == os.getpid()
    assert not os.path.exists(lock)


def test_verify_detects_tampering_and_full_refresh_and_repair_fix_it(tmp_path, spark, storage, capsys):
    pipeline, w = make_pipeline(tmp_path, spark, storage, join_type="inner")
    w.write("rhs", [w.upsert("rhs", {"id": 1, "value": "one"}, 1)])
    w.write("lhs", [w.upsert("lhs", {"id": k, "fk": 1, "v": 0}, 2 + n) for n, k in enumerate("xyz")])
    config = str(pipeline.config.config_path)
    assert main(["--storage", "delta-rs", "run", config]) == 0
    assert "silver" in capsys.readouterr().out
    storage.delete(pipeline.config.silver_path, "key = 'x'")
    assert main(["--storage", "delta-rs", "verify", config]) == 1
    out = capsys.readouterr().out
    assert "missing 1" in out and "DIFFERS" in out
    assert main(["--storage", "delta-rs", "verify", "--repair", config]) == 0
    assert main(["--storage", "delta-rs", "verify", config]) == 0
    storage.delete(pipeline.config.silver_path, "key = 'y'")
    assert main(["--storage", "delta-rs", "full-refresh", config]) == 0
    assert silver_rows(pipeline) == {(k, 1, 0, "one") for k in "xyz"}
    assert pipeline.verify().ok


def test_cli_reports_config_errors_with_exit_code_2(tmp_path, capsys):
    bad = tmp_path / "bad.yml"
    bad.write_text("name: p\nlake: lake\nsources: {}\n")
    assert main(["run", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "bad.yml" in err and "sources" in err


def test_composite_primary_and_foreign_keys(tmp_path, spark, storage):
    tables = {
        "lines": {"order_id": "int64", "line": "int32", "region": "string", "cust": "int64", "qty": "int64"},
        "custs": {"region": "string", "id": "int64", "name": "string"},
    }
    pipeline, w = make_pipeline(
        tmp_path,
        spark,
        storage,
        tables=tables,
        left="lines",
        joins=[{"right": "custs", "foreign_key": ["region", "cust"], "type": "left"}],
        select={"order_id": "lines.order_id", "line": "lines.line", "name": "custs.name"},
        primary_keys={"lines": ["order_id", "line"], "custs": ["region", "id"]},
    )
    assert pipeline.config.sources["lines"].primary_key == ("order_id", "line")
    w.write(
        "custs",
        [
            w.upsert("custs", {"region": "eu", "id": 1, "name": "Ann"}, 1),
            w.upsert("custs", {"region": "us", "id": 1, "name": "Bob"}, 2),
        ],
    )
    w.write(
        "lines",
        [
            w.upsert("lines", {"order_id": 7, "line": 1, "region": "eu", "cust": 1, "qty": 1}, 3),
            w.upsert("lines", {"order_id": 7, "line": 2, "region": "us", "cust": 1, "qty": 1}, 4),
        ],
    )
    pipeline.run()
    assert silver_rows(pipeline) == {(7, 1, "Ann"), (7, 2, "Bob")}
    w.write("custs", [w.upsert("custs", {"region": "us", "id": 1, "name": "Bob Jr"}, 5)])
    w.write("lines", [w.delete("lines", {"order_id": 7, "line": 1, "region": "eu", "cust": 1, "qty": 1}, 6)])
    pipeline.run()
    assert silver_rows(pipeline) == {(7, 2, "Bob Jr")}
    assert pipeline.verify().ok


def test_truncate_removes_older_rows_and_late_older_events_do_not_resurrect_them(tmp_path, spark, storage):
    pipeline, w = make_pipeline(tmp_path, spark, storage, join_type="left")
    w.write(
        "rhs", [w.upsert("rhs", {"id": 1, "value": "one"}, 1), w.upsert("rhs", {"id": 2, "value": "two"}, 2)]
    )
    w.write(
        "lhs",
        [
            w.upsert("lhs", {"id": "a", "fk": 1, "v": 0}, 3),
            w.upsert("lhs", {"id": "b", "fk": 2, "v": 0}, 4),
            w.upsert("lhs", {"id": "c", "fk": 3, "v": 0}, 5),
        ],
    )
    pipeline.run()
    w.write("rhs", [w.event("rhs", "t", lsn=10), w.upsert("rhs", {"id": 2, "value": "two again"}, 11)])
    pipeline.run()
    assert silver_rows(pipeline) == {("a", 1, 0, None), ("b", 2, 0, "two again"), ("c", 3, 0, None)}
    # Late events from before the truncate: of a key the truncate removed, and of a key the
    # state never had (its row existed before the truncate too, so it was truncated as well).
    w.write(
        "rhs",
        [
            w.upsert("rhs", {"id": 1, "value": "late, before the truncate"}, 5),
            w.upsert("rhs", {"id": 3, "value": "late, never seen"}, 6),
        ],
    )
    pipeline.run()
    assert silver_rows(pipeline) == {("a", 1, 0, None), ("b", 2, 0, "two again"), ("c", 3, 0, None)}
    assert pipeline.verify().ok


def test_late_duplicated_and_redelivered_events_change_nothing(tmp_path, spark, storage):
    pipeline, w = make_pipeline(tmp_path, spark, storage, join_type="left")
    old_rhs, new_rhs = (
        w.upsert("rhs", {"id": 1, "value": "old"}, 1),
        w.upsert("rhs", {"id": 1, "value": "new"}, 5),
    )
    old_lhs, new_lhs = (
        w.upsert("lhs", {"id": "k", "fk": 2, "v": 1}, 2),
        w.upsert("lhs", {"id": "k", "fk": 1, "v": 2}, 6),
    )
    deleted = w.delete("lhs", {"id": "gone", "fk": 1, "v": 0}, 7)
    w.write("rhs", [new_rhs, old_rhs, new_rhs])  # shuffled and duplicated within a batch
    w.write("lhs", [new_lhs, old_lhs, deleted])
    pipeline.run()
    assert silver_rows(pipeline) == {("k", 1, 2, "new")}
    # At-least-once delivery: older events arrive again in later batches, one run each.
    for table, event in [
        ("rhs", old_rhs),
        ("lhs", old_lhs),
        ("lhs", w.upsert("lhs", {"id": "gone", "fk": 1, "v": 9}, 3)),
    ]:
        w.write(table, [event])
        pipeline.run()
        assert silver_rows(pipeline) == {("k", 1, 2, "new")}, table


def test_forced_plans_give_the_same_silver_and_say_why(tmp_path, spark, storage):
    pipeline, w = make_pipeline(tmp_path, spark, storage, join_type="left")
    w.write("rhs", [w.upsert("rhs", {"id": i, "value": f"r{i}"}, i) for i in (1, 2)])
    w.write("lhs", [w.upsert("lhs", {"id": k, "fk": 1, "v": 0}, 10 + n) for n, k in enumerate("abc")])
    pipeline.run()
    seen = {}
    lsn = 100
    for plan in ("recompute", "incremental", "recompute"):
        lsn += 2
        w.write("lhs", [w.upsert("lhs", {"id": "a", "fk": lsn % 3, "v": lsn}, lsn)])
        w.write("rhs", [w.upsert("rhs", {"id": 1, "value": f"r1@{lsn}"}, lsn + 1)])
        report = pipeline.run(plan=plan)
        decision = report.steps["plan"]
        assert decision["decision"] == plan
        seen[plan] = decision["reason"]
        assert pipeline.verify().ok, plan
        # A recompute finds the left rows naming a changed right key by a scan of the left
        # state, not by a lookup: either way "a" (changed), "b" and "c" (naming rhs 1).
        assert ("skipped" in report.steps.get("lookup:rhs", {})) == (plan == "recompute")
        assert report.steps["resolve"]["affected_keys"] == 3
    # Left alone, the rule keeps runs over a tiny left table incremental.
    assert seen["recompute"].startswith("forced by plan=recompute")
    assert not seen["incremental"].startswith("forced")
    with pytest.raises(ValueError, match="plan"):
        pipeline.run(plan="fastest")


def test_silver_has_one_schema_whichever_plan_creates_it(tmp_path, spark, storage):
    # The first run may build silver incrementally (a few rows) or by a recompute (many rows,
    # or a full refresh): the table users read must not depend on which, nullability included.
    schemas = {}
    for decision in ("incremental", "recompute"):
        pipeline, w = make_pipeline(tmp_path / decision, spark, storage, join_type="left")
        w.write("rhs", [w.upsert("rhs", {"id": 1, "value": "r1"}, 1)])
        w.write("lhs", [w.upsert("lhs", {"id": k, "fk": 1, "v": 0}, 10 + n) for n, k in enumerate("ab")])
        report = pipeline.run() if decision == "incremental" else pipeline.full_refresh()
        assert report.steps["plan"]["decision"] == decision
        assert pipeline.verify().ok, decision
        schemas[decision] = [
            (f.name, f.dataType, f.nullable) for f in storage.schema(pipeline.config.silver_path)
        ]
    assert schemas["incremental"] == schemas["recompute"]
    assert ("_run_id", LongType(), False) in schemas["incremental"]


@pytest.mark.parametrize("join_type", ["inner", "left"])
def test_a_recompute_follows_right_changes_to_left_rows_that_did_not_change(
    tmp_path, spark, storage, join_type
):
    """The cost rule's recompute finds the left rows naming changed right keys by a scan of the
    left state: rows that did not change themselves follow a right update, delete and truncate;
    a left row naming no changed right key is not recomputed."""
    pipeline, w = make_pipeline(tmp_path, spark, storage, join_type=join_type)
    w.write("rhs", [w.upsert("rhs", {"id": i, "value": f"r{i}"}, i) for i in (1, 2, 3)])
    fks = {"a": 1, "b": 1, "c": 2, "d": None, "e": 3, "f": 3}
    events = [w.upsert("lhs", {"id": k, "fk": fk, "v": 0}, 10 + n) for n, (k, fk) in enumerate(fks.items())]
    w.write("lhs", events)
    pipeline.run()
    # rhs 1 updated, rhs 2 deleted, rhs 3 updated; "f" moved from 3 to 1 earlier, "e" now.
    w.write("lhs", [w.upsert("lhs", {"id": "f", "fk": 1, "v": 1}, 20)])
    pipeline.run()
    w.write("rhs", [w.upsert("rhs", {"id": 1, "value": "r1*"}, 30), w.delete("rhs", {"id": 2}, 31)])
    w.write("rhs", [w.upsert("rhs", {"id": 3, "value": "r3*"}, 32)])
    w.write("lhs", [w.upsert("lhs", {"id": "e", "fk": 1, "v": 2}, 33)])
    report = pipeline.run(plan="recompute")
    assert report.steps["plan"]["decision"] == "recompute"
    assert "skipped" in report.steps["lookup:rhs"]
    # e (changed), a, b and f (name rhs 1), c (names rhs 2); f's old row names rhs 3 too.
    assert report.steps["resolve"]["affected_keys"] == 5
    rows = {
        ("a", 1, 0, "r1*"),
        ("b", 1, 0, "r1*"),
        ("c", 2, 0, None),
        ("d", None, 0, None),
        ("e", 1, 2, "r1*"),
        ("f", 1, 1, "r1*"),
    }
    assert silver_rows(pipeline) == _joined(rows, join_type)
    assert pipeline.verify().ok
    # A truncate removes every right row; the rows it brings back rejoin by the same scan.
    w.write("rhs", [w.event("rhs", "t", lsn=40), w.upsert("rhs", {"id": 2, "value": "r2+"}, 41)])
    report = pipeline.run(plan="recompute")
    rows = {(k, fk, v, "r2+" if fk == 2 else None) for k, fk, v, _ in rows}
    assert silver_rows(pipeline) == _joined(rows, join_type)
    assert pipeline.verify().ok


def test_a_recompute_keeps_the_left_row_in_its_column_order(tmp_path, spark, storage):
    """The key is not the left row's first column, and ``select`` shows the whole row: a
    recompute builds the row with the columns in the source's order, as every other path does."""
    tables = {"lhs": {"v": "int64", "id": "string", "fk": "int64"}, "rhs": {"id": "int64", "value": "string"}}
    pipeline, w = make_pipeline(
        tmp_path,
        spark,
        storage,
        tables=tables,
        primary_keys={"lhs": ["id"], "rhs": ["id"]},
        select={"key": "lhs.id", "raw": "to_json(lhs)", "value": "rhs.value"},
    )
    w.write("rhs", [w.upsert("rhs", {"id": 1, "value": "r1"}, 1)])
    w.write("lhs", [w.upsert("lhs", {"v": 7, "id": "a", "fk": 1}, 2)])
    pipeline.run()
    w.write("rhs", [w.upsert("rhs", {"id": 1, "value": "r1*"}, 3)])
    pipeline.run(plan="recompute")
    assert silver_rows(pipeline) == {("a", '{"v":7,"id":"a","fk":1}', "r1*")}
    assert pipeline.verify().ok


def test_a_recompute_replaces_a_silver_column_the_rows_do_not_have(tmp_path, spark, storage):
    """A column added to silver by hand: the recompute computes the whole join and replaces
    silver's rows and schema in one commit, as a full refresh does."""
    pipeline, w = make_pipeline(tmp_path, spark, storage, join_type="left")
    w.write("rhs", [w.upsert("rhs", {"id": 1, "value": "r1"}, 1)])
    w.write("lhs", [w.upsert("lhs", {"id": k, "fk": 1, "v": 0}, 2 + n) for n, k in enumerate("ab")])
    pipeline.run()
    path = pipeline.config.silver_path
    pipeline.storage.evolve(path, pipeline.storage.schema(path).add("note", "string"))
    w.write("rhs", [w.upsert("rhs", {"id": 1, "value": "r1*"}, 5)])
    report = pipeline.run(plan="recompute")
    assert report.steps["silver"]["replaced"] == "columns dropped or retyped"
    assert "note" not in pipeline.storage.schema(path).names
    assert silver_rows(pipeline) == {("a", 1, 0, "r1*"), ("b", 1, 0, "r1*")}
    assert pipeline.verify().ok


def _joined(rows: set[tuple], join_type: str) -> set[tuple]:
    """``(key, fk, v, value)`` rows as silver holds them: an inner join drops those without value."""
    return rows if join_type == "left" else {r for r in rows if r[3] is not None}


@pytest.mark.deep  # 18 runs; benchmarks/longevity.py runs the same policy for 1,000
def test_tables_that_grow_by_a_file_per_run_are_compacted_by_the_maintenance_policy(
    tmp_path, spark, storage, monkeypatch
):
    from cdc_join.run import maintenance
    from cdc_join.run.maintenance import optimize_pipeline

    monkeypatch.setattr(maintenance, "MAX_SMALL_FILES", 3)  # the policy's threshold, reached in 5 runs
    threshold = maintenance.MAX_SMALL_FILES
    pipeline, w = make_pipeline(tmp_path, spark, storage)
    cfg = pipeline.config
    w.write("rhs", [w.upsert("rhs", {"id": 1, "value": "r1"}, 1)])
    for n in range(threshold + 2):  # a run log row, an ingest log row and a bronze file per run
        w.write("lhs", [w.upsert("lhs", {"id": f"k{n}", "fk": 1, "v": n}, 10 + n)])
        pipeline.run()
    grown = {p: len(storage.files(p)) for p in (cfg.runs_path, cfg.ingest_log_path, cfg.bronze_path("lhs"))}
    assert all(n > threshold for n in grown.values()), grown
    done = {r["path"]: r for r in optimize_pipeline(storage, cfg)}
    for path in grown:
        assert done[path]["action"] == "compact", done[path]
        assert len(storage.files(path)) == 1
    assert pipeline.run().steps["plan"]["decision"] == "incremental"  # the checkpoint still reads
    assert pipeline.verify().ok


@pytest.mark.storage_path
def test_maintenance_purges_the_silver_rows_deletion_vectors_hide(tmp_path, spark, storage, monkeypatch):
    from cdc_join.run import maintenance
    from cdc_join.run.maintenance import optimize_pipeline

    monkeypatch.setattr(maintenance, "MAX_DELETED_SHARE", 0.1)
    monkeypatch.setattr(maintenance, "MAX_SMALL_FILES", 1_000)  # deleted rows alone decide
    # Silver as large tables have it: a small one is rewritten on the driver, without vectors.
    monkeypatch.setattr("cdc_join.storage.delta_spark.SMALL_REWRITE_BYTES", 0)
    pipeline, w = make_pipeline(tmp_path, spark, storage)
    silver = pipeline.config.silver_path
    w.write("rhs", [w.upsert("rhs", {"id": 1, "value": "r1"}, 1)])
    w.write("lhs", [w.upsert("lhs", {"id": f"k{n}", "fk": 1, "v": n}, 10 + n, op="c") for n in range(20)])
    pipeline.run()
    # three of the twenty rows change, one goes: MERGEs on delta-spark mark them deleted
    w.write("lhs", [w.upsert("lhs", {"id": f"k{n}", "fk": 1, "v": -n}, 100 + n) for n in range(1, 4)])
    w.write("lhs", [w.delete("lhs", {"id": "k5", "fk": 1, "v": 5}, 200)])
    pipeline.run()
    hidden = sum(f.deleted_rows for f in storage.files(silver))
    assert hidden == (4 if storage.name == "delta-spark" else 0)
    done = {r["path"]: r for r in optimize_pipeline(storage, pipeline.config)}
    assert done[silver]["action"] == ("purge" if hidden else None), done[silver]
    assert sum(f.deleted_rows for f in storage.files(silver)) == 0
    assert sum(f.num_records or 0 for f in storage.files(silver)) == 19
    assert pipeline.run().steps["plan"]["decision"] == "incremental"  # the checkpoint still reads
    assert pipeline.verify().ok


def test_a_tombstone_horizon_lets_maintenance_drop_old_deletes_from_state(tmp_path, spark, storage):
    import dataclasses

    from cdc_join.columns import DELETED
    from cdc_join.run.maintenance import optimize_pipeline

    pipeline, w = make_pipeline(tmp_path, spark, storage, join_type="left")
    w.write("rhs", [w.upsert("rhs", {"id": 1, "value": "r1"}, 1)])
    w.write("lhs", [w.upsert("lhs", {"id": k, "fk": 1, "v": 0}, 2 + n) for n, k in enumerate("ab")])
    pipeline.run()
    w.write("lhs", [w.delete("lhs", {"id": "a", "fk": 1, "v": 0}, 10)])  # an event of 2023
    pipeline.run()
    path = pipeline.config.state_path("lhs")
    optimize_pipeline(storage, pipeline.config, force=True)  # no horizon: tombstones stay
    assert storage.read(path).filter(F.col(DELETED)).count() == 1
    aged = dataclasses.replace(pipeline.config, tombstone_horizon_days=30)
    optimize_pipeline(storage, aged, force=True)
    assert storage.read(path).filter(F.col("id") == "a").count() == 0
    assert silver_rows(pipeline) == {("b", 1, 0, "r1")}
    w.write("lhs", [w.upsert("lhs", {"id": "b", "fk": 1, "v": 1}, 11)])
    pipeline.run()
    assert silver_rows(pipeline) == {("b", 1, 1, "r1")}
    assert pipeline.verify().ok
