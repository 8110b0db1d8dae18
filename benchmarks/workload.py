"""TPC-H-derived CDC workload: an initial snapshot plus seeded change batches, as Debezium events.

Tables and joins (one pipeline, two foreign-key joins from one left table):

- ``orders`` (left, TPC-H ``orders``) → ``customer`` on ``o_custkey`` (inner join);
- ``orders`` → ``clerk`` on ``o_clerk`` (left join). TPC-H has no clerk table, only the
  ``Clerk#000000951`` values of ``o_clerk``; ``clerk`` is derived from them (one row per
  distinct value, with a team and a nation) to give ``orders`` a second right table.

The snapshot comes from ``tpchgen-cli`` (TPC-H dbgen's generator, as parquet) at a scale
factor. Decimals become doubles and TPC-H's ``string_view`` columns plain strings.

Change batches follow the TPC-H refresh functions, with the two updates this join needs:

- RF1: ``n`` new orders (``op c``), keys above the current maximum (an OLTP sequence);
- RF2: ``n`` deleted orders (``op d``), the oldest live keys, as TPC-H's RF2 deletes the
  start of the original population;
- RF3a: ``n / 10`` customer updates (``op u``, new balance and comment). Customers are drawn
  uniformly, and TPC-H has ten orders per customer, so each update fans out to ~10 orders;
- RF3b: ``n`` orders moved to another customer (``op u`` with a new ``o_custkey``);
- 5% of the events of each file are repeated (same sequence), and each file is shuffled.

``n = fraction × live orders``. Events are payload-only JSON (Kafka Connect JSON converter
with ``schemas.enable=false``): the bronze types are known from the snapshot, and the
``schema`` envelope would make each line ~2 KB.

The snapshot is large (1.5 M orders at scale 1): rather than landing ~600 MB of JSON, a small
seed file per table goes through the real landing → ingest path (which creates bronze with
its real schema), and the remaining snapshot rows are appended to bronze directly, built in
DuckDB in exactly the shape ingest writes (``op r``, the same ``_seq`` encoding, the payload
as ``_raw``). Change batches always go through landing → ingest.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pandas as pd
import pyarrow as pa
import yaml

ORDERS_COLUMNS = {
    "o_orderkey": "int64",
    "o_custkey": "int64",
    "o_orderstatus": "string",
    "o_totalprice": "double",
    "o_orderdate": "date",
    "o_orderpriority": "string",
    "o_clerk": "string",
    "o_shippriority": "int32",
    "o_comment": "string",
}
CUSTOMER_COLUMNS = {
    "c_custkey": "int64",
    "c_name": "string",
    "c_address": "string",
    "c_nationkey": "int64",
    "c_phone": "string",
    "c_acctbal": "double",
    "c_mktsegment": "string",
    "c_comment": "string",
}
CLERK_COLUMNS = {"k_clerk": "string", "k_team": "string", "k_nationkey": "int64"}
TABLES = {"orders": ORDERS_COLUMNS, "customer": CUSTOMER_COLUMNS, "clerk": CLERK_COLUMNS}
KEYS = {"orders": "o_orderkey", "customer": "c_custkey", "clerk": "k_clerk"}

SELECT = {
    **{c: f"orders.{c}" for c in ORDERS_COLUMNS},
    "c_name": "customer.c_name",
    "c_nationkey": "customer.c_nationkey",
    "c_phone": "customer.c_phone",
    "c_acctbal": "customer.c_acctbal",
    "c_mktsegment": "customer.c_mktsegment",
    "k_team": "clerk.k_team",
}
OUTPUT = "orders_enriched"
DUPLICATE_SHARE = 0.05
SEED_ROWS = 2
_DUCK_TYPES = {"int64": "BIGINT", "int32": "INTEGER", "string": "VARCHAR", "double": "DOUBLE", "date": "DATE"}


def duck_connection() -> duckdb.DuckDBPyConnection:
    """A DuckDB connection capped at ``CDC_JOIN_BENCH_DUCKDB_MEMORY`` (default 6 GB).

    DuckDB's own default is 80% of the machine's memory. At SF 10 the benchmark's Python
    process and Spark's 8 GB JVM share 24 GB; uncapped, the DuckDB queries took the machine
    past its memory once. With 3 GB, the full join over bronze read through the Delta
    extension ran out of memory at SF 10 (its newest-row-per-key aggregate does not spill).
    """
    limit = os.environ.get("CDC_JOIN_BENCH_DUCKDB_MEMORY", "6GB")
    connection = duckdb.connect(config={"memory_limit": limit, "preserve_insertion_order": False})
    # DuckDB's Delta reader, from its PyPI package (DuckDB would download it otherwise).
    import duckdb_extension_delta

    folder = os.path.join(os.path.dirname(duckdb_extension_delta.__file__), "extensions")
    connection.sql(f"LOAD '{os.path.join(folder, f'v{duckdb.__version__}', 'delta.duckdb_extension')}'")
    return connection


def pipeline_spec() -> dict[str, Any]:
    """The pipeline YAML of the workload (paths relative to its folder)."""
    return {
        "name": "tpch",
        "lake": "lake",
        "sources": {
            t: {"landing": f"landing/{t}", "primary_key": [KEYS[t]], "sequence_by": ["source.lsn"]}
            for t in TABLES
        },
        "left": "orders",
        "joins": [
            {"right": "customer", "foreign_key": ["o_custkey"], "type": "inner"},
            {"right": "clerk", "foreign_key": ["o_clerk"], "type": "left"},
        ],
        "select": SELECT,
        "output": OUTPUT,
    }


def tpch_parquet(scale: float, cache: Path) -> dict[str, Path]:
    """``orders`` and ``customer`` parquet files for ``scale`` (generated once per scale).

    From ``tpchgen-cli`` when it is installed; otherwise (e.g. the smoke test on a machine
    without it) from :func:`synthetic_tpch`, which has TPC-H's columns and key structure.
    """
    folder = cache / f"sf{scale:g}"
    paths = {t: folder / f"{t}.parquet" for t in ("orders", "customer")}
    if not all(p.exists() for p in paths.values()):
        folder.mkdir(parents=True, exist_ok=True)
        cli = shutil.which("tpchgen-cli") or str(Path(sys.executable).parent / "tpchgen-cli")
        if not os.path.exists(cli):
            synthetic_tpch(scale, paths)
            return paths
        command = [cli, "parquet", "-s", f"{scale:g}", "--tables=orders,customer", "-o", str(folder)]
        subprocess.run([*command, "--overwrite"], check=True, capture_output=True)
    return paths


def synthetic_tpch(scale: float, paths: dict[str, Path], seed: int = 7) -> None:
    """TPC-H-shaped ``orders``/``customer`` parquet without ``tpchgen-cli``.

    TPC-H's sizes (150,000 × SF customers, ten orders per customer), its sparse order keys
    (8 used out of every 32), customers whose key is a multiple of 3 placing no orders, and
    its value domains for status, priority, segment and clerk; text columns are short filler.
    """
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    customers = max(15, round(150_000 * scale))
    orders = 10 * customers
    custkey = np.arange(1, customers + 1, dtype=np.int64)
    segments = ["AUTOMOBILE", "BUILDING", "FURNITURE", "HOUSEHOLD", "MACHINERY"]
    customer = {
        "c_custkey": custkey,
        "c_name": [f"Customer#{k:09d}" for k in custkey],
        "c_address": [f"address {k}" for k in custkey],
        "c_nationkey": rng.integers(0, 25, customers),
        "c_phone": [f"{10 + k % 25}-{k % 1000:03d}-{k % 10000:04d}" for k in custkey],
        "c_acctbal": np.round(rng.uniform(-999.99, 9999.99, customers), 2),
        "c_mktsegment": rng.choice(segments, customers),
        "c_comment": [f"comment {k}" for k in custkey],
    }
    pq.write_table(pa.table(customer), paths["customer"])
    index = np.arange(orders, dtype=np.int64)
    clerks = max(1, round(1000 * scale))
    priorities = ["1-URGENT", "2-HIGH", "3-MEDIUM", "4-NOT SPECIFIED", "5-LOW"]
    days = rng.integers(0, 2405, orders)
    order = {
        "o_orderkey": (index // 8) * 32 + index % 8 + 1,
        "o_custkey": rng.choice(custkey[custkey % 3 != 0], orders),
        "o_orderstatus": rng.choice(["F", "O", "P"], orders),
        "o_totalprice": np.round(rng.uniform(850.0, 550_000.0, orders), 2),
        "o_orderdate": pa.array(np.datetime64("1992-01-01") + days.astype("timedelta64[D]"), pa.date32()),
        "o_orderpriority": rng.choice(priorities, orders),
        "o_clerk": [f"Clerk#{c:09d}" for c in rng.integers(1, clerks + 1, orders)],
        "o_shippriority": np.zeros(orders, dtype=np.int32),
        "o_comment": [f"order comment {k}" for k in index],
    }
    pq.write_table(pa.table(order), paths["orders"])


def orders_and_customers(con: duckdb.DuckDBPyConnection, paths: dict[str, Path]) -> tuple[pa.Table, pa.Table]:
    """TPC-H's ``orders`` and ``customer`` rows, typed as the pipeline's columns."""
    orders = con.sql(
        "SELECT o_orderkey, o_custkey, o_orderstatus::VARCHAR o_orderstatus, o_totalprice::DOUBLE "
        "o_totalprice, o_orderdate, o_orderpriority::VARCHAR o_orderpriority, o_clerk::VARCHAR o_clerk, "
        f"o_shippriority, o_comment::VARCHAR o_comment FROM '{paths['orders']}' ORDER BY o_orderkey"
    ).to_arrow_table()
    customer = con.sql(
        "SELECT c_custkey, c_name::VARCHAR c_name, c_address::VARCHAR c_address, c_nationkey, "
        "c_phone::VARCHAR c_phone, c_acctbal::DOUBLE c_acctbal, c_mktsegment::VARCHAR c_mktsegment, "
        f"c_comment::VARCHAR c_comment FROM '{paths['customer']}' ORDER BY c_custkey"
    ).to_arrow_table()
    return orders, customer


@dataclass(frozen=True)
class Batch:
    """What one change batch landed."""

    number: int
    new_orders: int
    deleted_orders: int
    customers_updated: int
    orders_moved: int
    events: int
    duplicates: int
    orders_touched_by_customers: int

    @property
    def changed_rows(self) -> int:
        """Distinct source rows changed (orders and customers)."""
        return self.new_orders + self.deleted_orders + self.orders_moved + self.customers_updated


class Workload:
    """Generates the snapshot and the change batches of one benchmark lake.

    Args:
        root: the folder holding ``pipeline.yml``, ``landing/`` and ``lake/`` (created).
        scale: the TPC-H scale factor.
        seed: seeds every random choice, so a rerun lands the same events.
        cache: where generated TPC-H parquet is kept between runs.
    """

    def __init__(self, root: Path, scale: float, seed: int = 42, cache: Path | None = None) -> None:
        self.root = Path(root)
        self.scale = scale
        self.rng = np.random.default_rng(seed)
        self.cache = cache or self.root.parent / "tpch"
        self.lsn = 0
        self.batches = 0
        self.orders: pd.DataFrame | None = None
        self.customers: pd.DataFrame | None = None

    # -- layout ------------------------------------------------------------------------------
    def write_config(self, **settings: Any) -> Path:
        """Write ``pipeline.yml`` (with ``settings`` as more top-level keys) and create the
        landing folders."""
        self.root.mkdir(parents=True, exist_ok=True)
        for t in TABLES:
            (self.root / "landing" / t).mkdir(parents=True, exist_ok=True)
        path = self.root / "pipeline.yml"
        path.write_text(yaml.safe_dump({**pipeline_spec(), **settings}, sort_keys=False))
        return path

    # -- snapshot ----------------------------------------------------------------------------
    def snapshot_tables(self) -> dict[str, pa.Table]:
        """The snapshot rows per table, typed as the pipeline's columns."""
        paths = tpch_parquet(self.scale, self.cache)
        con = duck_connection()
        orders, customer = orders_and_customers(con, paths)
        clerk = con.sql(
            "SELECT DISTINCT o_clerk::VARCHAR AS k_clerk, "
            "'team-' || (CAST(right(o_clerk::VARCHAR, 9) AS BIGINT) % 10)::VARCHAR AS k_team, "
            f"CAST(right(o_clerk::VARCHAR, 9) AS BIGINT) % 25 AS k_nationkey FROM '{paths['orders']}' "
            "ORDER BY k_clerk"
        ).to_arrow_table()
        return {"orders": orders, "customer": customer, "clerk": clerk}

    def load_snapshot(self, spark: Any, storage: Any, config: Any) -> dict[str, int]:
        """Land a seed file per table and ingest it, then append the rest of the snapshot to bronze.

        Returns:
            Snapshot rows per table.
        """
        from cdc_join.landing.ingest import ingest_all

        tables = self.snapshot_tables()
        # Strings stay in Arrow: at SF 10 Python string objects for 15 M orders would take GBs.
        strings = {pa.string(): pd.StringDtype("pyarrow"), pa.large_string(): pd.StringDtype("pyarrow")}
        self.orders = tables["orders"].to_pandas(types_mapper=strings.get).set_index("o_orderkey", drop=False)
        self.customers = tables["customer"].to_pandas().set_index("c_custkey", drop=False)
        first_lsn = {}
        for name, table in tables.items():
            first_lsn[name] = self.lsn + 1
            seed = table.slice(0, SEED_ROWS).to_pylist()
            self._land(name, "snapshot-seed.jsonl", [self._line(name, "r", None, row) for row in seed])
            self.lsn = first_lsn[name] - 1 + table.num_rows
        ingest_all(spark, storage, config)
        for name, table in tables.items():
            rest = table.slice(SEED_ROWS)
            if rest.num_rows:
                _append_bronze(config.bronze_path(name), name, rest, first_lsn[name] + SEED_ROWS)
        return {name: t.num_rows for name, t in tables.items()}

    # -- change batches ----------------------------------------------------------------------
    def change_batch(self, fraction: float, changes: int | None = None) -> Batch:
        """Land one change batch of RF1, RF2, RF3a and RF3b events (see the module docstring).

        Args:
            fraction: ``n`` as a share of the live orders.
            changes: ``n`` itself, overriding ``fraction`` (a fixed change count across scales).
        """
        assert self.orders is not None and self.customers is not None, "load_snapshot first"
        self.batches += 1
        n = max(1, changes if changes is not None else round(fraction * len(self.orders)))
        order_events: list[str] = []
        # RF1: new orders; other columns copied from random existing orders, a random customer.
        templates = self.orders.iloc[self.rng.integers(0, len(self.orders), n)].copy()
        keys = np.arange(n, dtype=np.int64) + int(self.orders.index.max()) + 1
        templates["o_orderkey"] = keys
        templates["o_custkey"] = self.rng.choice(self.customers.index.to_numpy(), n)
        templates["o_orderstatus"] = "O"
        templates.index = keys
        for row in templates.to_dict("records"):
            order_events.append(self._line("orders", "c", None, row))
        # RF2: delete the oldest orders.
        oldest = self.orders.iloc[:n]
        for row in oldest.to_dict("records"):
            order_events.append(self._line("orders", "d", row, None))
        self.orders = pd.concat([self.orders.iloc[n:], templates])
        # RF3b: move random orders (not the new ones) to another customer.
        pick = self.rng.choice(len(self.orders) - n, min(n, len(self.orders) - n), replace=False)
        moved = self.orders.iloc[np.sort(pick)]
        new_cust = self.rng.choice(self.customers.index.to_numpy(), len(moved))
        for before, cust in zip(moved.to_dict("records"), new_cust, strict=True):
            after = {**before, "o_custkey": int(cust)}
            order_events.append(self._line("orders", "u", before, after))
        self.orders.loc[moved.index, "o_custkey"] = new_cust
        m = max(1, n // 10)
        customer_events, touched = self._customer_updates(m)
        dups = self._land_shuffled("orders", order_events) + self._land_shuffled("customer", customer_events)
        return Batch(
            number=self.batches,
            new_orders=n,
            deleted_orders=len(oldest),
            customers_updated=m,
            orders_moved=len(moved),
            events=len(order_events) + len(customer_events),
            duplicates=dups,
            orders_touched_by_customers=touched,
        )

    def customer_batch(self, customers: int) -> Batch:
        """Land a batch of RF3a only: ``customers`` customer updates, no order changes."""
        self.batches += 1
        events, touched = self._customer_updates(customers)
        dups = self._land_shuffled("customer", events)
        return Batch(self.batches, 0, 0, customers, 0, len(events), dups, touched)

    def _customer_updates(self, m: int) -> tuple[list[str], int]:
        """RF3a: ``m`` random customers get a new balance and comment; events and orders touched."""
        assert self.orders is not None and self.customers is not None
        custs = self.rng.choice(self.customers.index.to_numpy(), m, replace=False)
        events = []
        for key in custs:
            before = self.customers.loc[key].to_dict()
            after = dict(before)
            after["c_acctbal"] = round(float(self.rng.uniform(-999.99, 9999.99)), 2)
            after["c_comment"] = f"updated in batch {self.batches}"
            events.append(self._line("customer", "u", before, after))
            self.customers.loc[key, ["c_acctbal", "c_comment"]] = [after["c_acctbal"], after["c_comment"]]
        return events, int(self.orders["o_custkey"].isin(custs).sum())

    def live_counts(self) -> dict[str, int]:
        """Rows per table after the batches landed so far."""
        assert self.orders is not None and self.customers is not None
        return {"orders": len(self.orders), "customer": len(self.customers)}

    # -- events ------------------------------------------------------------------------------
    def _event(
        self, table: str, op: str, before: dict[str, Any] | None, after: dict[str, Any] | None
    ) -> dict[str, Any]:
        """A payload-only Debezium event (PostgreSQL connector) with the next LSN."""
        self.lsn += 1
        ts = 1_700_000_000_000 + self.lsn
        return {
            "before": _row(table, before),
            "after": _row(table, after),
            "source": {"connector": "postgresql", "table": table, "lsn": self.lsn, "ts_ms": ts},
            "op": op,
            "ts_ms": ts,
        }

    def _line(self, table: str, op: str, before: dict[str, Any] | None, after: dict[str, Any] | None) -> str:
        return json.dumps(self._event(table, op, before, after), separators=(",", ":"))

    def _land_shuffled(self, table: str, lines: list[str]) -> int:
        """Land ``lines`` plus 5% repeats, shuffled; return how many repeats."""
        repeats = [lines[i] for i in np.flatnonzero(self.rng.random(len(lines)) < DUPLICATE_SHARE)]
        all_lines = lines + repeats
        order = self.rng.permutation(len(all_lines))
        self._land(table, f"batch-{self.batches:05d}.jsonl", [all_lines[i] for i in order])
        return len(repeats)

    def _land(self, table: str, name: str, lines: list[str]) -> None:
        """Write a landing file under a temporary name, then rename it into place."""
        final = self.root / "landing" / table / name
        tmp = final.with_name(f"_{name}.tmp")
        tmp.write_text("".join(line + "\n" for line in lines))
        os.replace(tmp, final)


def _row(
    table: str, values: dict[str, Any] | None, columns: dict[str, str] | None = None
) -> dict[str, Any] | None:
    """A row image as JSON values: dates as ISO strings, numpy scalars as Python ones.
    ``columns``: the table's columns and types (default: this workload's)."""
    if values is None:
        return None
    out = {}
    for column, kind in (columns or TABLES[table]).items():
        value = values.get(column)
        if value is None or (isinstance(value, float) and np.isnan(value)):
            out[column] = None
        elif kind == "date":
            out[column] = pd.Timestamp(value).date().isoformat()
        elif kind in ("int64", "int32"):
            out[column] = int(value)
        elif kind == "double":
            out[column] = float(value)
        else:
            out[column] = str(value)
    return out


def _append_bronze(
    path: str, table_name: str, rows: pa.Table, first_lsn: int, columns: dict[str, str] | None = None
) -> None:
    """Append snapshot rows to bronze as ingest would have written them (``op r``), via DuckDB.
    ``columns``: the table's columns and types (default: this workload's)."""
    from deltalake import DeltaTable, write_deltalake

    dt = DeltaTable(path)
    target = pa.schema(dt.schema().to_arrow())
    columns = columns or TABLES[table_name]
    after = ", ".join(f"{c} := {c}" for c in columns)
    payload_row = ", ".join(
        f"'{c}': strftime({c}, '%Y-%m-%d')" if kind == "date" else f"'{c}': {c}"
        for c, kind in columns.items()
    )
    con = duck_connection()
    con.register("snapshot", rows)
    bronze = con.sql(
        f"""
        SELECT 'snapshot-bulk' AS _file, CAST(row_number() OVER () AS BIGINT) AS _line, 'r' AS _op,
               lpad(CAST(lsn AS VARCHAR), 20, '0') AS _seq,
               '{{"source.lsn":' || CAST(lsn AS VARCHAR) || '}}' AS _seq_values,
               1700000000000 + lsn AS _ts_ms,
               NULL AS _before, struct_pack({after}) AS _after,
               to_json({{'before': NULL, 'after': {{{payload_row}}},
                        'source': {{'connector': 'postgresql', 'table': '{table_name}', 'lsn': lsn,
                                    'ts_ms': 1700000000000 + lsn}},
                        'op': 'r', 'ts_ms': 1700000000000 + lsn}})::VARCHAR AS _raw,
               now() AS _ingested_at
        FROM (SELECT *, {first_lsn} - 1 + row_number() OVER () AS lsn FROM snapshot)
        """
    )
    # Streamed in batches: at SF 10 the rows with their JSON text would not fit in memory at once.
    to_reader = getattr(bronze, "to_arrow_reader", None) or bronze.fetch_arrow_reader  # duckdb < 1.4
    reader = to_reader(batch_size=1_000_000)

    def batches() -> Any:
        for batch in reader:
            columns_out = []
            for field in target:
                column = batch.column(field.name)
                if field.name == "_before":
                    column = pa.nulls(batch.num_rows, field.type)
                columns_out.append(column.cast(field.type))
            yield pa.RecordBatch.from_arrays(columns_out, schema=target)

    write_deltalake(dt, pa.RecordBatchReader.from_batches(target, batches()), mode="append")
