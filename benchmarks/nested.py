"""Nested-children benchmark: TPC-H's customers, each with its orders as an array (``collect``).

    python -m benchmarks.nested --scale 1 --repeat 3 --out results.json

A fresh lake gets the TPC-H snapshot (customers and orders from :mod:`benchmarks.workload`'s
generator) and an initial run. Then, per kind, ``--repeat`` batches land, each followed by an
incremental run (``plan=auto``):

- ``order_move``: one order moves to another customer: two parents' arrays;
- ``customer_rename``: one customer's name changes: its row, with the orders it already has;
- ``orders_1500`` and ``orders_15000``: that many random orders change their price, in one
  file: about as many parents.

Per run: seconds (without ingest), the affected silver keys the run reports, Spark jobs, and
``verify`` (silver against the arrays recomputed from bronze); after the last batch of each
kind, the full-refresh job (the orders grouped by customer in Spark from bronze, joined to the
customers, an overwrite). The harness is :mod:`benchmarks.shapes`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from benchmarks import shapes
from benchmarks.workload import (
    CUSTOMER_COLUMNS,
    ORDERS_COLUMNS,
    duck_connection,
    orders_and_customers,
    tpch_parquet,
)

TABLES = {"customer": CUSTOMER_COLUMNS, "orders": ORDERS_COLUMNS}
KEYS = {"customer": "c_custkey", "orders": "o_orderkey"}
SELECT = {
    "c_custkey": "customer.c_custkey",
    "c_name": "customer.c_name",
    "c_mktsegment": "customer.c_mktsegment",
    "orders": "orders",
    "order_count": "size(orders)",
}
BATCHES = {"orders_1500": 1500, "orders_15000": 15000}
KINDS = ("order_move", "customer_rename", *BATCHES)


def pipeline_spec() -> dict[str, Any]:
    return {
        "name": "customers_with_orders",
        "lake": "lake",
        "sources": {
            t: {"landing": f"landing/{t}", "primary_key": [KEYS[t]], "sequence_by": ["source.lsn"]}
            for t in TABLES
        },
        "left": "customer",
        "joins": [{"right": "orders", "type": "collect", "foreign_key": ["o_custkey"]}],
        "select": SELECT,
        "output": "customers_with_orders",
    }


class NestedLake(shapes.Lake):
    """The nested lake and the rows its changes start from."""

    name = "nested"
    tables = TABLES
    keys = KEYS
    kinds = KINDS

    def __init__(self, root: Path, scale: float, cache: Path) -> None:
        super().__init__(root, scale, cache)
        self.random = random.Random(7)
        self.orders: pa.Table | None = None
        self.customer: pa.Table | None = None
        self.changed: dict[str, dict[int, dict[str, Any]]] = {"orders": {}, "customer": {}}

    def spec(self) -> dict[str, Any]:
        return pipeline_spec()

    def snapshot(self) -> dict[str, pa.Table]:
        self.orders, self.customer = orders_and_customers(
            duck_connection(), tpch_parquet(self.scale, self.cache)
        )
        return {"customer": self.customer, "orders": self.orders}

    def current(self, table: str, index: int) -> dict[str, Any]:
        """The row at ``index`` of the snapshot, as this benchmark's changes left it."""
        rows = self.orders if table == "orders" else self.customer
        assert rows is not None
        key = rows.column(KEYS[table])[index].as_py()
        return self.changed[table].get(key) or rows.slice(index, 1).to_pylist()[0]

    def update(self, table: str, changes: Sequence[tuple[dict[str, Any], dict[str, Any]]]) -> None:
        for _, after in changes:
            self.changed[table][after[KEYS[table]]] = after
        self.land_many(table, [("u", before, after) for before, after in changes])

    def change(self, kind: str, number: int) -> str:
        assert self.orders is not None and self.customer is not None
        if kind == "order_move":
            old = self.current("orders", self.random.randrange(self.orders.num_rows))
            to = self.current("customer", self.random.randrange(self.customer.num_rows))["c_custkey"]
            self.update("orders", [(old, {**old, "o_custkey": to})])
            return f"order {old['o_orderkey']}: customer {old['o_custkey']} → {to}"
        if kind == "customer_rename":
            old = self.current("customer", self.random.randrange(self.customer.num_rows))
            self.update("customer", [(old, {**old, "c_name": f"{old['c_name']} #{number}"})])
            return f"customer {old['c_custkey']}"
        count = BATCHES[kind]
        picked = self.random.sample(range(self.orders.num_rows), min(count, self.orders.num_rows))
        olds = [self.current("orders", i) for i in picked]
        self.update("orders", [(o, {**o, "o_totalprice": round(o["o_totalprice"] + 1.0, 2)}) for o in olds])
        return f"{len(olds)} orders' prices"

    def full_refresh(self, storage: Any, config: Any) -> DataFrame:
        customer = self.latest(storage, config, "customer")
        orders = self.latest(storage, config, "orders")
        element = F.struct(*[F.col(c) for c in ORDERS_COLUMNS])
        grouped = orders.groupBy(F.col("o_custkey").alias("_parent")).agg(
            F.sort_array(F.collect_list(F.struct(F.col("o_orderkey").alias("k"), element.alias("r")))).alias(
                "_items"
            )
        )
        arrays = grouped.select("_parent", F.expr("transform(_items, x -> x.r)").alias("orders"))
        joined = customer.join(arrays, F.col("customer.c_custkey") == F.col("_parent"), "left")
        joined = joined.withColumn(
            "orders", F.coalesce(F.col("orders"), F.array().cast(arrays.schema["orders"].dataType))
        )
        return joined.select(*[F.expr(e).alias(n) for n, e in SELECT.items()])


def bench(spark: Any, storage: Any, scale: float, repeat: int, work: Path, progress: Any) -> dict[str, Any]:
    """Load the nested lake at ``scale`` under ``work``, then ``repeat`` batches of each kind."""
    lake = NestedLake(work / f"nested_sf{scale:g}", scale, work / "tpch")
    return shapes.measure(spark, storage, lake, repeat, progress)


def main(argv: Sequence[str] | None = None) -> int:
    return shapes.main(NestedLake, __doc__ or "", argv)


if __name__ == "__main__":
    raise SystemExit(main())
