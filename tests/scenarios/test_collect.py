"""Nested children (``type: collect``): each customer with its orders as an array.

A child's insert, update, delete or foreign-key move rewrites exactly the parents it names
before and after, a parent without children holds an empty array, elements are ordered by the
children's key, and a parent with more children than ``max_children`` fails the run naming it.
Each run is compared with a model kept in the test and with ``verify``.
"""

from __future__ import annotations

import pytest

from cdc_join.errors import InputError
from cdc_join.report import SimulatedCrash
from tests.support import make_pipeline

TABLES = {
    "customers": {"id": "int64", "name": "string"},
    "orders": {"id": "int64", "cust": "int64", "total": "int64"},
}
SELECT = {
    "id": "customers.id",
    "name": "customers.name",
    "order_ids": "transform(orders, o -> o.id)",
    "totals": "transform(orders, o -> o.total)",
    "n": "size(orders)",
}


class Nested:
    def __init__(self, tmp_path, spark, storage, **join) -> None:
        joins = [{"right": "orders", "type": "collect", "foreign_key": ["cust"], **join}]
        self.pipeline, self.w = make_pipeline(
            tmp_path, spark, storage, tables=TABLES, left="customers", joins=joins, select=SELECT
        )
        self.rows: dict[str, dict[int, dict]] = {t: {} for t in TABLES}
        self.lsn = 0

    def upsert(self, table: str, *rows: dict) -> None:
        events = []
        for row in rows:
            self.lsn += 1
            events.append(self.w.upsert(table, row, self.lsn))
            self.rows[table][row["id"]] = row
        self.w.write(table, events)

    def delete(self, table: str, key: int) -> None:
        self.lsn += 1
        self.w.write(table, [self.w.delete(table, self.rows[table].pop(key), self.lsn)])

    def expected(self) -> set[tuple]:
        out = set()
        for c in self.rows["customers"].values():
            mine = sorted(
                (o for o in self.rows["orders"].values() if o["cust"] == c["id"]), key=lambda o: o["id"]
            )
            ids, totals = tuple(o["id"] for o in mine), tuple(o["total"] for o in mine)
            out.add((c["id"], c["name"], ids, totals, len(mine)))
        return out

    def silver(self) -> set[tuple]:
        cfg, storage = self.pipeline.config, self.pipeline.storage
        if not storage.exists(cfg.silver_path):
            return set()
        rows = storage.read(cfg.silver_path).select(*SELECT).collect()
        return {(i, n, tuple(ids), tuple(t), k) for i, n, ids, t, k in rows}

    def run(self, **kwargs) -> dict:
        report = self.pipeline.run(**kwargs)
        assert self.silver() == self.expected()
        return report.steps


def _loaded(tmp_path, spark, storage, **join) -> Nested:
    nested = Nested(tmp_path, spark, storage, **join)
    nested.upsert("customers", *[{"id": c, "name": f"c{c}"} for c in (1, 2, 3)])
    # Landed out of key order: elements come ordered by the order key anyway.
    nested.upsert("orders", *[{"id": o, "cust": 1 + o % 2, "total": 10 * o} for o in (6, 2, 5, 1, 4, 3)])
    nested.run()
    return nested


@pytest.mark.parametrize(
    "plan",
    [
        pytest.param("incremental", marks=pytest.mark.plan_path),
        pytest.param("recompute", marks=pytest.mark.core),
    ],
)
def test_a_childs_changes_rewrite_exactly_the_parents_it_names(tmp_path, spark, storage, plan):
    nested = _loaded(tmp_path, spark, storage)
    assert (3, "c3", (), (), 0) in nested.silver()  # no children: an empty array, not null
    nested.upsert("orders", {"id": 7, "cust": 3, "total": 70})  # insert
    assert nested.run(plan=plan)["resolve"]["affected_keys"] == 1
    nested.upsert("orders", {"id": 2, "cust": 1, "total": 21})  # update
    assert nested.run(plan=plan)["resolve"]["affected_keys"] == 1
    nested.upsert("orders", {"id": 4, "cust": 3, "total": 40})  # fk move: parent 1 → 3
    assert nested.run(plan=plan)["resolve"]["affected_keys"] == 2
    nested.delete("orders", 5)  # delete
    assert nested.run(plan=plan)["resolve"]["affected_keys"] == 1
    nested.upsert("orders", {"id": 8, "cust": 9, "total": 80})  # a parent that does not exist
    nested.run(plan=plan)
    assert nested.pipeline.verify().ok


def test_a_parent_deleted_and_created_again_finds_its_children(tmp_path, spark, storage):
    nested = _loaded(tmp_path, spark, storage)
    nested.delete("customers", 1)
    nested.run()
    nested.upsert("customers", {"id": 1, "name": "c1 again"})
    nested.upsert("customers", {"id": 9, "name": "c9"})  # its child (order 8) came first
    nested.upsert("orders", {"id": 8, "cust": 9, "total": 80})
    nested.run()
    assert nested.pipeline.verify().ok


@pytest.mark.kill
def test_a_nested_run_killed_after_any_step_and_rerun_ends_like_an_uninterrupted_run(
    tmp_path, spark, storage
):
    nested = _loaded(tmp_path, spark, storage)
    batches = {
        "state:orders": lambda: nested.upsert("orders", {"id": 1, "cust": 3, "total": 1}),
        "resolve": lambda: nested.upsert("orders", {"id": 9, "cust": 2, "total": 9}),
        "silver": lambda: nested.delete("orders", 2),
        "subscription:orders": lambda: nested.upsert("orders", {"id": 3, "cust": 1, "total": 3}),
        "cleanup": lambda: nested.upsert("customers", {"id": 2, "name": "c2*"}),
    }
    for step, change in batches.items():
        change()
        with pytest.raises(SimulatedCrash):
            nested.pipeline.run(crash_after=step)
        nested.run()
        nested.upsert("orders", {"id": 100 + len(nested.rows["orders"]), "cust": 2, "total": 0})
        nested.run()
    assert nested.pipeline.verify().ok


@pytest.mark.core
def test_a_full_refresh_of_nested_children_equals_its_runs(tmp_path, spark, storage):
    nested = _loaded(tmp_path, spark, storage)
    nested.upsert("orders", {"id": 3, "cust": 2, "total": 33})
    nested.run()
    before = nested.silver()
    nested.pipeline.full_refresh()
    assert nested.silver() == before == nested.expected()
    nested.upsert("orders", {"id": 4, "cust": 2, "total": 44})  # from parent 1 to 2
    assert nested.run(plan="incremental")["resolve"]["affected_keys"] == 2


@pytest.mark.plan_path
def test_a_parent_with_more_children_than_max_children_fails_the_run_naming_it(tmp_path, spark, storage):
    nested = _loaded(tmp_path, spark, storage, max_children=3)
    nested.upsert("orders", *[{"id": o, "cust": 2, "total": 0} for o in (10, 11)])
    with pytest.raises(
        InputError, match=r"orders: a parent has more children than max_children \(3\): \{'id': 2\}: 5"
    ):
        nested.pipeline.run()
    # Once the data is fixed, the next run goes through.
    nested.delete("orders", 10)
    nested.delete("orders", 11)
    nested.run()
    assert nested.pipeline.verify().ok


@pytest.mark.plan_path
@pytest.mark.parametrize("plan", ["incremental", "recompute"])
def test_children_naming_no_parent_count_for_no_cap_and_reach_no_row(tmp_path, spark, storage, plan):
    # Guest orders, or orders landing before their customer: more of them than max_children
    # under a customer that does not exist (7), or no longer does (2), jam no path.
    nested = Nested(tmp_path, spark, storage, max_children=2)
    nested.upsert("customers", {"id": 1, "name": "c1"}, {"id": 2, "name": "c2"})
    nested.upsert("orders", {"id": 10, "cust": 1, "total": 1})
    nested.upsert("orders", *[{"id": o, "cust": 7, "total": o} for o in (11, 12, 13)])
    nested.run()
    assert nested.silver() == {(1, "c1", (10,), (1,), 1), (2, "c2", (), (), 0)}
    assert nested.pipeline.verify().ok
    nested.upsert("orders", *[{"id": o, "cust": 2, "total": o} for o in (21, 22, 23)])
    nested.delete("customers", 2)
    nested.upsert("orders", {"id": 14, "cust": 7, "total": 14})
    nested.run(plan=plan)
    nested.pipeline.full_refresh()
    assert nested.silver() == nested.expected() == {(1, "c1", (10,), (1,), 1)}
    nested.upsert("customers", {"id": 3, "name": "c3"})
    nested.run(plan=plan)
    assert nested.pipeline.verify().ok
    # A parent that comes into being with more children than the cap fails the run naming it.
    nested.upsert("customers", {"id": 7, "name": "c7"})
    with pytest.raises(InputError, match=r"max_children \(2\): \{'id': 7\}: 4 orders"):
        nested.pipeline.run(plan=plan)
