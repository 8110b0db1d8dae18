"""Property: nested children (``type: collect``) stay equal to each parent's current children,
whatever order, delay, duplication or crashes their events come with.

``parents`` is the left source; ``kids`` are nested under the parent their ``parent`` column
names, ordered by their key. The generators draw, for parents and kids: inserts, updates, moves
of a kid to another parent (one that exists, one that does not, or none), deletes, truncates;
nulls in every value column (string, bigint, decimal, date); both envelopes; equal sequence
values; batches shuffled, with duplicates and old events delivered again; runs and full
refreshes killed after a random step, runs told to recompute. Kids naming no parent (9, which
never exists) come in numbers below and above the join's ``max_children``
(``--hypothesis-show-statistics`` counts which), and so may a deleted parent's: they belong to
no array and count for no cap. The oracle recomputes, in plain Python, each parent's children
(compared with silver) and the kids' subscriptions.
Examples: ``CDC_JOIN_COLLECT_EXAMPLES`` (default 2).
"""

from __future__ import annotations

import os
import random
import tempfile
from datetime import date, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, assume, event, given, settings
from hypothesis import strategies as st

from tests.property.histories import (
    change,
    current_rows,
    drawn_by_the_first_share,
    examples_per_share,
    land,
    run_with_crashes,
    shares,
)
from tests.property.test_silver_equals_oracle import _expected_value, _freeze
from tests.support import make_pipeline, subscriptions

# Examples, rounds or step boundaries set by CDC_JOIN_* variables: CI runs them deeper (-m depth).
pytestmark = [pytest.mark.depth, pytest.mark.connect]

TABLES = {
    "parents": {"id": "int64", "name": "string", "score": "decimal(10,2)"},
    "kids": {"id": "string", "parent": "int64", "v": "int64", "born": "date"},
}
SELECT = {
    "id": "parents.id",
    "name": "parents.name",
    "score": "parents.score",
    "kid_ids": "transform(kids, k -> k.id)",
    "kid_vs": "transform(kids, k -> k.v)",
    "kid_born": "transform(kids, k -> k.born)",
    "n": "size(kids)",
}
PARENTS, KIDS = [1, 2, 3, 4], ["a", "b", "c", "d", "e", "f"]
#: Above the most kids a live parent can have (a to f, y and z): no run fails on a live parent.
MAX_CHILDREN = 8
RUN_CRASHES = ["ingest", "state", "state:kids", "plan", "resolve", "silver", "subscription:kids", "cleanup"]
REFRESH_CRASHES = ["state:parents", "state:kids", "subscription:kids", "resolve", "silver"]
PLANS = {"auto": ["auto"], "recompute": ["recompute"], "mixed": ["auto", "recompute"]}
EXAMPLES = int(os.environ.get("CDC_JOIN_COLLECT_EXAMPLES", "2"))

maybe = st.booleans()
operation = st.one_of(
    st.tuples(st.just("parents"), st.sampled_from("cur"), st.sampled_from(PARENTS), st.none(), maybe),
    st.tuples(
        st.just("kids"),
        st.sampled_from("cur"),
        st.sampled_from(KIDS),
        st.one_of(st.none(), st.sampled_from([1, 2, 3, 4, 9])),  # 9: no such parent
        maybe,
    ),
    st.tuples(st.sampled_from(sorted(TABLES)), st.just("d"), st.none(), st.none(), maybe),
    st.tuples(st.sampled_from(sorted(TABLES)), st.just("t"), st.none(), st.none(), maybe),
)


def _value(rng: random.Random, type_name: str) -> Any:
    if rng.random() < 0.25:
        return None
    return {
        "string": lambda: rng.choice(["", "x", "null", "é"]),
        "int64": lambda: rng.choice([0, -5, 2**40]),
        "decimal(10,2)": lambda: rng.choice([Decimal("0.00"), Decimal("-1.25"), Decimal("99.90")]),
        "date": lambda: date(2024, 1, 1) + timedelta(days=rng.randint(-400, 400)),
    }[type_name]()


def _row(table: str, key: Any, fk: Any, rng: random.Random) -> dict[str, Any]:
    values = {c: _value(rng, t) for c, t in TABLES[table].items()}
    return values | ({"id": key} if table == "parents" else {"id": key, "parent": fk})


def oracle(delivered: list[dict], payload_only: set[str]) -> set[tuple]:
    """Per current parent: its values and its current kids' ids, values and dates by kid id."""
    current = current_rows(delivered, TABLES)

    def value(table: str, row: dict, column: str) -> Any:
        return _freeze(_expected_value(row[column], TABLES[table][column], table in payload_only))

    out = set()
    for parent in current["parents"].values():
        kids = sorted(
            (k for k in current["kids"].values() if k["parent"] == parent["id"]), key=lambda k: k["id"]
        )
        out.add(
            (
                parent["id"],
                value("parents", parent, "name"),
                value("parents", parent, "score"),
                tuple(k["id"] for k in kids),
                tuple(value("kids", k, "v") for k in kids),
                tuple(value("kids", k, "born") for k in kids),
                len(kids),
            )
        )
    return out


def _silver(pipeline) -> set[tuple]:
    cfg = pipeline.config
    if not pipeline.storage.exists(cfg.silver_path):
        return set()
    rows = pipeline.storage.read(cfg.silver_path).select(*SELECT).collect()
    return {tuple(_freeze(v) for v in row) for row in rows}


@shares
@settings(
    max_examples=examples_per_share(EXAMPLES),
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
    deadline=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)
@given(
    ops=st.lists(operation, min_size=8, max_size=30),
    payload_only=st.sets(st.sampled_from(sorted(TABLES))),
    batches=st.integers(2, 4),
    seed=st.integers(0, 2**32 - 1),
    plans=st.sampled_from(sorted(PLANS)),
    orphans=st.integers(0, 2 * MAX_CHILDREN),
)
def test_nested_children_equal_the_oracle_after_every_completed_run(
    spark, storage, share, ops, payload_only, batches, seed, plans, orphans
):
    assume(not drawn_by_the_first_share(share, seed, batches, payload_only))
    rng = random.Random(seed)
    root = Path(tempfile.mkdtemp(prefix="cdc_join_collect_"))
    joins = [{"right": "kids", "type": "collect", "foreign_key": ["parent"], "max_children": MAX_CHILDREN}]
    pipeline, writer = make_pipeline(
        root,
        spark,
        storage,
        tables={t: dict(c) for t, c in TABLES.items()},
        left="parents",
        joins=joins,
        select=SELECT,
    )
    writer.payload_only = set(payload_only)
    # A parent and a kid in every first batch: both sources have events from the first run on;
    # parent 8 and its kids y and z no op touches (the last batch moves z away and deletes y).
    seeds = [
        change("parents", "c", 1, _row("parents", 1, None, rng), 1),
        change("kids", "c", "a", _row("kids", "a", 1, rng), 2),
        change("parents", "c", 8, _row("parents", 8, None, rng), 3),
        change("kids", "c", "y", _row("kids", "y", 8, rng), 4),
        change("kids", "c", "z", _row("kids", "z", 8, rng), 5),
        *(change("kids", "c", f"o{i:02d}", _row("kids", f"o{i:02d}", 9, rng), 6) for i in range(orphans)),
    ]
    event(f"kids naming no parent: {'above' if orphans > MAX_CHILDREN else 'up to'} max_children")
    delivered: list[dict] = []
    for number, batch in enumerate(_history(ops, rng, batches)):
        now = batch + (seeds if number == 0 else [])
        now += [e for e in now if rng.random() < 0.2]  # duplicates
        if delivered:  # old events again, after newer ones (not parent 8's: in a later file they
            # are newer events, which would rebuild its row)
            again = [e for e in delivered if e["key"] not in (8, "y", "z")]
            now += rng.sample(again, min(len(again), rng.randint(1, 4)))
        rng.shuffle(now)
        delivered += land(writer, now, TABLES)
        run_with_crashes(pipeline, rng, PLANS[plans], RUN_CRASHES, REFRESH_CRASHES)
        if number and any(e["table"] == "kids" and e["op"] == "u" for e in batch):
            event("a later batch updated or moved kids")
        expected = oracle(delivered, set(payload_only))
        assert _silver(pipeline) == expected, f"after batch {number}"
        kids = current_rows(delivered, TABLES)["kids"].values()
        assert subscriptions(pipeline, 0) == {(k["parent"], k["id"]) for k in kids if k["parent"] is not None}
    assert pipeline.verify().ok


def _history(ops: list[tuple], rng: random.Random, batches: int) -> list[list[dict]]:
    """The ops as events with sequences (some equal to the previous one), cut into batches; a
    delete removes a row the history wrote."""
    events, lsn, written = [], 10, {t: [] for t in TABLES}
    cuts = sorted(rng.sample(range(1, len(ops)), min(batches - 1, len(ops) - 1)))
    for table, op, key, fk, same_lsn in ops:
        lsn += 0 if same_lsn else 1
        if op == "t":
            events.append(change(table, "t", None, None, lsn))
        elif op == "d":
            if written[table]:
                row = rng.choice(written[table])
                events.append(change(table, "d", row["id"], row, lsn))
        else:
            row = _row(table, key, fk, rng)
            written[table].append(row)
            events.append(change(table, op, key, row, lsn))
    out: list[list[dict]] = [[] for _ in range(len(cuts) + 1)]
    for i, e in enumerate(events):
        out[sum(1 for c in cuts if i >= c)].append(e)
    # Parent 8's kids leave it in the last batch: only their instructions to their old parent
    # (unsubscribe, delete) reach parent 8's row.
    y = {**_row("kids", "y", 8, rng)}
    out[-1] += [
        change("kids", "u", "z", _row("kids", "z", rng.choice([1, 9, None]), rng), lsn + 1),
        change("kids", "d", "y", y, lsn + 2),
    ]
    return out
