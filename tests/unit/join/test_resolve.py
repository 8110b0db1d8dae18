"""The resolve hop: which subscribers of changed right keys still answer for their left row
(KIP-213's stale check), and the silver rows (upserts or deletes) built for affected keys."""

from __future__ import annotations

import pyarrow as pa
import pytest
from pyspark.sql.types import LongType, StringType, StructField, StructType

from cdc_join.changeset import ChangeSet, arrow_schema
from cdc_join.config import parse_config
from cdc_join.join.resolve import ORPHAN, STALE, build_rows, check, recompute_affected
from cdc_join.join.state import state_schema

ROW = StructType(
    [StructField("id", StringType()), StructField("fk", LongType()), StructField("v", LongType())]
)
STATE = state_schema(ROW)
SUBSCRIBERS = StructType(
    [
        StructField("pk_id", StringType()),
        StructField("fk_fk", LongType()),
        StructField("_lhs_hash", LongType()),
    ]
)


def _config(join_type: str = "left", lake: str = "lake"):
    return parse_config(
        {
            "name": "p",
            "lake": lake,
            "sources": {
                "lhs": {"landing": "l", "primary_key": ["id"]},
                "rhs": {"landing": "r", "primary_key": ["id"]},
            },
            "left": "lhs",
            "joins": [{"right": "rhs", "foreign_key": ["fk"], "type": join_type}],
            "select": {"key": "lhs.id", "fk": "lhs.fk", "value": "rhs.value"},
            "output": "out",
        },
        check_paths=False,
    )


def _state_row(key, fk=None, *, hash=10, deleted=False, seq="5"):
    return {
        "id": key,
        "fk": None if deleted else fk,
        "v": None if deleted else 1,
        "_cdc_seq": seq,
        "_cdc_file": "f",
        "_cdc_line": 1,
        "_cdc_op": "d" if deleted else "u",
        "_cdc_deleted": deleted,
        "_cdc_hash": None if deleted else hash,
        "_cdc_ts_ms": 0,
        "_cdc_run": 1,
    }


def _set(spark, schema: StructType, rows: list[dict]) -> ChangeSet:
    return ChangeSet(spark, schema, pa.Table.from_pylist(rows, schema=arrow_schema(schema)))


def test_a_subscriber_answers_only_for_the_left_value_it_subscribed_for(spark):
    config = _config()
    subscribers = _set(
        spark,
        SUBSCRIBERS,
        [
            {"pk_id": k, "fk_fk": 1, "_lhs_hash": 10}
            for k in ("same", "rehashed", "moved", "deleted", "gone", "mine")
        ],
    )
    current = _set(
        spark,
        STATE,
        [
            _state_row("same", 1, hash=10),
            _state_row("rehashed", 1, hash=11),  # its value changed: a newer response comes from it
            _state_row("moved", 2, hash=10),  # its fk moved away: a leftover subscription
            _state_row("deleted", deleted=True),
            _state_row("mine", 1, hash=99),
        ],
    )
    changed = pa.table({"pk_id": pa.array(["mine"])})  # changed in this run: answers for itself
    flagged = check(subscribers, current, changed, config, config.joins[0]).table.to_pylist()
    assert {r["pk_id"]: (r[STALE], r[ORPHAN]) for r in flagged} == {
        "same": (False, False),
        "rehashed": (True, False),
        "moved": (True, True),
        "deleted": (True, True),
        "gone": (True, True),  # no current row at all
    }


RIGHT = StructType(
    [
        StructField("fk_fk", LongType()),
        StructField(
            "_right", StructType([StructField("id", LongType()), StructField("value", StringType())])
        ),
        StructField("_right_seq", StringType()),
    ]
)


@pytest.mark.parametrize(
    ("join_type", "expected"),
    [
        (
            "inner",
            {"a": ("upsert", "one"), "b": ("delete", None), "n": ("delete", None), "d": ("delete", None)},
        ),
        (
            "left",
            {"a": ("upsert", "one"), "b": ("upsert", None), "n": ("upsert", None), "d": ("delete", None)},
        ),
    ],
)
def test_rows_are_upserts_or_deletes_by_join_type(spark, join_type, expected):
    config = _config(join_type)
    left = spark.createDataFrame(
        [
            _state_row("a", 1),  # names right row 1
            _state_row("b", 2),  # names no right row
            _state_row("n", None),  # no foreign key
            _state_row("d", deleted=True),  # a tombstone: the row goes
        ],
        STATE,
    )
    right = spark.createDataFrame(
        [{"fk_fk": 1, "_right": {"id": 1, "value": "one"}, "_right_seq": "3"}], RIGHT
    )
    rows = build_rows(config, left, {"rhs": right}, run_id=7).collect()
    assert {r["_pk_id"]: (r["_action"], r["value"]) for r in rows} == expected
    assert {r["_run_id"] for r in rows} == {7}
    assert {r["_pk_id"]: r["_seq_rhs"] for r in rows}["a"] == "3"


RIGHT_ROW = StructType([StructField("id", LongType()), StructField("value", StringType())])


def test_a_recompute_builds_the_rows_of_changed_left_keys_and_of_every_key_naming_a_changed_right_key(
    tmp_path, spark, storage
):
    config = _config("inner", lake=str(tmp_path / "lake"))
    left_path, right_path = config.state_path("lhs"), config.state_path("rhs")
    storage.create(left_path, STATE, cdf=False)
    storage.append(
        left_path,
        spark.createDataFrame(
            [
                _state_row("a", 1),
                _state_row("b", 2),
                _state_row("c", 2),  # changed in the run
                _state_row("n", None),
                _state_row("f", 3),
                _state_row("f", 1, seq="6"),  # f's newest row names the changed key
                _state_row("d", 1),
                _state_row("d", deleted=True, seq="6"),  # d's older row named it
                _state_row("g", 1),
                _state_row("g", 2, seq="6"),  # g moved away from it
            ],
            STATE,
        ),
    )
    right_state = state_schema(RIGHT_ROW)
    storage.create(right_path, right_state, cdf=False)
    rights = [{**_state_row(None), "id": i, "value": f"r{i}", "fk": None, "v": None} for i in (1, 2, 3)]
    storage.append(
        right_path,
        spark.createDataFrame(
            [{k: v for k, v in r.items() if k in right_state.names} for r in rights], right_state
        ),
    )
    pinned = {"lhs": storage.version(left_path), "rhs": storage.version(right_path)}
    left_changed = _set(spark, StructType([StructField("id", StringType())]), [{"id": "c"}])
    right_changed = {"rhs": _set(spark, StructType([StructField("id", LongType())]), [{"id": 1}])}

    changed = {"lhs": left_changed, **right_changed}
    rows = recompute_affected(storage, config, changed, pinned, run_id=9).collect()

    # n names nothing; b names only an unchanged right key. g's row is recomputed for its old
    # foreign key and comes out as it is (the MERGE then finds nothing to change).
    assert {r["_pk_id"]: (r["_action"], r["value"]) for r in rows} == {
        "a": ("upsert", "r1"),
        "c": ("upsert", "r2"),
        "d": ("delete", None),
        "f": ("upsert", "r1"),
        "g": ("upsert", "r2"),
    }
    nothing = _set(spark, StructType([StructField("id", StringType())]), [])
    none = {"rhs": _set(spark, StructType([StructField("id", LongType())]), [])}
    assert recompute_affected(storage, config, {"lhs": nothing, **none}, pinned, run_id=9) is None
