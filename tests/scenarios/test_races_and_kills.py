"""Runs that race or stop part-way, on a lake with no lock file (as on object stores): silver
ends right whoever wins, once the next run is through.

The three sequences that used to leave silver wrong for good (each forced with the runs'
progress hooks), then a full refresh killed after each of its steps with truncates and deletes
on every source, in both YAML orders.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest

from cdc_join.report import SimulatedCrash
from cdc_join.run.maintenance import optimize_pipeline
from cdc_join.run.pipeline import Pipeline
from tests.support import PauseAt, in_thread, make_pipeline, silver_rows

pytestmark = [pytest.mark.race, pytest.mark.kill]

SHOP = {
    "customers": {"id": "int64", "name": "string"},
    "orders": {"id": "int64", "customer": "int64", "quantity": "int64"},
}


def _shop(tmp_path, spark, storage, *, customers_first: bool = True, join_type: str = "left"):
    """orders ⋈ customers on a ``file://`` lake (no lock file), and its event writer."""
    tables = SHOP if customers_first else dict(reversed(list(SHOP.items())))
    base, w = make_pipeline(
        tmp_path,
        spark,
        storage,
        tables=tables,
        left="orders",
        joins=[{"right": "customers", "foreign_key": ["customer"], "type": join_type}],
        select={"order_id": "orders.id", "quantity": "orders.quantity", "name": "customers.name"},
    )
    config = dataclasses.replace(base.config, lake="file://" + str(tmp_path / "lake"))
    assert config.lock_path is None
    return Pipeline(config, spark, storage), w


def _again(pipeline: Pipeline, progress: PauseAt) -> Pipeline:
    return Pipeline(pipeline.config, pipeline.spark, pipeline.storage, progress=progress)


def test_a_full_refresh_killed_after_a_right_state_with_a_truncate_is_finished_by_the_next_run(
    tmp_path, spark, storage
):
    # The killed refresh rebuilt the customers state (listed first) from a batch holding a
    # truncate: the next run must not take the rebuilt table for the last completed run's.
    pipeline, w = _shop(tmp_path, spark, storage)
    w.write("customers", [w.upsert("customers", {"id": 10, "name": "Ann"}, 1)])
    w.write("customers", [w.upsert("customers", {"id": 11, "name": "Bob"}, 2)])
    w.write(
        "orders",
        [w.upsert("orders", {"id": o, "customer": c, "quantity": 1}, 2 + o) for o, c in ((1, 10), (2, 11))],
    )
    pipeline.run()
    w.write(
        "customers", [w.event("customers", "t", lsn=5), w.upsert("customers", {"id": 11, "name": "Bob2"}, 6)]
    )
    with pytest.raises(SimulatedCrash):
        pipeline.full_refresh(crash_after="state:customers")
    pipeline.run()
    pipeline.run()
    assert silver_rows(pipeline) == {(1, 1, None), (2, 1, "Bob2")}
    assert pipeline.verify().ok


def test_state_rows_of_a_run_that_lost_a_race_are_not_taken_for_the_last_completed_run(
    tmp_path, spark, storage
):
    # B pins its batch (an update of order 2); A, started from the same checkpoint (the same
    # run id), pins a later one (order 1 too) and writes its state rows; then B goes on. One of
    # them loses; the next runs must still see order 1's change, and a later rename must reach it.
    pipeline, w = _shop(tmp_path, spark, storage)
    w.write("customers", [w.upsert("customers", {"id": 10, "name": "Ann"}, 1)])
    w.write("orders", [w.upsert("orders", {"id": o, "customer": 10, "quantity": 1}, 1 + o) for o in (1, 2)])
    pipeline.run()
    w.write("orders", [w.upsert("orders", {"id": 2, "customer": 10, "quantity": 2}, 10)])
    hold_b = PauseAt("plan")
    b = in_thread(_again(pipeline, hold_b).run)
    assert hold_b.reached.wait(300)
    w.write("orders", [w.upsert("orders", {"id": 1, "customer": 10, "quantity": 3}, 11)])
    hold_a = PauseAt("silver")
    a = in_thread(_again(pipeline, hold_a).run)
    assert hold_a.reached.wait(300)  # A wrote its state rows
    hold_b.release()
    first = b.result()
    hold_a.release()
    second = a.result()
    assert sorted([first, second]) == ["ConcurrentRunError", "committed"], (first, second)
    pipeline.run()
    w.write("customers", [w.upsert("customers", {"id": 10, "name": "Ann2"}, 12)])
    pipeline.run()
    assert silver_rows(pipeline) == {(1, 3, "Ann2"), (2, 2, "Ann2")}
    assert pipeline.verify().ok


def test_a_full_refresh_that_loses_to_an_overlapping_run_leaves_what_the_run_committed(
    tmp_path, spark, storage
):
    # A slow full refresh pins bronze; an update lands and the hourly run commits it; the
    # refresh must stop before it overwrites that run's state and subscriptions.
    pipeline, w = _shop(tmp_path, spark, storage)
    w.write("customers", [w.upsert("customers", {"id": 10, "name": "Ann"}, 1)])
    w.write("orders", [w.upsert("orders", {"id": o, "customer": 10, "quantity": 1}, 1 + o) for o in (1, 2)])
    pipeline.run()
    hold = PauseAt("state:customers")
    refresh = in_thread(_again(pipeline, hold).full_refresh)
    assert hold.reached.wait(300)
    w.write("orders", [w.upsert("orders", {"id": 1, "customer": 10, "quantity": 5}, 20)])
    pipeline.run()
    hold.release()
    assert refresh.result() == "ConcurrentRunError"
    assert silver_rows(pipeline) == {(1, 5, "Ann"), (2, 1, "Ann")}
    w.write("customers", [w.upsert("customers", {"id": 10, "name": "Ann3"}, 21)])
    pipeline.run()
    assert silver_rows(pipeline) == {(1, 5, "Ann3"), (2, 1, "Ann3")}
    assert pipeline.verify().ok


def test_verify_between_a_kill_and_its_rerun_says_the_run_is_unfinished(tmp_path, spark, storage):
    pipeline, w = _shop(tmp_path, spark, storage)
    w.write("customers", [w.upsert("customers", {"id": 10, "name": "Ann"}, 1)])
    w.write("orders", [w.upsert("orders", {"id": 1, "customer": 10, "quantity": 1}, 2)])
    pipeline.run()
    w.write("orders", [w.delete("orders", {"id": 1, "customer": 10, "quantity": 1}, 3)])
    with pytest.raises(SimulatedCrash):
        pipeline.run(crash_after="silver")  # silver lost the row; the checkpoint did not move
    found = pipeline.verify(repair=True)
    assert found.unfinished == ("state of orders", "silver") and not found.ok
    assert not found.repaired
    assert "cdc-join run" in found.summary()
    pipeline.run()
    assert silver_rows(pipeline) == set()
    assert pipeline.verify().ok


# Steps of a full refresh, each one a kill point; the default run takes two, CI's deep pass all.
REFRESH_STEPS = ["ingest", "state:customers", "state:orders", "subscription:customers", "resolve", "silver"]
DEEP_STEPS = {"ingest", "state:orders", "subscription:customers", "resolve"}


@pytest.mark.parametrize("customers_first", [True, False], ids=["customers-first", "orders-first"])
@pytest.mark.parametrize(
    "killed_after", [pytest.param(s, marks=pytest.mark.deep) if s in DEEP_STEPS else s for s in REFRESH_STEPS]
)
def test_a_full_refresh_killed_after_any_step_with_truncates_and_deletes_is_finished_by_either_command(
    tmp_path, spark, storage, killed_after, customers_first
):
    pipeline, w = _shop(tmp_path, spark, storage, customers_first=customers_first)
    w.write("customers", [w.upsert("customers", {"id": c, "name": f"c{c}"}, c) for c in (10, 11, 12)])
    w.write(
        "orders",
        [w.upsert("orders", {"id": o, "customer": 10 + o % 3, "quantity": o}, 20 + o) for o in range(1, 7)],
    )
    pipeline.run()
    # Truncates and deletes on both sides, with rows coming back after them.
    w.write(
        "customers", [w.delete("customers", {"id": 12, "name": "c12"}, 30), w.event("customers", "t", lsn=31)]
    )
    w.write("customers", [w.upsert("customers", {"id": 11, "name": "c11*"}, 32)])
    w.write("orders", [w.delete("orders", {"id": 1, "customer": 11, "quantity": 1}, 33)])
    w.write("orders", [w.event("orders", "t", lsn=34)])
    w.write(
        "orders",
        [
            w.upsert("orders", {"id": o, "customer": 10 + o % 3, "quantity": 10 * o}, 40 + o)
            for o in (2, 3, 4)
        ],
    )
    want = {(2, 20, None), (3, 30, None), (4, 40, "c11*")}
    with pytest.raises(SimulatedCrash):
        pipeline.full_refresh(crash_after=killed_after)
    # Finished by a run, or by another full refresh; the next batch goes through either way.
    pipeline.run() if customers_first else pipeline.full_refresh()
    assert silver_rows(pipeline) == want
    assert pipeline.verify().ok
    w.write("customers", [w.upsert("customers", {"id": 10, "name": "c10 back"}, 50)])
    pipeline.run()
    assert silver_rows(pipeline) == {(2, 20, None), (3, 30, "c10 back"), (4, 40, "c11*")}
    assert pipeline.verify().ok


def test_a_full_refresh_started_while_a_run_commits_wins_alone(tmp_path, spark, storage):
    # The run wrote everything but its checkpoint; a full refresh starting then reads those
    # writes, rebuilds over them and commits first: the run's commit must then fail.
    pipeline, w = _shop(tmp_path, spark, storage)
    w.write("customers", [w.upsert("customers", {"id": 10, "name": "Ann"}, 1)])
    w.write("orders", [w.upsert("orders", {"id": 1, "customer": 10, "quantity": 1}, 2)])
    pipeline.run()
    w.write("orders", [w.upsert("orders", {"id": 1, "customer": 10, "quantity": 2}, 3)])
    hold = PauseAt("commit")
    run = in_thread(_again(pipeline, hold).run)
    assert hold.reached.wait(300)
    pipeline.full_refresh()
    hold.release()
    assert run.result() == "ConcurrentRunError"
    assert silver_rows(pipeline) == {(1, 2, "Ann")}
    assert pipeline.verify().ok


def _rehashing(tmp_path, spark, storage, *, chain: bool = False):
    """lhs ⋈ rhs on a ``file://`` lake whose ``v`` widened from int to double after ``k`` was
    subscribed: a rebuild of the left state hashes ``k``'s 1 as "1.0", not "1". With ``chain``,
    lhs → mid → rhs: the middle source's rows are the ones re-hashed."""
    tables = {"lhs": {"id": "string", "fk": "int64", "v": "int32"}, "rhs": {"id": "int64", "value": "string"}}
    joins, select = None, None
    if chain:
        tables = {
            "lhs": {"id": "string", "fk": "int64"},
            "mid": {"id": "int64", "fk": "int64", "v": "int32"},
            "rhs": {"id": "int64", "value": "string"},
        }
        joins = [
            {"right": "mid", "foreign_key": ["fk"], "type": "left"},
            {"right": "rhs", "from": "mid", "foreign_key": ["fk"], "type": "left"},
        ]
        select = {"key": "lhs.id", "fk": "lhs.fk", "v": "mid.v", "value": "rhs.value"}
    base, w = make_pipeline(
        tmp_path, spark, storage, tables=tables, joins=joins, select=select, join_type="left"
    )
    config = dataclasses.replace(base.config, lake="file://" + str(tmp_path / "lake"))
    pipeline = Pipeline(config, spark, storage)
    hashed = "mid" if chain else "lhs"
    w.write("rhs", [w.upsert("rhs", {"id": 1, "value": "one"}, 1)])
    if chain:
        w.write("lhs", [w.upsert("lhs", {"id": "k", "fk": 5}, 2)])
        w.write("mid", [w.upsert("mid", {"id": 5, "fk": 1, "v": 1}, 3)])
    else:
        w.write("lhs", [w.upsert("lhs", {"id": "k", "fk": 1, "v": 1}, 3)])
    pipeline.run()
    w.tables[hashed]["v"] = "double"
    w.write(hashed, [w.upsert(hashed, {"id": "m" if not chain else 6, "fk": 1, "v": 2.5}, 4)])
    pipeline.run()
    return pipeline, w


@pytest.mark.parametrize("chain", [False, True], ids=["left", "chain"])
def test_a_full_refresh_that_rehashed_a_state_and_lost_a_race_is_finished_by_the_next_run(
    tmp_path, spark, storage, chain
):
    # The refresh rebuilds (and re-hashes) the first state tables, then loses at the last one to
    # an hourly run that started before the rebuild and committed first with the same run id.
    pipeline, w = _rehashing(tmp_path, spark, storage, chain=chain)
    last = list(pipeline.config.sources)[-1]
    w.write("rhs", [w.upsert("rhs", {"id": 2, "value": "two"}, 5)])
    hold_run = PauseAt("plan")
    hourly = in_thread(_again(pipeline, hold_run).run)
    assert hold_run.reached.wait(300)
    hold_refresh = PauseAt(f"state:{last}")
    refresh = in_thread(_again(pipeline, hold_refresh).full_refresh)
    assert hold_refresh.reached.wait(300)  # every other state table rebuilt
    hold_run.release()
    assert hourly.result() == "committed"
    hold_refresh.release()
    assert refresh.result() == "ConcurrentRunError"
    w.write("rhs", [w.upsert("rhs", {"id": 1, "value": "uno"}, 6)])
    resumed = pipeline.run()
    assert "full refresh resumed" in resumed.steps["plan"]["reason"]
    assert {row[-1] for row in silver_rows(pipeline)} == {"uno"}
    w.write("rhs", [w.upsert("rhs", {"id": 1, "value": "eins"}, 7)])
    report = pipeline.run()
    assert report.steps["resolve"]["stale_dropped"] == 0
    assert {row[-1] for row in silver_rows(pipeline)} == {"eins"}
    assert pipeline.verify().ok


def test_verify_right_after_a_lost_race_is_ok_or_says_unfinished(tmp_path, spark, storage):
    # As in the race above: A wrote its state rows with the winner's run id, then lost.
    pipeline, w = _shop(tmp_path, spark, storage)
    w.write("customers", [w.upsert("customers", {"id": 10, "name": "Ann"}, 1)])
    w.write("orders", [w.upsert("orders", {"id": o, "customer": 10, "quantity": 1}, 1 + o) for o in (1, 2)])
    pipeline.run()
    w.write("orders", [w.upsert("orders", {"id": 2, "customer": 10, "quantity": 2}, 10)])
    hold_b = PauseAt("plan")
    b = in_thread(_again(pipeline, hold_b).run)
    assert hold_b.reached.wait(300)
    w.write("orders", [w.upsert("orders", {"id": 1, "customer": 10, "quantity": 3}, 11)])
    hold_a = PauseAt("silver")
    a = in_thread(_again(pipeline, hold_a).run)
    assert hold_a.reached.wait(300)
    hold_b.release()
    first = b.result()
    hold_a.release()
    assert sorted([first, a.result()]) == ["ConcurrentRunError", "committed"]
    found = pipeline.verify(repair=True)
    assert found.ok or found.unfinished, found.summary()
    assert not found.repaired
    pipeline.run()
    assert pipeline.verify().ok


def test_verify_after_a_run_that_lost_only_its_commit_says_unfinished(tmp_path, spark, storage):
    # The winner had nothing to write and committed; the loser had written silver (ahead of the
    # committed checkpoint) and lost at the run log. (A plain run with nothing to do commits
    # nothing, see cdc_join.run.idle; a recompute forced with nothing new commits its run-log row.)
    pipeline, w = _shop(tmp_path, spark, storage)
    w.write("customers", [w.upsert("customers", {"id": 10, "name": "Ann"}, 1)])
    w.write("orders", [w.upsert("orders", {"id": 1, "customer": 10, "quantity": 1}, 2)])
    pipeline.run()
    hold = PauseAt("commit")  # nothing landed: no table write before its commit
    idle = in_thread(functools.partial(_again(pipeline, hold).run, plan="recompute"))
    assert hold.reached.wait(300)
    w.write("orders", [w.upsert("orders", {"id": 1, "customer": 10, "quantity": 7}, 3)])
    hold_commit = PauseAt("commit")
    busy = in_thread(_again(pipeline, hold_commit).run)
    assert hold_commit.reached.wait(300)  # silver holds quantity 7
    hold.release()
    assert idle.result() == "committed"
    hold_commit.release()
    assert busy.result() == "ConcurrentRunError"
    found = pipeline.verify()
    assert found.unfinished and not found.ok, found.summary()
    pipeline.run()
    assert silver_rows(pipeline) == {(1, 7, "Ann")}
    assert pipeline.verify().ok


def test_a_beaten_run_that_had_not_seen_a_truncate_is_put_right_by_the_next_run(tmp_path, spark, storage):
    # L pins order 1; a truncate lands and W applies both, which removes order 1 and writes
    # nothing (no order was live). L, beaten but blind to the truncate, then appends order 1 as
    # live and MERGEs it into silver before it loses at its commit. The next run, with nothing
    # new to ingest, must look at what L appended again and take order 1 out.
    pipeline, w = _shop(tmp_path, spark, storage)
    w.write("customers", [w.upsert("customers", {"id": 10, "name": "Ann"}, 1)])
    w.write("orders", [w.upsert("orders", {"id": 9, "customer": 10, "quantity": 1}, 2)])
    pipeline.run()
    w.write("orders", [w.delete("orders", {"id": 9, "customer": 10, "quantity": 1}, 3)])
    pipeline.run()
    w.write("orders", [w.upsert("orders", {"id": 1, "customer": 10, "quantity": 1}, 20)])
    hold = PauseAt("plan")
    blind = in_thread(_again(pipeline, hold).run)
    assert hold.reached.wait(300)
    w.write("orders", [w.event("orders", "t", lsn=30)])
    assert pipeline.run().steps["state:orders"]["appended"] == 0
    hold.release()
    assert blind.result() == "ConcurrentRunError"
    assert silver_rows(pipeline) == {(1, 1, "Ann")}  # what the beaten run left
    assert pipeline.verify().unfinished
    # Maintenance leaves the beaten run's rows where the next run finds them: in their files.
    done = optimize_pipeline(storage, pipeline.config, force=True)
    state = next(d for d in done if d["path"] == pipeline.config.state_path("orders"))
    assert state["action"] is None and "did not commit" in state["skipped"]
    report = pipeline.run()
    assert report.steps["state:orders"]["unfinished_keys"] == 1  # order 1's, not order 9's too
    assert silver_rows(pipeline) == set()
    assert pipeline.verify().ok
    # A late event older than the truncate changes nothing either.
    w.write("orders", [w.upsert("orders", {"id": 1, "customer": 10, "quantity": 5}, 25)])
    pipeline.run()
    assert silver_rows(pipeline) == set()
    assert pipeline.verify().ok
