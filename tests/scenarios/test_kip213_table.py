"""The seed's table of LHS events (KIP-213, "Tombstones & Foreign Key Changes"), row by row.

Each step lands the step's events, runs the pipeline once, and compares silver with the
table's output column for inner and for left joins. The table writes outputs as
``(key, fk, rhs value)``; ``(k,null)`` for an inner join and ``(k,null,null)`` for a left join
after "Delete k" mean the key is absent from the output. The last two rows publish ``(q,10)``
and then the right row for fk 10 (written ``(q,baz)`` in the table's RHS-1 column).

The instruction column is checked for the inner join where the table states it (rows 1–6).
"""

from __future__ import annotations

import pytest

from tests.support import LHS_RHS_TABLES, make_pipeline, silver_rows

pytestmark = [pytest.mark.kip213, pytest.mark.connect]

LHS = "lhs"
RHS = "rhs"

# (description, events as (table, op, row), inner output, left output, inner instructions)
STEPS = [
    (
        "publish new event (k,1) with RHS (1,foo)",
        [(RHS, "c", {"id": 1, "value": "foo"}), (LHS, "c", {"id": "k", "fk": 1, "v": 1})],
        {("k", 1, "foo")},
        {("k", 1, "foo")},
        {"PROPAGATE_ONLY_IF_FK_VAL_AVAILABLE": 1},
    ),
    (
        "change fk 1 -> 2 (no RHS row 2)",
        [(LHS, "u", {"id": "k", "fk": 2, "v": 1})],
        set(),
        {("k", 2, None)},
        {"DELETE_KEY_NO_PROPAGATE": 1, "PROPAGATE_NULL_IF_NO_FK_VAL_AVAILABLE": 1},
    ),
    (
        "change fk 2 -> 3 (no RHS row 3)",
        [(LHS, "u", {"id": "k", "fk": 3, "v": 1})],
        set(),
        {("k", 3, None)},
        {"DELETE_KEY_NO_PROPAGATE": 1, "PROPAGATE_NULL_IF_NO_FK_VAL_AVAILABLE": 1},
    ),
    (
        "publish a value to RHS: (3,bar)",
        [(RHS, "c", {"id": 3, "value": "bar"})],
        {("k", 3, "bar")},
        {("k", 3, "bar")},
        {},
    ),
    (
        "delete k",
        [(LHS, "d", {"id": "k", "fk": 3, "v": 1})],
        set(),
        set(),
        {"DELETE_KEY_AND_PROPAGATE": 1},
    ),
    (
        "publish original event again (k,1)",
        [(LHS, "c", {"id": "k", "fk": 1, "v": 1})],
        {("k", 1, "foo")},
        {("k", 1, "foo")},
        {"PROPAGATE_ONLY_IF_FK_VAL_AVAILABLE": 1},
    ),
    (
        "publish to LHS (q,10)",
        [(LHS, "c", {"id": "q", "fk": 10, "v": 1})],
        {("k", 1, "foo")},
        {("k", 1, "foo"), ("q", 10, None)},
        None,
    ),
    (
        "publish a value to RHS: (10,baz)",
        [(RHS, "c", {"id": 10, "value": "baz"})],
        {("k", 1, "foo"), ("q", 10, "baz")},
        {("k", 1, "foo"), ("q", 10, "baz")},
        None,
    ),
]


#: Columns each table gets beside its own in the ``wide`` case: 40 in all, past the 32 whose file
#: statistics Delta keeps (so the state tables keep none of cdc_join's columns, silver none of
#: its run ids), as real tables of 25 columns or more.
PADDING = {f"p{i:02d}": "int64" for i in range(37)}


@pytest.mark.parametrize("width", [pytest.param("narrow", marks=pytest.mark.core), "wide"])
@pytest.mark.parametrize("join_type", ["inner", "left"])
def test_kip213_table_of_lhs_events(tmp_path, spark, storage, join_type, width):
    tables = {t: {**cols, **(PADDING if width == "wide" else {})} for t, cols in LHS_RHS_TABLES.items()}
    pipeline, writer = make_pipeline(
        tmp_path,
        spark,
        storage,
        tables=tables,
        join_type=join_type,
        select={"key": "lhs.id", "fk": "lhs.fk", "value": "rhs.value"},
    )
    lsn = 0
    for description, events, inner_out, left_out, instructions in STEPS:
        for table in (RHS, LHS):
            batch = []
            for t, op, row in events:
                if t == table:
                    lsn += 1
                    padded = (
                        {**row, **{c: lsn * i for i, c in enumerate(PADDING)}} if width == "wide" else row
                    )
                    batch.append(
                        writer.delete(t, padded, lsn) if op == "d" else writer.upsert(t, padded, lsn, op)
                    )
            if batch:
                writer.write(table, batch)
        report = pipeline.run()
        expected = inner_out if join_type == "inner" else left_out
        assert silver_rows(pipeline) == expected, description
        if join_type == "inner" and instructions is not None:
            seen = report.steps[f"subscription:{RHS}"]["instructions"]
            assert seen == instructions, description
    assert pipeline.verify().ok
