"""The predicate a keyed replace deletes by: which keys it can name, and its text per dialect;
the query that reads keys' rows with delta-rs."""

from __future__ import annotations

import datetime
from decimal import Decimal

import pyarrow as pa
import pytest

from cdc_join.storage import keyed


def test_keys_with_a_null_a_float_or_none_at_all_are_not_named():
    assert keyed.nameable(pa.table({"k": [1, 2]}))
    assert not keyed.nameable(pa.table({"k": [1, None]}))
    assert not keyed.nameable(pa.table({"k": [1.5]}))
    assert not keyed.nameable(pa.table({"k": pa.array([], pa.int64())}))
    assert not keyed.nameable(pa.table({"k": list(range(keyed.MOST_KEYS + 1))}))
    with pytest.raises(ValueError):
        keyed.spark_predicate(["k"], pa.table({"k": [None]}))


def test_each_dialect_escapes_text_its_own_way():
    keys = pa.table({"a b": ["it's", "back\\slash"]})
    assert keyed.spark_predicate(["a b"], keys) == "`a b` IN ('it\\'s', 'back\\\\slash')"
    assert keyed.delta_rs_predicate(["a b"], keys) == "\"a b\" IN ('it''s', 'back\\slash')"


def test_dates_decimals_and_booleans_are_literals_of_both_dialects_and_keys_of_two_columns_none():
    day, amount = datetime.date(2026, 12, 3), pa.array([Decimal("1.50")], pa.decimal128(5, 2))
    assert keyed.spark_predicate(["d"], pa.table({"d": [day]})) == "`d` IN (DATE '2026-12-03')"
    assert (
        keyed.delta_rs_predicate(["m"], pa.table({"m": amount}))
        == "\"m\" IN (CAST('1.50' AS DECIMAL(38, 2)))"
    )
    assert keyed.spark_predicate(["b"], pa.table({"b": [True, False]})) == "`b` IN (TRUE, FALSE)"
    assert not keyed.nameable(pa.table({"a": [1], "b": [2]}))


def test_rows_of_reads_the_keys_rows_from_both_ends_of_their_range_and_no_other(tmp_path):
    from deltalake import DeltaTable, write_deltalake

    path = str(tmp_path / "t")
    write_deltalake(path, pa.table({"k": pa.array([1, 2, 3, 4, None], pa.int32()), "v": list("abcde")}))
    write_deltalake(path, pa.table({"k": pa.array([5], pa.int32()), "v": ["f"]}), mode="append")
    table = DeltaTable(path)
    found = keyed.rows_of(table, "k", [5, 2, 2, None], ["v", "k"])
    assert found.schema == pa.schema([("v", pa.string()), ("k", pa.int32())])
    assert sorted(found.to_pylist(), key=lambda r: r["k"]) == [{"v": "b", "k": 2}, {"v": "f", "k": 5}]
    texts = keyed.rows_of(table, "v", ["a", "it's"])
    assert texts.to_pylist() == [{"k": 1, "v": "a"}]
    assert keyed.rows_of(table, "k", [None]).num_rows == 0
    assert keyed.rows_of(table, "k", [1.5]) is None  # no literal: the caller reads with Spark
