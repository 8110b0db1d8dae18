"""Property: a chain of three hops, ``orders → customers → nations → regions``, stays equal to
the join of the current source rows whatever order, delay, duplication or crashes its events
come with (the chain's part of README.md, "What silver holds").

Each hop's foreign key is a column of the source joined before it; the hop from customers to
nations is on a composite key ``(na, nb)``, so a key can be partly null. Each hop is drawn inner
or left. The generators draw, at every hop: inserts, updates that move the foreign key (to
another row, to a key no row has, or to null), deletes, and truncates of the right sources;
values with nulls in every column (string, bigint, decimal, date); both envelopes; equal
sequence values; batches shuffled, with duplicates and old events delivered again; runs and
full refreshes killed after a random step (each hop's subscription step among them), runs told
to recompute. The oracle recomputes, in plain Python, each source's current rows and their
join (compared with silver) and each hop's subscriptions. Examples: ``CDC_JOIN_CHAIN_EXAMPLES``
(default 2).
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
from tests.support import make_pipeline, silver_rows, subscriptions

# Examples, rounds or step boundaries set by CDC_JOIN_* variables: CI runs them deeper (-m depth).
pytestmark = [pytest.mark.depth, pytest.mark.connect]

TABLES = {
    "orders": {"id": "string", "cust": "int64", "qty": "int64", "note": "string"},
    "customers": {"id": "int64", "na": "int64", "nb": "string", "name": "string"},
    "nations": {"a": "int64", "b": "string", "region": "int64", "name": "string", "since": "date"},
    "regions": {"id": "int64", "name": "string", "rate": "decimal(10,2)"},
}
PRIMARY_KEYS = {"orders": ["id"], "customers": ["id"], "nations": ["a", "b"], "regions": ["id"]}
SELECT = {
    "order_id": "orders.id",
    "qty": "orders.qty",
    "note": "orders.note",
    "customer": "customers.name",
    "na": "customers.na",
    "nation": "nations.name",
    "since": "nations.since",
    "region": "regions.name",
    "rate": "regions.rate",
}
ORDERS, CUSTOMERS, NATIONS, REGIONS = (
    ["o1", "o2", "o3", "o4"],
    [1, 2, 3],
    [(1, "x"), (1, "y"), (2, "x"), (9, "z")],
    [1, 2, 9],
)
RUN_CRASHES = [
    "ingest",
    "state",
    "state:customers",
    "state:nations",
    "plan",
    "lookup",
    "resolve",
    "silver",
    "subscription:customers",
    "subscription:nations",
    "subscription:regions",
    "cleanup",
]
REFRESH_CRASHES = ["state:orders", "state:nations", "subscription:nations", "resolve", "silver"]
EXAMPLES = int(os.environ.get("CDC_JOIN_CHAIN_EXAMPLES", "2"))
# Runs left to the cost rule (incremental at this size), told to recompute, or each either way.
PLANS = {"auto": ["auto"], "recompute": ["recompute"], "mixed": ["auto", "recompute"]}

maybe = st.booleans()
fk_a = st.one_of(st.none(), st.sampled_from([1, 2, 3]))  # 3: names no nation
fk_b = st.one_of(st.none(), st.sampled_from(["x", "y"]))
operation = st.one_of(
    st.tuples(
        st.just("orders"),
        st.sampled_from("cur"),
        st.sampled_from(ORDERS),
        st.one_of(st.none(), st.sampled_from([1, 2, 3, 4])),
        st.none(),
        maybe,
    ),
    st.tuples(
        st.just("customers"),
        st.sampled_from("cur"),
        st.sampled_from(CUSTOMERS),
        st.tuples(fk_a, fk_b),
        st.none(),
        maybe,
    ),
    st.tuples(
        st.just("nations"),
        st.sampled_from("cur"),
        st.sampled_from(NATIONS),
        st.one_of(st.none(), st.sampled_from([1, 2, 3, 9])),
        st.none(),
        maybe,
    ),
    st.tuples(
        st.just("regions"), st.sampled_from("cu"), st.sampled_from(REGIONS), st.none(), st.none(), maybe
    ),
    st.tuples(st.sampled_from(sorted(TABLES)), st.just("d"), st.none(), st.none(), st.none(), maybe),
    st.tuples(
        st.sampled_from(["customers", "nations", "regions"]),
        st.just("t"),
        st.none(),
        st.none(),
        st.none(),
        maybe,
    ),
)


def _value(rng: random.Random, type_name: str) -> Any:
    """A random value of a column type, null a quarter of the time."""
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
    if table == "orders":
        return values | {"id": key, "cust": fk}
    if table == "customers":
        return values | {"id": key, "na": fk[0], "nb": fk[1]}
    if table == "nations":
        return values | {"a": key[0], "b": key[1], "region": fk}
    return values | {"id": key}


def _key(table: str, row: dict) -> Any:
    keys = PRIMARY_KEYS[table]
    return row[keys[0]] if len(keys) == 1 else tuple(row[k] for k in keys)


# -- the oracle ----------------------------------------------------------------------------


def oracle(delivered: list[dict], hops: tuple[str, str, str], payload_only: set[str]) -> set[tuple]:
    """The chained join of the current rows: a hop whose foreign key has a null part, or whose
    left side is missing, names no row."""
    current = current_rows(delivered, TABLES)

    def value(table: str, row: dict | None, column: str) -> Any:
        if row is None:
            return None
        return _freeze(_expected_value(row[column], TABLES[table][column], table in payload_only))

    out = set()
    for order in current["orders"].values():
        customer = current["customers"].get(order["cust"]) if order["cust"] is not None else None
        fk = customer and (customer["na"], customer["nb"])
        nation = current["nations"].get(fk) if fk and None not in fk else None
        region = current["regions"].get(nation["region"]) if nation and nation["region"] is not None else None
        if any(t == "inner" and r is None for t, r in zip(hops, (customer, nation, region), strict=True)):
            continue
        out.add(
            (
                value("orders", order, "id"),
                value("orders", order, "qty"),
                value("orders", order, "note"),
                value("customers", customer, "name"),
                value("customers", customer, "na"),
                value("nations", nation, "name"),
                value("nations", nation, "since"),
                value("regions", region, "name"),
                value("regions", region, "rate"),
            )
        )
    return out


def expected_subscriptions(delivered: list[dict]) -> list[set[tuple]]:
    """Per hop, ``(fk…, pk…)`` of every current row of its left side whose fk has no null part."""
    current = current_rows(delivered, TABLES)
    return [
        {(r["cust"], r["id"]) for r in current["orders"].values() if r["cust"] is not None},
        {
            (r["na"], r["nb"], r["id"])
            for r in current["customers"].values()
            if None not in (r["na"], r["nb"])
        },
        {(r["region"], r["a"], r["b"]) for r in current["nations"].values() if r["region"] is not None},
    ]


def _silver(pipeline) -> set[tuple]:
    return {tuple(_freeze(v) for v in row) for row in silver_rows(pipeline)}


# -- the property --------------------------------------------------------------------------


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
    hops=st.tuples(*[st.sampled_from(["inner", "left"])] * 3),
    payload_only=st.sets(st.sampled_from(sorted(TABLES))),
    batches=st.integers(2, 4),
    seed=st.integers(0, 2**32 - 1),
    plans=st.sampled_from(sorted(PLANS)),
)
def test_a_chain_equals_the_oracle_after_every_completed_run(
    spark, storage, share, ops, hops, payload_only, batches, seed, plans
):
    assume(not drawn_by_the_first_share(share, seed, batches, payload_only))
    rng = random.Random(seed)
    root = Path(tempfile.mkdtemp(prefix="cdc_join_chain_"))
    joins = [
        {"right": "customers", "foreign_key": ["cust"], "type": hops[0]},
        {"right": "nations", "from": "customers", "foreign_key": ["na", "nb"], "type": hops[1]},
        {"right": "regions", "from": "nations", "foreign_key": ["region"], "type": hops[2]},
    ]
    pipeline, writer = make_pipeline(
        root,
        spark,
        storage,
        tables={t: dict(c) for t, c in TABLES.items()},
        left="orders",
        joins=joins,
        select=SELECT,
        primary_keys=PRIMARY_KEYS,
    )
    writer.payload_only = set(payload_only)
    # o9 → customer 9 → nation (9, z) → region 9: no op touches o9 or customer 9, so only a
    # change of that nation or region walking back through the chain keeps o9's row right.
    seeds = [
        change("regions", "c", 9, _row("regions", 9, None, rng), 1),
        change("nations", "c", (9, "z"), _row("nations", (9, "z"), 9, rng), 2),
        change("customers", "c", 9, _row("customers", 9, (9, "z"), rng), 3),
        change("orders", "c", "o9", _row("orders", "o9", 9, rng), 4),
    ]
    history = _history(ops, rng, batches)
    delivered: list[dict] = []
    for number, batch in enumerate(history):
        now = batch + (seeds if number == 0 else [])
        now += [e for e in now if rng.random() < 0.2]  # duplicates
        if delivered:  # old events again, after newer ones (never o9's or customer 9's)
            again = [
                e for e in delivered if e["key"] not in ("o9", 9) or e["table"] in ("nations", "regions")
            ]
            now += rng.sample(again, min(len(again), rng.randint(1, 4)))
        rng.shuffle(now)
        delivered += land(writer, now, TABLES)
        run_with_crashes(pipeline, rng, PLANS[plans], RUN_CRASHES, REFRESH_CRASHES)
        expected = oracle(delivered, hops, set(payload_only))
        for table in ("customers", "nations", "regions"):  # what --hypothesis-show-statistics counts
            if any(e["table"] == table and e["op"] in "udt" for e in batch) and expected:
                event(f"a batch changed or removed {table} rows while silver held rows")
        assert _silver(pipeline) == expected, f"after batch {number}"
        assert [subscriptions(pipeline, i) for i in range(3)] == expected_subscriptions(delivered), number
    assert pipeline.verify().ok


def _history(ops: list[tuple], rng: random.Random, batches: int) -> list[list[dict]]:
    """The ops as events with sequences (some equal to the previous one), cut into batches.
    A delete removes a row the history has written (or a random key)."""
    events, lsn, written = [], 10, {t: [] for t in TABLES}
    cuts = sorted(rng.sample(range(1, len(ops)), min(batches - 1, len(ops) - 1)))
    for table, op, key, fk, _, same_lsn in ops:
        lsn += 0 if same_lsn else 1
        if op == "t":
            events.append(change(table, "t", None, None, lsn))
            continue
        if op == "d":
            row = rng.choice(written[table]) if written[table] else None
            if row is None:
                continue
            events.append(change(table, "d", _key(table, row), row, lsn))
            continue
        row = _row(table, key, fk, rng)
        written[table].append(row)
        events.append(change(table, op, key, row, lsn))
    out: list[list[dict]] = [[] for _ in range(len(cuts) + 1)]
    for i, e in enumerate(events):
        out[sum(1 for c in cuts if i >= c)].append(e)
    # The last batch renames o9's region and its nation (keeping the chain): only the walk back
    # through the chain's subscriptions reaches o9's row.
    out[-1] += [
        change("nations", "u", (9, "z"), _row("nations", (9, "z"), 9, rng), lsn + 1),
        change("regions", "u", 9, _row("regions", 9, None, rng), lsn + 2),
    ]
    return out
