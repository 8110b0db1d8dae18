"""Benchmark runner: incremental runs against full refreshes on the TPC-H CDC workload.

    python -m benchmarks.run --scale 0.1 1 --batch-fraction 0.001 0.01 0.1 --out results.json

Per scale factor: a fresh lake gets the TPC-H snapshot (see :mod:`benchmarks.workload`) and an
initial pipeline run. Then, per batch fraction, ``--repeat`` change batches are landed; after
each one, in the same Spark session, come the incremental run (``Pipeline.run()``: ingest of
the batch's landing files, timed apart as ``ingest_s`` because the full refresh needs the same
bronze, then the join, ``incremental_s``), the plain Spark full refresh of the same state,
the DuckDB full join, and the check that all three outputs hold the same rows (a difference
fails the benchmark with exit status 1). Medians of the repeats go into the summary rows.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.baseline import compare, duckdb_full_join, spark_full_refresh
from benchmarks.workload import Workload
from cdc_join.run.cost import PLANS


def machine() -> dict[str, Any]:
    """The machine and software versions the numbers were measured with."""
    import deltalake
    import duckdb
    import pyspark

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = None
    with contextlib.suppress(ValueError, OSError):
        memory = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": memory,
        "python": platform.python_version(),
        "pyspark": pyspark.__version__,
        "deltalake": deltalake.__version__,
        "duckdb": duckdb.__version__,
    }


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def _jvm_pid(spark: Any) -> int | None:
    with contextlib.suppress(Exception):
        return int(spark.sparkContext._gateway.proc.pid)
    return None


def reset_peak_rss(spark: Any) -> None:
    """Start measuring peak memory afresh (Linux: ``clear_refs`` 5 resets ``VmHWM`` to the
    current resident size), so the peak reported after a run is the run's, not the workload
    generator's or the previous batch's DuckDB recompute before it: memory they freed is first
    given back to the system (Arrow's pool, ``malloc_trim``), which would otherwise count as
    held by the run (:func:`peak_driver_rss_mb` reports what was held at the reset)."""
    gc.collect()
    with contextlib.suppress(Exception):
        import pyarrow as pa

        pa.default_memory_pool().release_unused()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    for pid in ("self", _jvm_pid(spark)):
        if pid is not None:
            with contextlib.suppress(OSError):
                Path(f"/proc/{pid}/clear_refs").write_text("5")
    _AT_RESET["python"] = _status_mb("self", "VmRSS")


#: What the Python process held at the last :func:`reset_peak_rss`, in MB.
_AT_RESET: dict[str, float | None] = {}


def _status_mb(pid: Any, field: str) -> float | None:
    """A memory field of ``/proc/<pid>/status`` in MB (``None``: no such process or field)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return round(int(line.split()[1]) / 1024, 1)
    return None


def peak_driver_rss_mb(spark: Any) -> dict[str, float | None]:
    """Peak resident memory of the driver since :func:`reset_peak_rss`: the Python process and
    (local mode) its JVM; ``python_at_reset``: what the Python process held when it started."""
    jvm = _jvm_pid(spark)
    return {
        "python": _status_mb("self", "VmHWM"),
        "jvm": None if jvm is None else _status_mb(jvm, "VmHWM"),
        "python_at_reset": _AT_RESET.get("python"),
    }


def _step_sum(report: Any, prefix: str, key: str) -> int:
    return sum(int(c.get(key) or 0) for name, c in report.steps.items() if name.startswith(prefix))


def run_batch(
    wl: Workload,
    pipeline: Any,
    fraction: float,
    changes: int | None,
    work: Path,
    customers: int | None = None,
    plan: str = "auto",
) -> dict[str, Any]:
    """Land one batch, run the incremental run and both full refreshes, compare outputs.

    With ``customers`` the batch is RF3a alone: that many customer updates. ``plan`` is passed
    to ``Pipeline.run`` (``auto``: the cost rule decides).
    """
    batch = wl.customer_batch(customers) if customers else wl.change_batch(fraction, changes)
    load_before = _load()
    reset_peak_rss(pipeline.spark)
    start = time.perf_counter()
    report = pipeline.run(plan=plan)
    with_ingest = time.perf_counter() - start
    peak = peak_driver_rss_mb(pipeline.spark)
    # Ingest (landing JSON → bronze) is work both jobs need: the full refresh reads bronze.
    ingest = report.seconds.get("ingest", 0.0)
    incremental = with_ingest - ingest
    full = spark_full_refresh(pipeline.storage, pipeline.config)
    duck_out = work / "duckdb_result.parquet"
    duck = duckdb_full_join(pipeline.storage, pipeline.config, duck_out)
    check = compare(pipeline.storage, pipeline.config, duck_out)
    silver = report.steps.get("silver", {})
    changed = int(silver.get("inserted", 0)) + int(silver.get("updated", 0)) + int(silver.get("deleted", 0))
    written = silver.get("rows_written")
    sub = report.steps.get("lookup", {}).get("customer", {})
    live = wl.live_counts()
    return {
        "batch": batch.number,
        "left_rows": live["orders"],
        "right_rows": live["customer"],
        "changed_rows": batch.changed_rows,
        "events": batch.events,
        "duplicate_events": batch.duplicates,
        "new_orders": batch.new_orders,
        "deleted_orders": batch.deleted_orders,
        "customers_updated": batch.customers_updated,
        "orders_moved": batch.orders_moved,
        "ingest_s": round(ingest, 3),
        "incremental_s": round(incremental, 3),
        "incremental_with_ingest_s": round(with_ingest, 3),
        "full_refresh_s": round(full, 3),
        "duckdb_full_s": round(duck, 3),
        "speedup": round(full / incremental, 2),
        "speedup_with_ingest": round((ingest + full) / with_ingest, 2),
        "plan": report.steps.get("plan", {}).get("decision", "incremental"),
        "subscription_files_scanned": sub.get("files_scanned"),
        "subscription_files_total": sub.get("files_total"),
        "silver_rows_written": written,
        "silver_rows_changed": changed,
        "write_amplification": round(written / changed, 2) if written is not None and changed else None,
        "verify": {"ok": check.ok, **check.__dict__},
        "load_before": load_before,
        "load_after": _load(),
        "steps_s": dict(report.seconds),
        "steps": report.steps,
        "spark_jobs": sum(n for step, n in report.spark_jobs.items() if step != "ingest"),
        "ingest_spark_jobs": report.spark_jobs.get("ingest"),
        "spark_jobs_by_step": dict(report.spark_jobs),
        "peak_driver_rss_mb": peak,
    }


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return round(statistics.median(values), 3) if values else None


def summarize(scale: float, fraction: float, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One result row: medians of the repeats, and whether every repeat verified."""
    summary = {"scale": scale, "batch_fraction": fraction, "repeats": len(rows)}
    for key in (
        "left_rows",
        "right_rows",
        "changed_rows",
        "ingest_s",
        "incremental_s",
        "incremental_with_ingest_s",
        "full_refresh_s",
        "duckdb_full_s",
        "subscription_files_scanned",
        "subscription_files_total",
        "silver_rows_written",
        "silver_rows_changed",
        "write_amplification",
    ):
        summary[key] = _median(rows, key)
    inc, full = summary["incremental_s"], summary["full_refresh_s"]
    summary["speedup"] = round(full / inc, 2) if inc and full else None
    ingest, total = summary["ingest_s"], summary["incremental_with_ingest_s"]
    summary["speedup_with_ingest"] = round((ingest + full) / total, 2) if total and full else None
    summary["plans"] = sorted({r["plan"] for r in rows})
    summary["verify"] = all(r["verify"]["ok"] for r in rows)
    summary["load"] = [min(r["load_before"] for r in rows), max(r["load_after"] for r in rows)]
    return summary


def bench_scale(
    spark: Any,
    storage: Any,
    scale: float,
    fractions: Sequence[float],
    repeat: int,
    changes: int | None,
    work: Path,
    seed: int,
    optimize_after_load: bool,
    progress: Any,
    rf3a_customers: int = 100,
    on_batch: Any = None,
    plan: str = "auto",
    settings: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The initial load and every batch fraction at one scale factor, on a fresh lake.

    ``on_batch`` is called with the results so far after every batch; ``settings`` are more
    top-level keys of the pipeline YAML.
    """
    from cdc_join.config import load_config
    from cdc_join.run.pipeline import Pipeline

    root = work / f"sf{scale:g}"
    shutil.rmtree(root, ignore_errors=True)
    wl = Workload(root, scale, seed=seed, cache=work / "tpch")
    config = load_config(wl.write_config(**(settings or {})))
    start = time.perf_counter()
    snapshot = wl.load_snapshot(spark, storage, config)
    load_s = time.perf_counter() - start
    pipeline = Pipeline(config, spark, storage)
    start = time.perf_counter()
    initial = pipeline.run()
    initial_s = time.perf_counter() - start
    progress(f"sf {scale:g}: snapshot {snapshot} bronze in {load_s:.1f}s, initial run {initial_s:.1f}s")
    optimize: dict[str, Any] | None = None
    if optimize_after_load:
        from cdc_join.run.maintenance import optimize_pipeline

        start = time.perf_counter()
        optimize = {"actions": optimize_pipeline(storage, config, force=True)}
        optimize["seconds"] = round(time.perf_counter() - start, 3)
        progress(f"sf {scale:g}: optimize {optimize['seconds']}s")

    def one(label: str, fraction: float, customers: int | None = None) -> dict[str, Any]:
        row = run_batch(wl, pipeline, fraction, changes, work, customers, plan)
        row.update(batch_fraction=fraction, scale=scale, label=label)
        progress(
            f"sf {scale:g} {label} batch {row['batch']}: ingest {row['ingest_s']}s "
            f"incremental {row['incremental_s']}s "
            f"full {row['full_refresh_s']}s duckdb {row['duckdb_full_s']}s plan {row['plan']} "
            f"subs files {row['subscription_files_scanned']}/{row['subscription_files_total']} "
            f"jobs {row['spark_jobs']} "
            f"verify {row['verify']['ok']} load {row['load_before']}->{row['load_after']}"
        )
        if not row["verify"]["ok"]:
            progress(f"VERIFY FAILED: {row['verify']}")
        return row

    results: list[dict[str, Any]] = []
    batches: list[dict[str, Any]] = []
    out = {
        "scale": scale,
        "snapshot_rows": snapshot,
        "bronze_load_s": round(load_s, 3),
        "initial_run_s": round(initial_s, 3),
        "initial_steps_s": dict(initial.seconds),
        "optimize": optimize,
        "optimize_experiment": None,
        "results": results,
        "batches": batches,
    }
    for i, fraction in enumerate(fractions):
        rows = []
        for _ in range(repeat):
            rows.append(one(f"f {fraction:g}", fraction))
            batches.append(rows[-1])
            if on_batch:
                on_batch({**out, "results": [*results, summarize(scale, fraction, rows)]})
        results.append(summarize(scale, fraction, rows))
        if i == 0 and rf3a_customers:
            out["optimize_experiment"] = optimize_experiment(pipeline, rf3a_customers, one, progress)
    out["idle_run"] = idle_run(pipeline)
    progress(f"sf {scale:g}: run with no new events {out['idle_run']}")
    return out


def idle_run(pipeline: Any) -> dict[str, Any]:
    """A run that finds no new landing file: what a scheduled run costs when nothing happened."""
    start = time.perf_counter()
    report = pipeline.run()
    seconds = time.perf_counter() - start
    ingest = report.seconds.get("ingest", 0.0)
    return {
        "seconds": round(seconds, 3),
        "join_run_s": round(seconds - ingest, 3),
        "ingest_s": round(ingest, 3),
        "spark_jobs": sum(report.spark_jobs.values()),
        "spark_jobs_by_step": dict(report.spark_jobs),
    }


def optimize_experiment(pipeline: Any, customers: int, one: Any, progress: Any) -> dict[str, Any]:
    """An RF3a-only batch, the maintenance policy (``cdc-join optimize``), the same batch again.

    Shows what the files written by the incremental MERGEs so far cost a right-driven lookup,
    and what optimizing gives back.
    """
    from cdc_join.run.maintenance import optimize_pipeline

    before = one(f"rf3a {customers} customers, before optimize", 0.0, customers)
    start = time.perf_counter()
    actions = optimize_pipeline(pipeline.storage, pipeline.config)
    seconds = time.perf_counter() - start
    progress(f"optimize: {seconds:.1f}s {[(a['path'].rsplit('/', 1)[-1], a['action']) for a in actions]}")
    after = one(f"rf3a {customers} customers, after optimize", 0.0, customers)
    return {"optimize_s": round(seconds, 3), "actions": actions, "before": before, "after": after}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=float, nargs="+", default=[0.1], help="TPC-H scale factors")
    parser.add_argument(
        "--batch-fraction", type=float, nargs="+", default=[0.001], help="changed orders per RF, as a share"
    )
    parser.add_argument(
        "--changes", type=int, default=None, help="changed orders per RF (overrides fraction)"
    )
    parser.add_argument("--repeat", type=int, default=3, help="batches per fraction (median reported)")
    parser.add_argument("--out", type=Path, default=Path("results.json"))
    parser.add_argument("--work", type=Path, default=None, help="working folder (default: a temporary one)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "--storage",
        choices=["delta-rs", "delta-spark"],
        default="delta-rs",
        help="storage backend of the pipeline and of the full-refresh baseline",
    )
    parser.add_argument("--optimize", action="store_true", help="run `optimize` after the initial load")
    parser.add_argument(
        "--plan",
        choices=PLANS,
        default="auto",
        help="plan of every run after the initial one (auto: the cost rule decides)",
    )
    parser.add_argument(
        "--silver-change-feed",
        choices=["on", "off"],
        default="on",
        help="the pipeline's silver_change_feed (off: silver keeps no Change Data Feed)",
    )
    parser.add_argument(
        "--silver-write",
        choices=["auto", "merge"],
        default="auto",
        help="how an incremental run writes silver: auto (a keyed replace where the backend marks "
        "rows deleted, else a MERGE), merge (always the MERGE: silver's write before 2026-12-06)",
    )
    parser.add_argument(
        "--conf",
        default="",
        help="Spark settings for the session, key=value,... (e.g. code generation off; the "
        "full-refresh baseline runs in the same session, so compare incremental runs only)",
    )
    parser.add_argument(
        "--rf3a-customers",
        type=int,
        default=100,
        help="after the first fraction: an RF3a-only batch of this many customers, optimize, again (0: skip)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from cdc_join.session import get_spark
    from cdc_join.storage import get_storage

    work = args.work or Path(tempfile.mkdtemp(prefix="cdc_join_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    # Initial loads and recomputes move whole tables through the driver on delta-rs (Spark →
    # Arrow → delta-rs). Keyed reads hand Spark up to hundreds of small files: list them on the
    # driver, not in a job.
    spark = get_spark(
        "cdc_join-benchmark",
        {
            "spark.driver.memory": "8g",
            "spark.driver.maxResultSize": "6g",
            "spark.sql.sources.parallelPartitionDiscovery.threshold": "100000",
            **dict(item.split("=", 1) for item in args.conf.split(",") if "=" in item),
        },
        storage=args.storage,
    )
    storage = get_storage(spark, args.storage)
    if args.silver_write == "merge":
        storage.replaces_keys_in_place = False  # this benchmark's backend object only

    def progress(line: str) -> None:
        print(line, flush=True)

    command = " ".join(["python -m benchmarks.run", *(argv if argv is not None else sys.argv[1:])])
    scales: list[dict[str, Any]] = []

    def write(partial: dict[str, Any] | None = None) -> dict[str, Any]:
        # Rewritten after every batch, so a run stopped half way still leaves its numbers.
        done = [*scales, partial] if partial else scales
        out = {
            "machine": machine(),
            "storage": storage.name,
            "command": command,
            "results": [r for s in done for r in s["results"]],
            "scales": done,
        }
        args.out.write_text(json.dumps(out, indent=2, default=str))
        return out

    for s in args.scale:
        scales.append(
            bench_scale(
                spark,
                storage,
                s,
                args.batch_fraction,
                args.repeat,
                args.changes,
                work,
                args.seed,
                args.optimize,
                progress,
                args.rf3a_customers,
                on_batch=write,
                plan=args.plan,
                settings={"silver_change_feed": args.silver_change_feed == "on"},
            )
        )
    out = write()
    ok = all(r["verify"] for r in out["results"])
    print(f"wrote {args.out}; verify {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
