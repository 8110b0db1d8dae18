"""The harness the shape benchmarks share (:mod:`benchmarks.chain`, :mod:`benchmarks.nested`).

A shape benchmark is a lake of TPC-H tables, a pipeline over them and kinds of one-row changes.
:func:`measure` loads the snapshot, runs the pipeline once, then lands ``repeat`` changes of each
kind, each followed by an incremental run (``plan=auto``) and ``verify`` (silver against the
join recomputed from bronze); after the last change of a kind it times the full-refresh job a
user of the backend would write (newest row per key from bronze, the join, an overwrite, all in
Spark) on the same bronze. A run that does not verify stops the benchmark.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import pyarrow as pa
import yaml
from pyspark.sql import DataFrame

from benchmarks.baseline import latest
from benchmarks.run import _load, machine, peak_driver_rss_mb, reset_peak_rss
from benchmarks.workload import _append_bronze, _row


class Lake:
    """A benchmark's lake: its landing folders and the Debezium events it lands.

    Subclasses name their ``tables`` (columns and types), ``keys``, ``kinds`` of change and the
    pipeline (:meth:`spec`), and implement :meth:`snapshot`, :meth:`change` and
    :meth:`full_refresh`.
    """

    name: ClassVar[str] = "shape"
    tables: ClassVar[dict[str, dict[str, str]]] = {}
    keys: ClassVar[dict[str, str]] = {}
    kinds: ClassVar[tuple[str, ...]] = ()

    def __init__(self, root: Path, scale: float, cache: Path) -> None:
        self.root, self.scale, self.cache = root, scale, cache
        self.lsn = 0
        self.files = 0

    def spec(self) -> dict[str, Any]:
        raise NotImplementedError

    def snapshot(self) -> dict[str, pa.Table]:
        """The initial rows per table, in the order they are loaded."""
        raise NotImplementedError

    def change(self, kind: str, number: int) -> str:
        """Land the ``number``-th change of ``kind``; what it was."""
        raise NotImplementedError

    def full_refresh(self, storage: Any, config: Any) -> DataFrame:
        """The output the plain Spark job computes from bronze."""
        raise NotImplementedError

    def write_config(self) -> Path:
        for t in self.tables:
            (self.root / "landing" / t).mkdir(parents=True, exist_ok=True)
        path = self.root / "pipeline.yml"
        path.write_text(yaml.safe_dump(self.spec(), sort_keys=False))
        return path

    def land(self, table: str, op: str, before: dict | None, after: dict | None) -> None:
        """Land one event, in a file of its own."""
        self.land_many(table, [(op, before, after)])

    def land_many(self, table: str, changes: Sequence[tuple[str, dict | None, dict | None]]) -> None:
        """Land ``(op, before, after)`` events in one file, with increasing sequence numbers."""
        lines = []
        for op, before, after in changes:
            self.lsn += 1
            ts = 1_700_000_000_000 + self.lsn
            event = {
                "before": _row(table, before, self.tables[table]),
                "after": _row(table, after, self.tables[table]),
                "source": {"connector": "postgresql", "table": table, "lsn": self.lsn, "ts_ms": ts},
                "op": op,
                "ts_ms": ts,
            }
            lines.append(json.dumps(event, separators=(",", ":")) + "\n")
        self.files += 1
        final = self.root / "landing" / table / f"{table}-{self.files:06d}.jsonl"
        tmp = final.with_name(f"_{final.name}.tmp")
        tmp.write_text("".join(lines))
        tmp.rename(final)

    def load_snapshot(self, spark: Any, storage: Any, config: Any) -> dict[str, int]:
        """A seed row per table through landing and ingest, the rest appended to bronze."""
        from cdc_join.landing.ingest import ingest_all

        tables = self.snapshot()
        first = {}
        for name, table in tables.items():
            self.land(name, "r", None, table.slice(0, 1).to_pylist()[0])
            first[name] = self.lsn + 1
            self.lsn += table.num_rows - 1
        ingest_all(spark, storage, config)
        for name, table in tables.items():
            rest = table.slice(1).cast(pa.schema([table.schema.field(c) for c in table.column_names]))
            if rest.num_rows:
                _append_bronze(config.bronze_path(name), name, rest, first[name], self.tables[name])
        return {name: t.num_rows for name, t in tables.items()}

    def latest(self, storage: Any, config: Any, table: str) -> DataFrame:
        """The current rows of ``table`` from bronze: the newest event per key, deletes dropped."""
        return latest(storage.read(config.bronze_path(table)), self.keys[table]).alias(table)


def timed_full_refresh(lake: Lake, storage: Any, config: Any) -> float:
    """Seconds of the full-refresh job: its output overwritten next to silver."""
    start = time.perf_counter()
    output = lake.full_refresh(storage, config)
    path = config.silver_path.rsplit("/", 1)[0] + f"/{lake.name}_full_refresh"
    storage.create(path, output.schema, cdf=False)
    storage.overwrite(path, output)
    return time.perf_counter() - start


def measure(
    spark: Any, storage: Any, lake: Lake, repeat: int, progress: Callable[[str], Any]
) -> dict[str, Any]:
    """Load ``lake``, then ``repeat`` changes of each kind, each run and verified; the measurements."""
    from cdc_join.config import load_config
    from cdc_join.run.pipeline import Pipeline

    if lake.root.exists():
        shutil.rmtree(lake.root)
    config = load_config(lake.write_config())
    pipeline = Pipeline(config, spark, storage)
    start = time.perf_counter()
    rows = lake.load_snapshot(spark, storage, config)
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    pipeline.run()
    first_s = time.perf_counter() - start
    progress(f"snapshot {rows} loaded in {load_s:.1f} s, first run {first_s:.1f} s")
    out: dict[str, Any] = {"rows": rows, "load_s": round(load_s, 1), "first_run_s": round(first_s, 1)}
    out["kinds"] = {}
    for kind in lake.kinds:
        runs = [_one_run(spark, pipeline, lake, kind, number, progress) for number in range(repeat)]
        full = timed_full_refresh(lake, storage, config)
        progress(f"{kind}: full-refresh job {full:.1f} s")
        out["kinds"][kind] = {
            "runs": runs,
            "median_run_s": statistics.median(r["run_s"] for r in runs),
            "median_affected_keys": statistics.median(r["affected_keys"] or 0 for r in runs),
            "full_refresh_s": round(full, 2),
        }
    return out


def _one_run(spark: Any, pipeline: Any, lake: Lake, kind: str, number: int, progress: Any) -> dict[str, Any]:
    what = lake.change(kind, number)
    load_before = _load()
    reset_peak_rss(spark)
    start = time.perf_counter()
    report = pipeline.run()
    seconds = time.perf_counter() - start - report.seconds.get("ingest", 0.0)
    found = pipeline.verify()
    plan = report.steps.get("plan", {})
    run = {
        "change": what,
        "run_s": round(seconds, 2),
        "affected_keys": report.steps.get("resolve", {}).get("affected_keys"),
        "plan": plan.get("path"),
        "estimated_affected_rows": plan.get("estimated_affected_rows"),
        "spark_jobs": sum(n for step, n in report.spark_jobs.items() if step != "ingest"),
        "steps_s": {k: round(v, 2) for k, v in report.seconds.items()},
        "verify_ok": found.ok,
        "load_before": load_before,
        "peak_driver_rss_mb": peak_driver_rss_mb(spark),
    }
    progress(f"{kind} {what}: {run['run_s']} s, {run['affected_keys']} keys, verify {found.ok}")
    if not found.ok:
        raise SystemExit(f"verify failed after {kind} {what}: {found.summary()}")
    return run


def main(lake_class: type[Lake], description: str, argv: Sequence[str] | None = None) -> int:
    """The command line of a shape benchmark."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
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

    work = args.work or Path(tempfile.mkdtemp(prefix=f"cdc_join_{lake_class.name}_"))
    spark = get_spark(
        f"cdc_join-{lake_class.name}-benchmark",
        {"spark.driver.memory": "8g", "spark.driver.maxResultSize": "6g"},
        storage=args.storage,
    )
    storage = get_storage(spark, args.storage)
    lake = lake_class(work / f"{lake_class.name}_sf{args.scale:g}", args.scale, work / "tpch")
    measured = measure(spark, storage, lake, args.repeat, lambda line: print(line, flush=True))
    result = {"machine": machine(), "storage": args.storage, "scale": args.scale, **measured}
    args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0
