"""Two operations on one pipeline, the second run whole at every step boundary of the first.

Pairs: a run against a run, against a full refresh, against ``cdc-join optimize``, and a full
refresh against ``verify --repair``. The first one is held at the start of one of its steps
(its progress hook), the second runs from start to end, then the first goes on: it commits or
stops with ConcurrentRunError. A run after that must leave the silver of the events so far (an
oracle kept beside the events) and ``verify`` must pass. The lake is a ``file://`` URI, so no
lock file keeps the two apart.

The default run checks one boundary per pair (a different step for each pair); CI's deep pass
(``CDC_JOIN_INTERLEAVINGS=all``) checks every boundary of every pair.
"""

from __future__ import annotations

import dataclasses
import os

import pytest

from cdc_join.errors import ConcurrentRunError
from cdc_join.run.maintenance import optimize_pipeline
from cdc_join.run.pipeline import Pipeline
from tests.support import PauseAt, in_thread, make_pipeline, silver_rows

# Examples, rounds or step boundaries set by CDC_JOIN_* variables: CI runs them deeper (-m depth).
pytestmark = [pytest.mark.depth, pytest.mark.race]

TABLES = {
    "customers": {"id": "int64", "name": "string"},
    "orders": {"id": "int64", "customer": "int64", "quantity": "int64"},
}
OPERATIONS = {
    "run": lambda p: p.run(),
    "full-refresh": lambda p: p.full_refresh(),
    "optimize": lambda p: optimize_pipeline(p.storage, p.config, force=True),
    "verify --repair": lambda p: p.verify(repair=True),
}
PAIRS = [("run", "run"), ("run", "full-refresh"), ("run", "optimize"), ("full-refresh", "verify --repair")]
#: The step boundary each pair is checked at by the default run (every one with
#: CDC_JOIN_INTERLEAVINGS=all): the plan, the state, silver, and the subscriptions.
SAMPLED = {"run vs run": "plan", "run vs full-refresh": "state", "run vs optimize": "silver"}


class Shop:
    """The pipeline, its event writer and the oracle: the current rows of both sources."""

    def __init__(self, tmp_path, spark, storage) -> None:
        base, self.w = make_pipeline(
            tmp_path,
            spark,
            storage,
            tables=TABLES,
            left="orders",
            joins=[{"right": "customers", "foreign_key": ["customer"], "type": "left"}],
            select={"order_id": "orders.id", "quantity": "orders.quantity", "name": "customers.name"},
        )
        self.config = dataclasses.replace(base.config, lake="file://" + str(tmp_path / "lake"))
        self.pipeline = Pipeline(self.config, spark, storage)
        self.customers: dict[int, str] = {}
        self.orders: dict[int, tuple[int, int]] = {}
        self.lsn = 0
        self.batches = 0

    def _next(self) -> int:
        self.lsn += 1
        return self.lsn

    def batch(self) -> None:
        """Changes on both sides: a rename, a new customer, an order moved, one deleted, one added."""
        n = self.batches = self.batches + 1
        customers = [(10 + n % 4, f"c{n}"), (20 + n, f"new{n}")]
        events = []
        for cid, name in customers:
            self.customers[cid] = name
            events.append(self.w.upsert("customers", {"id": cid, "name": name}, self._next()))
        self.w.write("customers", events)
        events = []
        moved, gone, added = n % 5, (n + 2) % 5, 100 + n
        for oid, cid in ((moved, 10 + (n + 1) % 4), (added, 20 + n)):
            self.orders[oid] = (cid, n)
            events.append(self.w.upsert("orders", {"id": oid, "customer": cid, "quantity": n}, self._next()))
        if gone in self.orders and gone != moved:
            cid, q = self.orders.pop(gone)
            events.append(self.w.delete("orders", {"id": gone, "customer": cid, "quantity": q}, self._next()))
        self.w.write("orders", events)

    def expected(self) -> set[tuple]:
        return {(o, q, self.customers.get(c)) for o, (c, q) in self.orders.items()}

    def held(self, step: str | None) -> tuple[Pipeline, PauseAt]:
        hold = PauseAt(step)
        return Pipeline(self.config, self.pipeline.spark, self.pipeline.storage, progress=hold), hold


def _boundaries(shop: Shop, first: str) -> list[str]:
    """The steps ``first`` goes through on a batch like the ones below (one run of it)."""
    shop.batch()
    pipeline, seen = shop.held(None)
    OPERATIONS[first](pipeline)
    shop.pipeline.run()
    assert silver_rows(shop.pipeline) == shop.expected()
    return list(dict.fromkeys(seen.steps))


@pytest.mark.parametrize("first,second", PAIRS, ids=[f"{a} vs {b}" for a, b in PAIRS])
def test_a_second_operation_at_every_step_boundary_of_the_first_leaves_silver_right(
    tmp_path, spark, storage, first, second
):
    shop = Shop(tmp_path, spark, storage)
    shop.batch()
    shop.pipeline.run()
    steps = _boundaries(shop, first)
    every = os.environ.get("CDC_JOIN_INTERLEAVINGS") == "all"
    chosen = steps if every else [SAMPLED.get(f"{first} vs {second}", steps[len(steps) // 2])]
    outcomes = []
    for step in chosen:
        shop.batch()
        held, hold = shop.held(step)
        work = in_thread(lambda held=held: OPERATIONS[first](held))
        assert hold.reached.wait(300), f"{first} never reached step {step}"
        try:
            OPERATIONS[second](shop.pipeline)
            other = "committed"
        except ConcurrentRunError:
            other = "ConcurrentRunError"
        hold.release()
        outcomes.append((step, work.result(), other))
        assert outcomes[-1][1] in ("committed", "ConcurrentRunError"), outcomes[-1]
        shop.pipeline.run()
        assert silver_rows(shop.pipeline) == shop.expected(), outcomes[-1]
        found = shop.pipeline.verify()
        assert found.ok, (outcomes[-1], found.summary())
    print(f"{first} vs {second}: {len(chosen)} of {len(steps)} boundaries: {outcomes}")
