"""Join-chain benchmark: TPC-H's ``orders → customer → nation → region`` at a scale factor.

    python -m benchmarks.chain --scale 1 --repeat 3 --out results.json

A fresh lake gets the TPC-H snapshot (orders and customers from :mod:`benchmarks.workload`'s
generator; TPC-H's 25 nations and 5 regions) and an initial run. Then, per kind, ``--repeat``
batches of one change each land, each followed by an incremental run (``plan=auto``):

- ``region_rename``: one region's name changes: every order of every customer of its 5 nations;
- ``nation_rename``: one nation's name changes: the orders of its customers;
- ``customer_move``: one customer moves to another nation: its ~10 orders.

Per run: seconds (without ingest), the affected silver keys the run reports, Spark jobs, and
``verify`` (silver against the chained join recomputed from bronze); after the last batch of
each kind, the full-refresh job (the three joins in Spark from bronze, an overwrite). The
harness is :mod:`benchmarks.shapes`. Only one lake at a time: a second run replaces it.
"""

from __future__ import annotations

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

REGIONS = ["AFRICA", "AMERICA", "ASIA", "EUROPE", "MIDDLE EAST"]
# TPC-H's nations with their regions (dbgen's table).
NATIONS = [
    ("ALGERIA", 0), ("ARGENTINA", 1), ("BRAZIL", 1), ("CANADA", 1), ("EGYPT", 4), ("ETHIOPIA", 0),
    ("FRANCE", 3), ("GERMANY", 3), ("INDIA", 2), ("INDONESIA", 2), ("IRAN", 4), ("IRAQ", 4),
    ("JAPAN", 2), ("JORDAN", 4), ("KENYA", 0), ("MOROCCO", 0), ("MOZAMBIQUE", 0), ("PERU", 1),
    ("CHINA", 2), ("ROMANIA", 3), ("SAUDI ARABIA", 4), ("VIETNAM", 2), ("RUSSIA", 3),
    ("UNITED KINGDOM", 3), ("UNITED STATES", 1),
]  # fmt: skip
TABLES = {
    "orders": ORDERS_COLUMNS,
    "customer": CUSTOMER_COLUMNS,
    "nation": {"n_nationkey": "int64", "n_name": "string", "n_regionkey": "int64"},
    "region": {"r_regionkey": "int64", "r_name": "string"},
}
KEYS = {"orders": "o_orderkey", "customer": "c_custkey", "nation": "n_nationkey", "region": "r_regionkey"}
SELECT = {
    "o_orderkey": "orders.o_orderkey",
    "o_totalprice": "orders.o_totalprice",
    "o_orderdate": "orders.o_orderdate",
    "c_name": "customer.c_name",
    "c_mktsegment": "customer.c_mktsegment",
    "n_name": "nation.n_name",
    "r_name": "region.r_name",
}
KINDS = ("region_rename", "nation_rename", "customer_move")


def pipeline_spec() -> dict[str, Any]:
    return {
        "name": "tpch_chain",
        "lake": "lake",
        "sources": {
            t: {"landing": f"landing/{t}", "primary_key": [KEYS[t]], "sequence_by": ["source.lsn"]}
            for t in TABLES
        },
        "left": "orders",
        "joins": [
            {"right": "customer", "foreign_key": ["o_custkey"], "type": "inner"},
            {"right": "nation", "from": "customer", "foreign_key": ["c_nationkey"], "type": "left"},
            {"right": "region", "from": "nation", "foreign_key": ["n_regionkey"], "type": "left"},
        ],
        "select": SELECT,
        "output": "orders_by_region",
    }


class ChainLake(shapes.Lake):
    """The chain's lake and the rows its changes start from."""

    name = "chain"
    tables = TABLES
    keys = KEYS
    kinds = KINDS

    def __init__(self, root: Path, scale: float, cache: Path) -> None:
        super().__init__(root, scale, cache)
        self.nations = {
            k: {"n_nationkey": k, "n_name": n, "n_regionkey": r} for k, (n, r) in enumerate(NATIONS)
        }
        self.regions = {k: {"r_regionkey": k, "r_name": n} for k, n in enumerate(REGIONS)}
        self.customers: dict[int, dict[str, Any]] = {}

    def spec(self) -> dict[str, Any]:
        return pipeline_spec()

    def snapshot(self) -> dict[str, pa.Table]:
        orders, customer = orders_and_customers(duck_connection(), tpch_parquet(self.scale, self.cache))
        self.customers = {r["c_custkey"]: r for r in customer.slice(0, 1000).to_pylist()}
        return {
            "region": pa.Table.from_pylist(list(self.regions.values())),
            "nation": pa.Table.from_pylist(list(self.nations.values())),
            "customer": customer,
            "orders": orders,
        }

    def change(self, kind: str, number: int) -> str:
        """Land one change of ``kind``; what it was."""
        if kind == "region_rename":
            key = number % len(REGIONS)
            old = self.regions[key]
            self.regions[key] = {**old, "r_name": f"{REGIONS[key]} #{number}"}
            self.land("region", "u", old, self.regions[key])
            return f"region {key}"
        if kind == "nation_rename":
            key = (7 * number) % len(NATIONS)
            old = self.nations[key]
            self.nations[key] = {**old, "n_name": f"{NATIONS[key][0]} #{number}"}
            self.land("nation", "u", old, self.nations[key])
            return f"nation {key}"
        # a customer with orders (TPC-H: keys that are multiples of 3 place none)
        key = sorted(k for k in self.customers if k % 3)[number]
        old = self.customers[key]
        self.customers[key] = {**old, "c_nationkey": (old["c_nationkey"] + 1) % len(NATIONS)}
        self.land("customer", "u", old, self.customers[key])
        return f"customer {key}"

    def full_refresh(self, storage: Any, config: Any) -> DataFrame:
        rows = {t: self.latest(storage, config, t) for t in TABLES}
        return (
            rows["orders"]
            .join(rows["customer"], F.col("orders.o_custkey") == F.col("customer.c_custkey"), "inner")
            .join(rows["nation"], F.col("customer.c_nationkey") == F.col("nation.n_nationkey"), "left")
            .join(rows["region"], F.col("nation.n_regionkey") == F.col("region.r_regionkey"), "left")
            .select(*[F.expr(e).alias(n) for n, e in SELECT.items()])
        )


def bench(spark: Any, storage: Any, scale: float, repeat: int, work: Path, progress: Any) -> dict[str, Any]:
    """Load the chain's lake at ``scale`` under ``work``, then ``repeat`` batches of each kind."""
    lake = ChainLake(work / f"chain_sf{scale:g}", scale, work / "tpch")
    return shapes.measure(spark, storage, lake, repeat, progress)


def main(argv: Sequence[str] | None = None) -> int:
    return shapes.main(ChainLake, __doc__ or "", argv)


if __name__ == "__main__":
    raise SystemExit(main())
