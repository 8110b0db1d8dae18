"""The jobs an incremental run is compared with, and the equality check between their outputs.

- :func:`spark_full_refresh` is the plain Spark job a user would write without cdc_join: the
  newest event per key from bronze (one ``max_by`` aggregate per source), the joins, and an
  overwrite of the output table: Spark → Arrow → delta-rs, as there is no other Delta writer
  without the Delta jars.
- :func:`duckdb_full_join` is the same job in DuckDB over the same bronze parquet files, as a
  single-node reference; it writes its result to a parquet file.
- :func:`compare` checks, in DuckDB, that the incremental silver, the Spark full refresh and
  the DuckDB result hold the same rows (``EXCEPT ALL`` both ways).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from benchmarks.workload import KEYS, OUTPUT, SELECT, duck_connection
from cdc_join.config import PipelineConfig
from cdc_join.storage import Storage

FULL_OUTPUT = f"{OUTPUT}_full_refresh"


def full_refresh_path(config: PipelineConfig) -> str:
    """Where the Spark full refresh writes (next to silver)."""
    return config.silver_path.rsplit("/", 1)[0] + f"/{FULL_OUTPUT}"


def latest(bronze: DataFrame, key: str) -> DataFrame:
    """Current rows of a source: the newest event per key by ``_seq``; deletes drop the row."""
    newest = (
        bronze.filter(F.col("_op") != "t")
        .groupBy(F.coalesce(F.col(f"_after.{key}"), F.col(f"_before.{key}")).alias("_key"))
        .agg(F.max_by(F.struct("_op", "_after"), F.col("_seq")).alias("_n"))
    )
    return newest.filter(F.col("_n._op") != "d").select("_n._after.*")


def spark_full_join(storage: Storage, config: PipelineConfig) -> DataFrame:
    """The join of the sources' current rows, computed from bronze with Spark."""
    rows = {t: latest(storage.read(config.bronze_path(t)), KEYS[t]).alias(t) for t in KEYS}
    joined = (
        rows["orders"]
        .join(rows["customer"], F.col("orders.o_custkey") == F.col("customer.c_custkey"), "inner")
        .join(rows["clerk"], F.col("orders.o_clerk") == F.col("clerk.k_clerk"), "left")
    )
    return joined.select(*[F.expr(expr).alias(name) for name, expr in SELECT.items()])


#: Above this many bronze order events the full refresh streams its result (below, it collects).
COLLECT_ROWS = 5_000_000


def spark_full_refresh(storage: Storage, config: PipelineConfig) -> float:
    """Run the Spark full refresh, overwrite its output table, return the seconds it took.

    It writes the way a plain job would without the Delta jars: the result collected as Arrow
    (``toArrow``), then one ``write_deltalake``. That is the fastest write here while the result
    fits in driver memory. Past :data:`COLLECT_ROWS` bronze order events (SF 10) it does not:
    the collect of 15 M joined rows ran Spark's 8 GB driver out of heap. There it writes as
    cdc_join writes whole tables: Spark writes parquet, delta-rs streams it into the table.
    """
    from deltalake import write_deltalake

    start = time.perf_counter()
    result = spark_full_join(storage, config)
    path = full_refresh_path(config)
    storage.create(path, result.schema, cdf=False)
    events = sum(f.num_records or 0 for f in storage.files(config.bronze_path("orders")))
    if events > COLLECT_ROWS or storage.name == "delta-spark":  # Spark writes Delta itself
        storage.overwrite(path, result)
    else:
        write_deltalake(path, result.toArrow(), mode="overwrite")
    return time.perf_counter() - start


def _scan(path: str) -> str:
    """A Delta table as DuckDB reads it: its Delta extension applies deletion vectors (the
    delta-spark backend's MERGEs leave them in silver), which a read of the parquet files would not."""
    return f"delta_scan('{path}')"


def _duck_latest(storage: Storage, config: PipelineConfig, table: str) -> str:
    key = KEYS[table]
    return f"""
        SELECT unnest(n.a) FROM (
            SELECT coalesce(_after.{key}, _before.{key}) AS k, arg_max({{'op': _op, 'a': _after}}, _seq) AS n
            FROM {_scan(config.bronze_path(table))}
            WHERE _op != 't' GROUP BY k)
        WHERE n.op != 'd'"""


def duckdb_full_join_sql(storage: Storage, config: PipelineConfig) -> str:
    """The full join as one DuckDB query over bronze's parquet files."""
    columns = ", ".join(f"{expr} AS {name}" for name, expr in SELECT.items())
    return f"""
        WITH orders AS ({_duck_latest(storage, config, "orders")}),
             customer AS ({_duck_latest(storage, config, "customer")}),
             clerk AS ({_duck_latest(storage, config, "clerk")})
        SELECT {columns} FROM orders
        JOIN customer ON orders.o_custkey = customer.c_custkey
        LEFT JOIN clerk ON orders.o_clerk = clerk.k_clerk"""


def duckdb_full_join(storage: Storage, config: PipelineConfig, out: Path) -> float:
    """Run the full join in DuckDB, write it to ``out`` (parquet), return the seconds it took."""
    start = time.perf_counter()
    con = duck_connection()
    con.execute(f"COPY ({duckdb_full_join_sql(storage, config)}) TO '{out}' (FORMAT parquet)")
    con.close()
    return time.perf_counter() - start


@dataclass(frozen=True)
class Comparison:
    """Rows of each output and the rows on one side only."""

    silver_rows: int
    full_refresh_rows: int
    duckdb_rows: int
    silver_only: int
    full_refresh_only: int
    duckdb_differs: int

    @property
    def ok(self) -> bool:
        counts_equal = self.silver_rows == self.full_refresh_rows == self.duckdb_rows
        return counts_equal and self.silver_only == self.full_refresh_only == self.duckdb_differs == 0


def compare(storage: Storage, config: PipelineConfig, duckdb_result: Path) -> Comparison:
    """Compare incremental silver, the Spark full refresh and the DuckDB result, row for row."""
    columns = ", ".join(SELECT)
    con = duck_connection()
    silver = f"(SELECT {columns} FROM {_scan(config.silver_path)})"
    full = f"(SELECT {columns} FROM {_scan(full_refresh_path(config))})"
    duck = f"(SELECT {columns} FROM read_parquet('{duckdb_result}'))"

    def one(sql: str) -> int:
        row = con.execute(sql).fetchone()
        assert row is not None
        return int(row[0])

    result = Comparison(
        silver_rows=one(f"SELECT count(*) FROM {silver}"),
        full_refresh_rows=one(f"SELECT count(*) FROM {full}"),
        duckdb_rows=one(f"SELECT count(*) FROM {duck}"),
        silver_only=one(f"SELECT count(*) FROM ({silver} EXCEPT ALL {full})"),
        full_refresh_only=one(f"SELECT count(*) FROM ({full} EXCEPT ALL {silver})"),
        duckdb_differs=one(f"SELECT count(*) FROM ({duck} EXCEPT ALL {full})")
        + one(f"SELECT count(*) FROM ({full} EXCEPT ALL {duck})"),
    )
    con.close()
    return result
