"""The subscription hop: KIP-213 instructions from old and new left images, and the table they
are appended to (a CombinedKey's subscription is its newest row)."""

from __future__ import annotations

import math

import pyarrow as pa
import pytest
from pyspark.sql.types import DoubleType, LongType, StringType, StructField, StructType

from cdc_join.changeset import ChangeSet, arrow_schema
from cdc_join.columns import LHS_HASH
from cdc_join.config import JoinConfig, JoinType, SourceConfig
from cdc_join.join.images import NEW, OLD, changes_schema
from cdc_join.join.state import state_schema
from cdc_join.join.subscription import (
    INSTRUCTION,
    Instruction,
    append_instructions,
    current,
    instructions,
    prepare,
)

NAN = float("nan")
DELETE_AND_PROPAGATE = Instruction.DELETE_KEY_AND_PROPAGATE.value
DELETE_NO_PROPAGATE = Instruction.DELETE_KEY_NO_PROPAGATE.value
PROPAGATE_NULL = Instruction.PROPAGATE_NULL_IF_NO_FK_VAL_AVAILABLE.value
PROPAGATE_ONLY = Instruction.PROPAGATE_ONLY_IF_FK_VAL_AVAILABLE.value

LEFT = SourceConfig(name="lhs", primary_key=("id",), landing="landing/lhs")


def _join(*fk: str, type: JoinType = JoinType.LEFT) -> JoinConfig:
    return JoinConfig(right="rhs", alias="rhs", foreign_key=fk, type=type)


def _row_type(fk_type=LongType()) -> StructType:
    return StructType(
        [
            StructField("id", StringType()),
            StructField("a", fk_type),
            StructField("b", fk_type),
            StructField("v", LongType()),
        ]
    )


def _image(a=None, b=None, *, hash=1, deleted=False, seq="1"):
    return {
        "a": a,
        "b": b,
        "v": 0,
        "_cdc_seq": seq,
        "_cdc_file": "f",
        "_cdc_line": 0,
        "_cdc_op": "d" if deleted else "u",
        "_cdc_deleted": deleted,
        "_cdc_hash": None if deleted else hash,
        "_cdc_ts_ms": 0,
        "_cdc_run": 1,
    }


def _changes(spark, rows, fk_type=LongType()) -> ChangeSet:
    """Changed left keys: ``(id, old image or None, new image or None)``."""
    schema = changes_schema(state_schema(_row_type(fk_type)), ["id"])
    data = [
        {
            "id": key,
            OLD: None if old is None else {"id": key, **old},
            NEW: None if new is None else {"id": key, **new},
        }
        for key, old, new in rows
    ]
    return ChangeSet(spark, schema, pa.Table.from_pylist(data, schema=arrow_schema(schema)))


def _messages(found: ChangeSet, *fks: str) -> set[tuple]:
    rows = found.table.to_pylist()
    return {
        (
            r["pk_id"],
            *(None if r[f"fk_{c}"] is None else r[f"fk_{c}"] for c in fks),
            r[INSTRUCTION],
            r[LHS_HASH],
        )
        for r in rows
    }


@pytest.mark.parametrize(
    ("join_type", "subscribe"), [(JoinType.LEFT, PROPAGATE_NULL), (JoinType.INNER, PROPAGATE_ONLY)]
)
def test_a_new_row_and_a_same_fk_update_subscribe_with_their_new_hash(spark, join_type, subscribe):
    changes = _changes(
        spark, [("new", None, _image(1, hash=11)), ("same", _image(2, hash=20), _image(2, hash=21))]
    )
    found = instructions(changes, LEFT, _join("a", type=join_type))
    assert _messages(found, "a") == {("new", 1, subscribe, 11), ("same", 2, subscribe, 21)}


def test_a_changed_fk_unsubscribes_the_old_fk_and_subscribes_the_new_one(spark):
    changes = _changes(spark, [("k", _image(1, hash=10), _image(2, hash=10))])
    for join_type in JoinType:
        found = instructions(changes, LEFT, _join("a", type=join_type))
        # Even an inner join propagates a null when the new fk names no row: the old output must go.
        assert _messages(found, "a") == {("k", 1, DELETE_NO_PROPAGATE, None), ("k", 2, PROPAGATE_NULL, 10)}


def test_a_fk_that_becomes_null_unsubscribes_and_still_answers_with_no_fk(spark):
    changes = _changes(spark, [("k", _image(1, hash=10), _image(None, hash=12))])
    found = instructions(changes, LEFT, _join("a"))
    assert _messages(found, "a") == {("k", 1, DELETE_NO_PROPAGATE, None), ("k", None, PROPAGATE_NULL, 12)}


def test_a_deleted_row_unsubscribes_and_propagates_even_without_an_old_fk(spark):
    changes = _changes(
        spark,
        [
            ("had", _image(1), _image(deleted=True)),
            ("gone", _image(1), None),
            ("nofk", _image(None), _image(deleted=True)),
            ("never", None, _image(deleted=True)),  # a delete of a row that never was: no message
        ],
    )
    found = instructions(changes, LEFT, _join("a"))
    assert _messages(found, "a") == {
        ("had", 1, DELETE_AND_PROPAGATE, None),
        ("gone", 1, DELETE_AND_PROPAGATE, None),
        ("nofk", None, DELETE_AND_PROPAGATE, None),
    }


def test_a_row_back_after_a_delete_subscribes_like_a_new_row(spark):
    changes = _changes(spark, [("k", _image(deleted=True), _image(3, hash=30))])
    assert _messages(instructions(changes, LEFT, _join("a")), "a") == {("k", 3, PROPAGATE_NULL, 30)}


def test_a_composite_fk_with_a_null_part_is_no_fk(spark):
    changes = _changes(
        spark,
        [
            ("partly", _image(1, 2, hash=10), _image(1, None, hash=11)),  # (1,2) -> (1,null): moved away
            ("whole", _image(1, None, hash=20), _image(1, 5, hash=21)),  # (1,null) -> (1,5): a new fk
        ],
    )
    found = instructions(changes, LEFT, _join("a", "b"))
    assert _messages(found, "a", "b") == {
        ("partly", 1, 2, DELETE_NO_PROPAGATE, None),
        ("partly", None, None, PROPAGATE_NULL, 11),
        ("whole", 1, 5, PROPAGATE_NULL, 21),
    }


def test_an_unchanged_nan_fk_is_the_same_fk(spark):
    # Spark's joins match NaN with NaN, so a NaN fk that stays NaN did not move.
    changes = _changes(spark, [("k", _image(NAN, hash=1), _image(NAN, hash=2))], fk_type=DoubleType())
    [message] = instructions(changes, LEFT, _join("a")).table.to_pylist()
    assert math.isnan(message["fk_a"]) and message[INSTRUCTION] == PROPAGATE_NULL and message[LHS_HASH] == 2


def test_the_newest_row_of_a_combined_key_is_its_subscription(tmp_path, spark, storage):
    join = _join("a")
    path = str(tmp_path / "subscription")
    prepare(storage, path, LEFT, join, state_schema(_row_type()))

    def append(rows, run_id):
        append_instructions(
            storage, path, instructions(_changes(spark, rows), LEFT, join), LEFT, join, run_id
        )

    append([("k", None, _image(1, hash=10)), ("j", None, _image(1, hash=20))], 1)
    append([("k", _image(1, hash=10), _image(2, hash=11)), ("j", _image(1, hash=20), _image(1, hash=21))], 2)
    append([("j", _image(1, hash=21), _image(deleted=True))], 3)
    rows, _ = current(storage, path, join, LEFT)
    assert {(r.fk_a, r.pk_id, r._lhs_hash) for r in rows.collect()} == {(2, "k", 11)}
    # Rerunning run 2's append (a crash before its checkpoint) changes no subscription.
    append([("k", _image(1, hash=10), _image(2, hash=11)), ("j", _image(1, hash=20), _image(1, hash=21))], 2)
    append([("j", _image(1, hash=21), _image(deleted=True))], 3)
    rows, _ = current(storage, path, join, LEFT)
    assert {(r.fk_a, r.pk_id, r._lhs_hash) for r in rows.collect()} == {(2, "k", 11)}
