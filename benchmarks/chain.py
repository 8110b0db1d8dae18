"""Join-chain benchmark: TPC-H's ``orders → customer → nation → region`` at a scale factor.

    python -m benchmarks.chain --scale 1 --repeat 3 --out results.json

A fresh lake gets the TPC-H snapshot (orders and customers from :mod:`benchmarks.workload`'s
generator; TPC-H's 25 nations and 5 regions) and an initial run. Then, per kind, ``--repeat``
batches of one change each land, each followed by an incremental run (``plan=auto``):

- ``region_rename``: one region's name changes: every order of every customer of its 5 nations;
- ``nation_rename``: one nation's name changes: the orders of its customers;
- ``customer_move``: one customer moves to another nation: its ~10 orders.

Per run: seconds (without ingest), the affected silver keys the run reports, Spark jobs, and
``verify`` (silver against the chained join recomputed from bronze). After the last batch of
each kind, the full-refresh job a user of the backend would write (newest row per key from
bronze, the three joins, an overwrite, all in Spark) is timed on the same bronze. Only one
lake at a time: a second run of this module replaces it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import yaml
from pyspark.sql import functions as F

from benchmarks.run import _load, machine, peak_driver_rss_mb, reset_peak_rss
from benchmarks.workload import (
    CUSTOMER_COLUMNS,
    ORDERS_COLUMNS,
    _append_bronze,
    _row,
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


class ChainLake:
    """The lake, its landing folders and the rows the benchmark's changes start from."""

    def __init__(self, root: Path, scale: float, cache: Path) -> None:
        self.root, self.scale, self.cache = root, scale, cache
        self.lsn = 0
        self.files = 0
        self.nations = {
            k: {"n_nationkey": k, "n_name": n, "n_regionkey": r} for k, (n, r) in enumerate(NATIONS)
        }
        self.regions = {k: {"r_regionkey": k, "r_name": n} for k, n in enumerate(REGIONS)}
        self.customers: dict[int, dict[str, Any]] = {}

    def write_config(self) -> Path:
        for t in TABLES:
            (self.root / "landing" / t).mkdir(parents=True, exist_ok=True)
        path = self.root / "pipeline.yml"
        path.write_text(yaml.safe_dump(pipeline_spec(), sort_keys=False))
        return path

    def land(self, table: str, op: str, before: dict | None, after: dict | None) -> None:
        self.lsn += 1
        self.files += 1
        ts = 1_700_000_000_000 + self.lsn
        event = {
            "before": _row(table, before, TABLES[table]),
            "after": _row(table, after, TABLES[table]),
            "source": {"connector": "postgresql", "table": table, "lsn": self.lsn, "ts_ms": ts},
            "op": op,
            "ts_ms": ts,
        }
        final = self.root / "landing" / table / f"{table}-{self.files:06d}.jsonl"
        tmp = final.with_name(f"_{final.name}.tmp")
        tmp.write_text(json.dumps(event, separators=(",", ":")) + "\n")
        tmp.rename(final)

    def load_snapshot(self, spark: Any, storage: Any, config: Any) -> dict[str, int]:
        """A seed row per table through landing and ingest, the rest appended to bronze."""
        from cdc_join.ingest import ingest_all

        paths = tpch_parquet(self.scale, self.cache)
        con = duck_connection()
        orders, customer = orders_and_customers(con, paths)
        self.customers = {r["c_custkey"]: r for r in customer.slice(0, 1000).to_pylist()}
        tables = {
            "region": pa.Table.from_pylist(list(self.regions.values())),
            "nation": pa.Table.from_pylist(list(self.nations.values())),
            "customer": customer,
            "orders": orders,
        }
        first = {}
        for name, table in tables.items():
            self.land(name, "r", None, table.slice(0, 1).to_pylist()[0])
            first[name] = self.lsn + 1
            self.lsn += table.num_rows - 1
        ingest_all(spark, storage, config)
        for name, table in tables.items():
            rest = table.slice(1).cast(pa.schema([table.schema.field(c) for c in table.column_names]))
            if rest.num_rows:
                _append_bronze(config.bronze_path(name), name, rest, first[name], TABLES[name])
        return {name: t.num_rows for name, t in tables.items()}

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


def spark_full_refresh(storage: Any, config: Any) -> float:
    """The job a user would write in Spark: newest row per key from bronze, the chain, overwrite."""
    start = time.perf_counter()

    def latest(table: str) -> Any:
        key = KEYS[table]
        bronze = storage.read(config.bronze_path(table)).filter(F.col("_op") != "t")
        newest = bronze.groupBy(F.coalesce(F.col(f"_after.{key}"), F.col(f"_before.{key}")).alias("_k")).agg(
            F.max_by(F.struct("_op", "_after"), F.col("_seq")).alias("_n")
        )
        return newest.filter(F.col("_n._op") != "d").select("_n._after.*").alias(table)

    rows = {t: latest(t) for t in TABLES}
    joined = (
        rows["orders"]
        .join(rows["customer"], F.col("orders.o_custkey") == F.col("customer.c_custkey"), "inner")
        .join(rows["nation"], F.col("customer.c_nationkey") == F.col("nation.n_nationkey"), "left")
        .join(rows["region"], F.col("nation.n_regionkey") == F.col("region.r_regionkey"), "left")
        .select(*[F.expr(e).alias(n) for n, e in SELECT.items()])
    )
    path = config.silver_path.rsplit("/", 1)[0] + "/orders_by_region_full_refresh"
    storage.create(path, joined.schema, cdf=False)
    storage.overwrite(path, joined)
    return time.perf_counter() - start


def bench(spark: Any, storage: Any, scale: float, repeat: int, work: Path, progress: Any) -> dict[str, Any]:
    """Load the lake at ``scale``, then ``repeat`` batches of each kind; the measurements."""
    from cdc_join.config import load_config
    from cdc_join.pipeline import Pipeline

    root = work / f"chain_sf{scale:g}"
    if root.exists():
        import shutil

        shutil.rmtree(root)
    lake = ChainLake(root, scale, work / "tpch")
    config = load_config(lake.write_config())
    pipeline = Pipeline(config, spark, storage)
    start = time.perf_counter()
    rows = lake.load_snapshot(spark, storage, config)
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    pipeline.run()
    first_s = time.perf_counter() - start
    progress(f"snapshot {rows} loaded in {load_s:.1f} s, first run {first_s:.1f} s")
    out: dict[str, Any] = {
        "rows": rows,
        "load_s": round(load_s, 1),
        "first_run_s": round(first_s, 1),
        "kinds": {},
    }
    for kind in KINDS:
        runs = []
        for number in range(repeat):
            what = lake.change(kind, number)
            load_before = _load()
            reset_peak_rss(spark)
            start = time.perf_counter()
            report = pipeline.run()
            seconds = time.perf_counter() - start - report.seconds.get("ingest", 0.0)
            found = pipeline.verify()
            runs.append(
                {
                    "change": what,
                    "run_s": round(seconds, 2),
                    "affected_keys": report.steps.get("resolve", {}).get("affected_keys"),
                    "plan": report.steps.get("plan", {}).get("path"),
                    "estimated_affected_rows": report.steps.get("plan", {}).get("estimated_affected_rows"),
                    "spark_jobs": sum(n for step, n in report.spark_jobs.items() if step != "ingest"),
                    "steps_s": {k: round(v, 2) for k, v in report.seconds.items()},
                    "verify_ok": found.ok,
                    "load_before": load_before,
                    "peak_driver_rss_mb": peak_driver_rss_mb(spark),
                }
            )
            progress(
                f"{kind} {what}: {runs[-1]['run_s']} s, {runs[-1]['affected_keys']} keys, verify {found.ok}"
            )
            if not found.ok:
                raise SystemExit(f"verify failed after {kind} {what}: {found.summary()}")
        full = spark_full_refresh(storage, config)
        progress(f"{kind}: full-refresh job {full:.1f} s")
        out["kinds"][kind] = {
            "runs": runs,
            "median_run_s": statistics.median(r["run_s"] for r in runs),
            "median_affected_keys": statistics.median(r["affected_keys"] or 0 for r in runs),
            "full_refresh_s": round(full, 2),
        }
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--storage", choices=["delta-rs", "delta-spark"], default="delta-rs")
    parser.add_argument(
        "--work", type=Path, default=None, help="folder for the lake (default: a temp folder)"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    from cdc_join.session import get_spark
    from cdc_join.storage import get_storage

    work = args.work or Path(tempfile.mkdtemp(prefix="cdc_join_chain_"))
    spark = get_spark(
        "cdc_join-chain-benchmark",
        {"spark.driver.memory": "8g", "spark.driver.maxResultSize": "6g"},
        storage=args.storage,
    )
    storage = get_storage(spark, args.storage)
    measured = bench(spark, storage, args.scale, args.repeat, work, lambda line: print(line, flush=True))
    result = {"machine": machine(), "storage": args.storage, "scale": args.scale, **measured}
    args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
