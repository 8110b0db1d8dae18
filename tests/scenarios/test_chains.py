"""Join chains: ``orders → customers → nations → regions``, each hop's foreign key a column of
the source joined before it.

A change anywhere in the chain reaches exactly the silver rows it affects: a region rename
every order of every customer of every nation in it, a customer's nation move that customer's
orders, a deleted nation removes its orders' rows (inner) or nulls their chained columns
(left). Each run's rows are compared with a model of the join kept in the test, and with
``verify``; the report's affected keys show that nothing else was recomputed.
"""

from __future__ import annotations

import dataclasses

import pytest
from pyspark.sql import functions as F

from cdc_join.checks import quality
from cdc_join.columns import LHS_HASH, WRITTEN
from cdc_join.errors import ConfigError
from cdc_join.report import SimulatedCrash
from cdc_join.run.pipeline import Pipeline
from tests.support import make_pipeline, silver_rows, subscriptions

TABLES = {
    "orders": {"id": "int64", "cust": "int64", "qty": "int64"},
    "customers": {"id": "int64", "nation": "int64", "name": "string"},
    "nations": {"id": "int64", "region": "int64", "name": "string"},
    "regions": {"id": "int64", "name": "string"},
}
SELECT = {
    "order_id": "orders.id",
    "qty": "orders.qty",
    "customer": "customers.name",
    "nation": "nations.name",
    "region": "regions.name",
}


class Chain:
    """The pipeline, its event writer, and the source rows the test expects silver to join."""

    def __init__(self, tmp_path, spark, storage, hop_type: str) -> None:
        joins = [
            {"right": "customers", "foreign_key": ["cust"]},
            {"right": "nations", "from": "customers", "foreign_key": ["nation"], "type": hop_type},
            {"right": "regions", "from": "nations", "foreign_key": ["region"], "type": hop_type},
        ]
        self.pipeline, self.w = make_pipeline(
            tmp_path, spark, storage, tables=TABLES, left="orders", joins=joins, select=SELECT
        )
        self.inner = hop_type == "inner"
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
        for order in self.rows["orders"].values():
            customer = self.rows["customers"].get(order["cust"])
            if customer is None:
                continue  # the first hop is inner
            nation = self.rows["nations"].get(customer["nation"])
            region = self.rows["regions"].get(nation["region"]) if nation else None
            if self.inner and (nation is None or region is None):
                continue
            out.add(
                (
                    order["id"],
                    order["qty"],
                    customer["name"],
                    nation and nation["name"],
                    region and region["name"],
                )
            )
        return out

    def run(self, **kwargs) -> dict:
        report = self.pipeline.run(**kwargs)
        assert silver_rows(self.pipeline) == self.expected()
        return report.steps


def _loaded(tmp_path, spark, storage, hop_type: str = "inner") -> Chain:
    """Two regions of two nations each, a customer per nation, two orders per customer."""
    chain = Chain(tmp_path, spark, storage, hop_type)
    chain.upsert("regions", {"id": 1, "name": "EUROPE"}, {"id": 2, "name": "ASIA"})
    chain.upsert(
        "nations",
        *[{"id": n, "region": 1 + (n - 1) // 2, "name": f"nation{n}"} for n in (1, 2, 3, 4)],
    )
    chain.upsert("customers", *[{"id": c, "nation": c, "name": f"cust{c}"} for c in (1, 2, 3, 4)])
    chain.upsert("orders", *[{"id": o, "cust": 1 + (o - 1) // 2, "qty": o} for o in range(1, 9)])
    chain.run()
    return chain


@pytest.mark.parametrize(
    "plan",
    [
        pytest.param("incremental", marks=pytest.mark.core),
        pytest.param("recompute", marks=pytest.mark.plan_path),
    ],
)
def test_a_region_rename_reaches_every_order_in_it_and_no_other(tmp_path, spark, storage, plan):
    chain = _loaded(tmp_path, spark, storage)
    chain.upsert("regions", {"id": 1, "name": "EU"})
    steps = chain.run(plan=plan)
    assert steps["resolve"]["affected_keys"] == 4  # orders 1-4: customers 1, 2 of nations 1, 2
    if plan == "incremental":
        assert steps["lookup"]["regions"]["subscribers"] == 2  # nations 1 and 2
        assert steps["lookup"]["nations"]["subscribers"] == 2  # customers 1 and 2
        assert steps["lookup"]["customers"]["subscribers"] == 4
    assert chain.pipeline.verify().ok


@pytest.mark.parametrize("plan", [pytest.param("incremental", marks=pytest.mark.plan_path), "recompute"])
def test_a_customer_moving_nation_moves_its_orders_nation_and_region(tmp_path, spark, storage, plan):
    chain = _loaded(tmp_path, spark, storage)
    chain.upsert("customers", {"id": 1, "nation": 4, "name": "cust1"})
    steps = chain.run(plan=plan)
    assert steps["resolve"]["affected_keys"] == 2
    # Its old nation's rename no longer reaches it; its new region's does.
    chain.upsert("nations", {"id": 1, "region": 1, "name": "nation1*"})
    chain.upsert("regions", {"id": 2, "name": "ASIA*"})
    steps = chain.run(plan=plan)
    # Region 2 holds nations 3 and 4: the orders of customers 3, 4 and 1 (now in nation 4);
    # nation 1 has no customer left.
    assert steps["resolve"]["affected_keys"] == 6
    if plan == "incremental":
        assert steps["resolve"]["stale_dropped"] == 0
    assert chain.pipeline.verify().ok


@pytest.mark.parametrize("hop_type", ["inner", pytest.param("left", marks=pytest.mark.plan_path)])
def test_deleting_a_nation_removes_or_nulls_its_orders_rows(tmp_path, spark, storage, hop_type):
    chain = _loaded(tmp_path, spark, storage, hop_type)
    chain.delete("nations", 2)
    steps = chain.run()
    assert steps["resolve"]["affected_keys"] == 2
    held = {row[0]: row for row in silver_rows(chain.pipeline)}
    if hop_type == "inner":
        assert 3 not in held and 4 not in held
    else:
        assert held[3] == (3, 3, "cust2", None, None)
    # The nation comes back, in the other region.
    chain.upsert("nations", {"id": 2, "region": 2, "name": "nation2"})
    chain.run()
    assert chain.pipeline.verify().ok


def test_a_null_or_dangling_foreign_key_in_the_middle_of_a_left_chain_nulls_the_rest(
    tmp_path, spark, storage
):
    chain = _loaded(tmp_path, spark, storage, "left")
    chain.upsert(
        "customers", {"id": 1, "nation": None, "name": "cust1"}, {"id": 2, "nation": 9, "name": "cust2"}
    )
    chain.run()
    chain.upsert("nations", {"id": 9, "region": 2, "name": "nation9"})
    steps = chain.run()
    assert steps["resolve"]["affected_keys"] == 2  # customer 2's orders, now in nation 9
    assert chain.pipeline.verify().ok


@pytest.mark.kill
def test_a_chain_killed_after_any_step_and_rerun_ends_like_an_uninterrupted_run(tmp_path, spark, storage):
    chain = _loaded(tmp_path, spark, storage, "left")
    batches = {
        "state:customers": lambda: chain.upsert("customers", {"id": 1, "nation": 3, "name": "cust1"}),
        "silver": lambda: chain.upsert("regions", {"id": 2, "name": "ASIA*"}),
        "subscription:customers": lambda: chain.upsert("customers", {"id": 2, "nation": 1, "name": "c2"}),
        "subscription:nations": lambda: chain.upsert("customers", {"id": 3, "nation": 2, "name": "c3"}),
        "subscription:regions": lambda: chain.upsert("nations", {"id": 1, "region": 2, "name": "n1"}),
        "cleanup": lambda: chain.upsert("nations", {"id": 3, "region": 1, "name": "n3"}),
    }
    for step, change in batches.items():
        change()
        with pytest.raises(SimulatedCrash):
            chain.pipeline.run(crash_after=step)
        chain.run()
        # Then a change at the end of the chain must reach exactly the current rows.
        chain.upsert("regions", {"id": 1, "name": f"EUROPE after {step}"})
        chain.run()
    assert chain.pipeline.verify().ok


@pytest.mark.plan_path
def test_a_full_refresh_of_a_chain_equals_its_runs(tmp_path, spark, storage):
    chain = _loaded(tmp_path, spark, storage)
    chain.upsert("nations", {"id": 4, "region": 1, "name": "nation4"})
    chain.run()
    before = silver_rows(chain.pipeline)
    chain.pipeline.full_refresh()
    assert silver_rows(chain.pipeline) == before == chain.expected()
    # Subscriptions rebuilt from each hop's state still find the rows a rename reaches.
    chain.upsert("regions", {"id": 1, "name": "EU"})
    steps = chain.run(plan="incremental")
    assert steps["resolve"]["affected_keys"] == 6


def test_the_orphan_rate_of_a_chained_left_join_reads_the_foreign_key_of_the_source_it_hangs_off(
    tmp_path, spark, storage
):
    chain = _loaded(tmp_path, spark, storage, "left")
    # Customer 1 names a nation that does not exist (2 orphan orders); customer 2 names none
    # (2 orders without a foreign key, which are no orphans); nation 3 names no region.
    chain.upsert(
        "customers", {"id": 1, "nation": 9, "name": "cust1"}, {"id": 2, "nation": None, "name": "cust2"}
    )
    chain.upsert("nations", {"id": 3, "region": None, "name": "nation3"})
    chain.run()
    config = dataclasses.replace(chain.pipeline.config, quality={"orphan_rate_max": 1.0})
    found = {r.check: r for r in quality.check(config, storage, run_id=1, write=False).results}
    # Run 1 wrote all eight orders, when every customer named a nation that exists.
    assert found["orphan_rate:nations"].observed.startswith("orphan rate 0.0000")
    found = {r.check: r for r in quality.check(config, storage, run_id=2, write=False).results}
    # Run 2 wrote orders 1-6. A nation is named by orders 1, 2 (nation 9: orphans) and 5, 6
    # (nation 3); orders 3, 4 name none. No written order reaches a nation naming a region.
    assert found["orphan_rate:nations"].observed.startswith("orphan rate 0.5000 (2 rows)")
    assert found["orphan_rate:regions"].observed.startswith("orphan rate 0.0000")


@pytest.mark.parametrize("hop", ["nations", pytest.param("regions", marks=pytest.mark.plan_path)])
def test_a_leftover_subscription_deep_in_a_chain_is_dropped_as_stale_and_reaches_no_row(
    tmp_path, spark, storage, hop
):
    chain = _loaded(tmp_path, spark, storage)
    cfg, join = chain.pipeline.config, chain.pipeline.config.join_for_alias(hop)
    # A leftover CombinedKey: customer 1 subscribed to nation 2 (or nation 1 to region 2), as
    # if a run died after subscribing it there.
    path = cfg.subscription_path(join)
    fk, pk = ("fk_nation", "pk_id") if hop == "nations" else ("fk_region", "pk_id")
    leftover = (
        storage.read(path)
        .filter(F.col(pk) == 1)
        .withColumn(fk, F.lit(2).cast("long"))
        .withColumn(LHS_HASH, F.lit(12345).cast("long"))
        .withColumn(WRITTEN, F.lit(storage.version(path) + 1).cast("long"))
    )
    storage.append(path, leftover)
    assert (2, 1) in subscriptions(chain.pipeline, [j.alias for j in cfg.joins].index(hop))
    chain.upsert(
        hop, {"nations": {"id": 2, "region": 1, "name": "nation2*"}, "regions": {"id": 2, "name": "A*"}}[hop]
    )
    steps = chain.run()
    assert steps["resolve"]["stale_dropped"] == 1
    assert steps["cleanup"]["stale_subscriptions_removed"] == 1
    # Only the orders the change reaches: customer 2's (nation 2), or customers 3 and 4's
    # (region 2); none of customer 1's through the leftover.
    assert steps["resolve"]["affected_keys"] == (2 if hop == "nations" else 4)
    assert (2, 1) not in subscriptions(chain.pipeline, [j.alias for j in cfg.joins].index(hop))
    assert chain.pipeline.verify().ok


def test_a_chained_foreign_key_the_source_it_hangs_off_lacks_fails_before_anything_is_written(
    tmp_path, spark, storage
):
    joins = [
        {"right": "customers", "foreign_key": ["cust"]},
        {"right": "nations", "from": "customers", "foreign_key": ["nation_id"]},
        {"right": "regions", "from": "nations", "foreign_key": ["region"]},
    ]
    pipeline, w = make_pipeline(
        tmp_path, spark, storage, tables=TABLES, left="orders", joins=joins, select=SELECT
    )
    for table, row in [
        ("regions", {"id": 1, "name": "r"}),
        ("nations", {"id": 1, "region": 1, "name": "n"}),
        ("customers", {"id": 1, "nation": 1, "name": "c"}),
        ("orders", {"id": 1, "cust": 1, "qty": 1}),
    ]:
        w.write(table, [w.upsert(table, row, 1)])
    with pytest.raises(ConfigError, match=r"joins\[1\]\.foreign_key: 'customers' has no column 'nation_id'"):
        pipeline.run()
    assert not storage.exists(pipeline.config.silver_path)


@pytest.mark.plan_path
def test_a_select_change_that_adds_a_chained_column_recomputes_and_repair_restores_a_damaged_row(
    tmp_path, spark, storage
):
    chain = _loaded(tmp_path, spark, storage, "left")
    cfg = chain.pipeline.config
    wider = dataclasses.replace(cfg, select=(*cfg.select, ("region_id", "nations.region")))
    pipeline = Pipeline(wider, spark, storage)
    pipeline.run()
    held = silver_rows(pipeline, ["order_id", "region_id"])
    assert held == {(o, 1 if o <= 4 else 2) for o in range(1, 9)}
    # A silver row changed behind cdc_join's back: verify finds it, --repair puts it right.
    silver = storage.read(wider.silver_path).filter(F.col("order_id") != 3)
    storage.overwrite(wider.silver_path, silver)
    assert not pipeline.verify().ok
    assert pipeline.verify(repair=True).ok
    assert (3, 1) in silver_rows(pipeline, ["order_id", "region_id"])
