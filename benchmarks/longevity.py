"""A pipeline that lives for years, compressed: many small runs on a tiny pipeline, with the
bundle's maintenance (``optimize``) after each one, recording per-run seconds and the files of
every table, so growth shows if anything grows with the number of runs.

    python -m benchmarks.longevity --runs 1000 --out benchmarks/results/longevity.json
    python -m benchmarks.longevity --scale 1 --batch-fraction 0.001 --runs 200 --storage delta-spark --out F

Each run lands one file per source (a few upserts, a delete now and then), runs the pipeline,
then the maintenance policy. Every ``--verify-every`` runs, silver is verified against a
recompute from bronze. The summary compares the first and the last hundred runs (a quarter of
the runs, when fewer) and gives each measure's slope per 100 runs (least squares).

With ``--scale`` the pipeline is the TPC-H workload of :mod:`benchmarks.run` at that scale
factor, each run one change batch of ``--batch-fraction`` of the orders (RF1, RF2, RF3a, RF3b;
:mod:`benchmarks.workload`), on either backend.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from cdc_join.run.maintenance import optimize_pipeline
from cdc_join.session import get_spark
from cdc_join.storage import get_storage
from tests.support import make_pipeline


def _record(storage: Any, tables: dict[str, str], n: int, run_s: float, optimize_s: float) -> dict[str, Any]:
    row: dict[str, Any] = {"run": n, "run_s": round(run_s, 3), "optimize_s": round(optimize_s, 3)}
    row.update({f"files_{name}": len(storage.files(path)) for name, path in tables.items()})
    return row


def simulate_tpch(
    storage_name: str,
    scale: float,
    fraction: float,
    runs: int,
    work: Path,
    verify_every: int,
    out: Path | None,
) -> dict[str, Any]:
    """The TPC-H workload at ``scale``: ``runs`` change batches, each run then maintained."""
    from benchmarks.workload import Workload
    from cdc_join.config import load_config
    from cdc_join.run.pipeline import Pipeline

    spark = get_spark("cdc_join-longevity", {"spark.driver.memory": "8g"}, storage=storage_name, quiet=True)
    storage = get_storage(spark, storage_name)
    root = work / f"sf{scale:g}"
    shutil.rmtree(root, ignore_errors=True)  # a lake left by an earlier simulation would skip our files
    wl = Workload(root, scale, seed=7, cache=work / "tpch")
    cfg = load_config(wl.write_config())
    wl.load_snapshot(spark, storage, cfg)
    pipeline = Pipeline(cfg, spark, storage)
    pipeline.run()
    optimize_pipeline(storage, cfg, force=True)
    tables = {"silver": cfg.silver_path, "runs": cfg.runs_path, "ingest_log": cfg.ingest_log_path}
    for source in cfg.sources:
        tables[f"bronze_{source}"] = cfg.bronze_path(source)
        tables[f"state_{source}"] = cfg.state_path(source)
    for join in cfg.joins:
        tables[f"subscription_{join.alias}"] = cfg.subscription_path(join)
    label = {path: name for name, path in tables.items()}  # "state_orders", not "orders"
    rows: list[dict[str, Any]] = []
    for n in range(1, runs + 1):
        wl.change_batch(fraction)
        start = time.perf_counter()
        report = pipeline.run()
        run_s = time.perf_counter() - start
        start = time.perf_counter()
        actions = optimize_pipeline(storage, cfg)
        row = _record(storage, tables, n, run_s, time.perf_counter() - start)
        row["ingest_s"] = round(report.seconds.get("ingest", 0.0), 3)
        row["spark_jobs"] = sum(report.spark_jobs.values())
        row["maintained"] = [label.get(a["path"], a["path"]) for a in actions if a.get("action")]
        if n % verify_every == 0 or n == runs:
            row["verify_ok"] = pipeline.verify(samples=1).ok
            if not row["verify_ok"]:
                raise SystemExit(f"run {n}: silver differs from the recompute")
        rows.append(row)
        print(json.dumps(row), flush=True)
        if out is not None and n % 10 == 0:
            out.write_text(json.dumps({"runs": rows, "summary": summarize(rows)}, indent=1) + "\n")
    return {"runs": rows, "summary": summarize(rows)}


def simulate(
    runs: int,
    work: Path,
    verify_every: int,
    seed: int,
    out: Path | None = None,
    storage_name: str = "delta-rs",
) -> dict[str, Any]:
    spark = get_spark("cdc_join-longevity", quiet=True, storage=storage_name)
    storage = get_storage(spark, storage_name)
    pipeline, w = make_pipeline(work, spark, storage, join_type="left")
    cfg = pipeline.config
    rng = random.Random(seed)
    tables = {
        "bronze_lhs": cfg.bronze_path("lhs"),
        "state_lhs": cfg.state_path("lhs"),
        "subscription": cfg.subscription_path(cfg.joins[0]),
        "silver": cfg.silver_path,
        "runs": cfg.runs_path,
        "ingest_log": cfg.ingest_log_path,
    }
    rows: list[dict[str, Any]] = []
    lsn = 0
    for n in range(1, runs + 1):
        lsn += 10
        w.write("rhs", [w.upsert("rhs", {"id": rng.randint(1, 50), "value": f"v{n}"}, lsn)])
        events = []
        for _ in range(3):
            lsn += 1
            key = f"k{rng.randint(1, 500)}"
            if rng.random() < 0.1:
                events.append(w.delete("lhs", {"id": key, "fk": 1, "v": 0}, lsn))
            else:
                events.append(w.upsert("lhs", {"id": key, "fk": rng.randint(1, 50), "v": n}, lsn))
        w.write("lhs", events)
        start = time.perf_counter()
        pipeline.run()
        run_s = time.perf_counter() - start
        start = time.perf_counter()
        optimize_pipeline(storage, cfg)
        optimize_s = time.perf_counter() - start
        row = _record(storage, tables, n, run_s, optimize_s)
        if n % verify_every == 0:
            row["verify_ok"] = pipeline.verify(samples=1).ok
            if not row["verify_ok"]:
                raise SystemExit(f"run {n}: silver differs from the recompute")
        rows.append(row)
        if n % 50 == 0:
            print(json.dumps(row), flush=True)
            if out is not None:  # a simulation stopped part way still leaves its runs so far
                out.write_text(json.dumps({"runs": rows, "summary": summarize(rows)}, indent=1) + "\n")
    return {"runs": rows, "summary": summarize(rows)}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    window = max(1, min(100, len(rows) // 4))
    first, last = rows[:window], rows[-window:]
    keys = [k for k in rows[0] if k.startswith(("run_s", "optimize_s", "files_"))]
    return {
        "window": window,
        "first": {k: statistics.median(r[k] for r in first) for k in keys},
        "last": {k: statistics.median(r[k] for r in last) for k in keys},
        "slope_per_100_runs": {k: _slope([r["run"] for r in rows], [r[k] for r in rows]) for k in keys},
        "max_files": {k: max(r[k] for r in rows) for k in keys if k.startswith("files_")},
        "verified": sum(1 for r in rows if r.get("verify_ok")),
    }


def _slope(xs: list[int], ys: list[float]) -> float | None:
    """Least-squares slope of ``ys`` per 100 ``xs``."""
    if len(xs) < 2:
        return None
    return round(statistics.linear_regression(xs, ys).slope * 100, 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--verify-every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--scale", type=float, default=None, help="TPC-H scale factor (default: the tiny pipeline)"
    )
    parser.add_argument(
        "--batch-fraction", type=float, default=0.001, help="with --scale: orders changed per run"
    )
    parser.add_argument("--storage", choices=["delta-rs", "delta-spark"], default="delta-rs")
    parser.add_argument("--work", type=Path, default=None, help="working folder (default: a temporary one)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="cdc_join_longevity_"))
    out = Path(args.out) if args.out else None
    if args.scale is not None:
        result = simulate_tpch(
            args.storage, args.scale, args.batch_fraction, args.runs, work, args.verify_every, out
        )
    else:
        result = simulate(args.runs, work, args.verify_every, args.seed, out, args.storage)
    print(json.dumps(result["summary"], indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
