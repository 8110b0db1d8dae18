"""Regression scenarios for the known failure modes of Kafka Streams' foreign-key join."""

from __future__ import annotations

import pytest

from tests.support import make_pipeline, silver_rows, subscriptions

pytestmark = [pytest.mark.kip213, pytest.mark.connect]


class Lsn:
    def __init__(self) -> None:
        self.value = 0

    def __call__(self) -> int:
        self.value += 1
        return self.value


def _subscriptions(pipeline) -> set[tuple]:
    return subscriptions(pipeline)


def _silver_changes(pipeline, since_version: int):
    changes = pipeline.storage.read_changes(pipeline.config.silver_path, since_version)
    return [(r._change_type, r.key) for r in changes.select("_change_type", "key").collect()]


def test_old_fk_is_unsubscribed_so_its_changes_no_longer_reach_the_row_kafka_9244(tmp_path, spark, storage):
    pipeline, w = make_pipeline(tmp_path, spark, storage, join_type="left")
    lsn = Lsn()
    w.write(
        "rhs",
        [
            w.upsert("rhs", {"id": 1, "value": "one"}, lsn()),
            w.upsert("rhs", {"id": 2, "value": "two"}, lsn()),
        ],
    )
    w.write("lhs", [w.upsert("lhs", {"id": "k", "fk": 1, "v": 1}, lsn())])
    pipeline.run()
    w.write("lhs", [w.upsert("lhs", {"id": "k", "fk": 2, "v": 1}, lsn())])
    pipeline.run()
    assert _subscriptions(pipeline) == {(2, "k")}
    w.write("rhs", [w.upsert("rhs", {"id": 1, "value": "one, renamed"}, lsn())])
    report = pipeline.run()
    assert silver_rows(pipeline) == {("k", 2, 1, "two")}
    assert report.steps["resolve"]["affected_keys"] == 0


def test_deleting_a_left_row_emits_exactly_one_delete_kafka_16394(tmp_path, spark, storage):
    pipeline, w = make_pipeline(tmp_path, spark, storage, join_type="left")
    lsn = Lsn()
    w.write("rhs", [w.upsert("rhs", {"id": 1, "value": "one"}, lsn())])
    w.write(
        "lhs",
        [
            w.upsert("lhs", {"id": "k", "fk": 1, "v": 1}, lsn()),
            w.upsert("lhs", {"id": "j", "fk": 1, "v": 1}, lsn()),
        ],
    )
    pipeline.run()
    before = storage.version(pipeline.config.silver_path)
    w.write("lhs", [w.delete("lhs", {"id": "k", "fk": 1, "v": 1}, lsn())])
    pipeline.run()
    assert _silver_changes(pipeline, before + 1) == [("delete", "k")]
    assert silver_rows(pipeline) == {("j", 1, 1, "one")}


def test_deleting_an_unmatched_left_row_of_an_inner_join_emits_nothing_kafka_16394(tmp_path, spark, storage):
    pipeline, w = make_pipeline(tmp_path, spark, storage, join_type="inner")
    lsn = Lsn()
    w.write("rhs", [w.upsert("rhs", {"id": 1, "value": "one"}, lsn())])
    w.write(
        "lhs",
        [
            w.upsert("lhs", {"id": "k", "fk": 1, "v": 1}, lsn()),
            w.upsert("lhs", {"id": "u", "fk": 9, "v": 1}, lsn()),
        ],
    )
    pipeline.run()
    before = storage.version(pipeline.config.silver_path)
    w.write("lhs", [w.delete("lhs", {"id": "u", "fk": 9, "v": 1}, lsn())])
    pipeline.run()
    assert _silver_changes(pipeline, before + 1) == []
    assert silver_rows(pipeline) == {("k", 1, 1, "one")}


def test_inner_join_deletes_the_row_when_fk_becomes_null_and_restores_it_kafka_16407(
    tmp_path, spark, storage
):
    pipeline, w = make_pipeline(tmp_path, spark, storage, join_type="inner")
    lsn = Lsn()
    w.write("rhs", [w.upsert("rhs", {"id": 1, "value": "one"}, lsn())])
    w.write("lhs", [w.upsert("lhs", {"id": "k", "fk": 1, "v": 1}, lsn())])
    pipeline.run()
    w.write("lhs", [w.upsert("lhs", {"id": "k", "fk": None, "v": 1}, lsn())])
    pipeline.run()
    assert silver_rows(pipeline) == set()
    assert _subscriptions(pipeline) == set()
    w.write("lhs", [w.upsert("lhs", {"id": "k", "fk": 1, "v": 2}, lsn())])
    pipeline.run()
    assert silver_rows(pipeline) == {("k", 1, 2, "one")}


def test_left_join_with_null_fk_emits_the_left_row_kip_962(tmp_path, spark, storage):
    pipeline, w = make_pipeline(tmp_path, spark, storage, join_type="left")
    lsn = Lsn()
    w.write("rhs", [w.upsert("rhs", {"id": 1, "value": "one"}, lsn())])
    w.write("lhs", [w.upsert("lhs", {"id": "n", "fk": None, "v": 1}, lsn())])
    pipeline.run()
    assert silver_rows(pipeline) == {("n", None, 1, None)}
    w.write("lhs", [w.upsert("lhs", {"id": "n", "fk": 1, "v": 1}, lsn())])
    pipeline.run()
    assert silver_rows(pipeline) == {("n", 1, 1, "one")}
    w.write("lhs", [w.upsert("lhs", {"id": "n", "fk": None, "v": 1}, lsn())])
    pipeline.run()
    assert silver_rows(pipeline) == {("n", None, 1, None)}
    assert _subscriptions(pipeline) == set()
    assert pipeline.verify().ok


def test_left_row_changing_value_but_not_fk_updates_silver_in_place(tmp_path, spark, storage):
    pipeline, w = make_pipeline(tmp_path, spark, storage, join_type="inner")
    lsn = Lsn()
    w.write("rhs", [w.upsert("rhs", {"id": 1, "value": "one"}, lsn())])
    w.write("lhs", [w.upsert("lhs", {"id": "k", "fk": 1, "v": 1}, lsn())])
    pipeline.run()
    before = storage.version(pipeline.config.silver_path)
    w.write("lhs", [w.upsert("lhs", {"id": "k", "fk": 1, "v": 5}, lsn())])
    pipeline.run()
    kinds = sorted(c for c, _ in _silver_changes(pipeline, before + 1))
    # delta-spark replaces a changed key in one commit (a delete and an insert), delta-rs MERGEs.
    replaced = storage.replaces_keys_in_place
    assert kinds == (["delete", "insert"] if replaced else ["update_postimage", "update_preimage"])
    assert silver_rows(pipeline) == {("k", 1, 5, "one")}


def test_a_key_column_that_is_also_the_foreign_key_joins_and_follows_right_changes(tmp_path, spark, storage):
    # Order lines keyed by (order_id, line_no), joined to their order on order_id.
    tables = {
        "lines": {"order_id": "int64", "line_no": "int64", "qty": "int64"},
        "orders": {"id": "int64", "who": "string"},
    }
    pipeline, w = make_pipeline(
        tmp_path,
        spark,
        storage,
        tables=tables,
        left="lines",
        joins=[{"right": "orders", "foreign_key": ["order_id"], "type": "inner"}],
        select={"o": "lines.order_id", "l": "lines.line_no", "who": "orders.who"},
        primary_keys={"lines": ["order_id", "line_no"], "orders": ["id"]},
    )
    lsn = Lsn()
    w.write("orders", [w.upsert("orders", {"id": 1, "who": "x"}, lsn())])
    w.write("lines", [w.upsert("lines", {"order_id": 1, "line_no": n, "qty": 1}, lsn()) for n in (1, 2)])
    pipeline.run()
    assert silver_rows(pipeline) == {(1, 1, "x"), (1, 2, "x")}
    w.write("orders", [w.upsert("orders", {"id": 1, "who": "y"}, lsn())])
    report = pipeline.run()
    assert report.steps["resolve"]["affected_keys"] == 2
    assert silver_rows(pipeline) == {(1, 1, "y"), (1, 2, "y")}
    assert pipeline.verify().ok
