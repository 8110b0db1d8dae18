"""The state hop: bronze events shaped as state rows, and the current row of a key (the newest
by sequence, then landing file, then line), with deletes and truncates as tombstones."""

from __future__ import annotations

from pyspark.sql.types import LongType, StringType, StructField, StructType

from cdc_join.config import SourceConfig
from cdc_join.join.rebuild import from_events
from cdc_join.join.state import current_rows, event_rows, newest, state_schema

ROW = StructType([StructField("id", LongType()), StructField("v", StringType())])
EVENTS = StructType(
    [
        StructField("_op", StringType()),
        StructField("_before", ROW),
        StructField("_after", ROW),
        StructField("_seq", StringType()),
        StructField("_file", StringType()),
        StructField("_line", LongType()),
        StructField("_ts_ms", LongType()),
    ]
)
SOURCE = SourceConfig(name="s", primary_key=("id",), landing="l")


def _events(spark, *events):
    """Events as ``(op, id, v, seq, file, line)``."""
    rows = []
    for op, key, v, seq, file, line in events:
        image = {"id": key, "v": v}
        before, after = (image, None) if op == "d" else (None, None if op == "t" else image)
        rows.append((op, before, after, seq, file, line, 0))
    return spark.createDataFrame(rows, EVENTS)


def _current(frame) -> dict:
    return {r["id"]: (r["v"], r["_cdc_seq"]) for r in current_rows(frame, ["id"]).collect()}


def test_events_become_state_rows_keyed_by_after_or_by_before_for_deletes(spark):
    rows = event_rows(_events(spark, ("c", 1, "x", "1", "a", 1), ("d", 2, "y", "2", "a", 2)), SOURCE, 5)
    got = {r["id"]: r for r in rows.collect()}
    assert got[1]["v"] == "x" and not got[1]["_cdc_deleted"] and got[1]["_cdc_hash"] is not None
    # A delete keeps only its key: its values and hash are null, it is a tombstone.
    assert (got[2]["v"], got[2]["_cdc_deleted"], got[2]["_cdc_hash"]) == (None, True, None)
    assert {r["_cdc_run"] for r in got.values()} == {5}


def test_the_newest_event_wins_by_sequence_then_file_then_line(spark):
    events = _events(
        spark,
        ("u", 1, "late file", "7", "b.jsonl", 1),
        ("u", 1, "early file", "7", "a.jsonl", 9),
        ("u", 1, "older", "6", "z.jsonl", 99),
        ("u", 2, "line 2", "3", "a.jsonl", 2),
        ("u", 2, "line 1", "3", "a.jsonl", 1),
    )
    rows = event_rows(events, SOURCE, 1)
    assert _current(rows) == {1: ("late file", "7"), 2: ("line 2", "3")}
    # Duplicates of one event (redelivered) fold into one row.
    assert newest(rows.unionByName(rows), ["id"]).count() == 2


def test_a_delete_is_a_tombstone_that_older_events_cannot_undo(spark):
    events = _events(
        spark, ("c", 1, "x", "1", "a", 1), ("d", 1, "x", "3", "a", 2), ("u", 1, "late", "2", "b", 1)
    )
    rows = event_rows(events, SOURCE, 1)
    [kept] = newest(rows, ["id"]).collect()
    assert kept["_cdc_deleted"] and kept["_cdc_seq"] == "3"
    assert _current(rows) == {}


def test_a_truncate_removes_older_rows_and_keeps_newer_ones(spark):
    events = _events(
        spark,
        ("c", 1, "before", "1", "a", 1),
        ("c", 2, "after", "5", "a", 2),
        ("t", None, None, "3", "a", 3),
        ("u", 3, "late but older", "2", "b", 1),
    )
    state = from_events(events, SOURCE, state_schema(ROW), run_id=1)
    assert _current(state) == {2: ("after", "5")}
    tombstones = {r["id"]: r["_cdc_op"] for r in state.filter("_cdc_deleted").collect()}
    assert tombstones == {1: "t", 3: "t"}  # at the truncate's sequence: later older events stay out


def test_events_read_on_the_driver_give_the_state_spark_computes_with_or_without_a_truncate(spark):
    from cdc_join.changeset import arrow_of, materialize

    plain = [("c", 1, "a", "1", "a", 1), ("u", 1, "b", "4", "a", 2), ("d", 2, None, "2", "b", 1)]
    plain += [("c", 2, "x", "1", "a", 3), ("c", None, "null key", "5", "b", 2), ("c", 3, "y", "25", "b", 3)]
    for truncated in ([], [("t", None, None, "3", "c", 1)]):
        events = _events(spark, *plain, *truncated)
        on_driver = materialize(events).frame
        assert arrow_of(on_driver) is not None and arrow_of(events) is None
        expected = from_events(events, SOURCE, state_schema(ROW), run_id=1)
        found = from_events(on_driver, SOURCE, state_schema(ROW), run_id=1)
        assert found.columns == expected.columns
        assert sorted(found.collect(), key=str) == sorted(expected.collect(), key=str), truncated
        assert _current(found) == (
            {1: ("b", "4"), 3: ("y", "25"), None: ("null key", "5")}
            if not truncated
            else {1: ("b", "4"), None: ("null key", "5")}
        )


def test_a_key_whose_event_was_hashed_otherwise_counts_as_changed(spark):
    # The same event (sequence, file, line) with another hash: a rebuild hashed its row after a
    # column widened (1 is "1.0" in a double). Its subscriptions must be written with the new hash.
    import pyarrow as pa

    from cdc_join.changeset import ChangeSet
    from cdc_join.join.images import NEW, OLD, changed, changes_schema

    schema = state_schema(ROW)
    rows = event_rows(_events(spark, ("c", 1, "x", "1", "a", 1), ("c", 2, "y", "1", "a", 2)), SOURCE, 1)
    stored = {r["id"]: r.asDict() for r in rows.collect()}
    rehashed = {**stored[2], "_cdc_hash": stored[2]["_cdc_hash"] + 1}
    table = pa.Table.from_pylist(
        [
            {"id": 1, OLD: stored[1], NEW: stored[1]},
            {"id": 2, OLD: stored[2], NEW: rehashed},
            {"id": 3, OLD: None, NEW: None},
        ]
    )
    images = ChangeSet(spark, changes_schema(schema, ["id"]), table)
    assert changed(images).table.column("id").to_pylist() == [2]
