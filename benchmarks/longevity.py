"""A pipeline that lives for years, compressed: many small runs on a tiny pipeline, with the
bundle's maintenance (``optimize``) after each one, recording per-run seconds and the files of
every table, so growth shows if anything grows with the number of runs.

    python -m benchmarks.longevity --runs 1000 --out benchmarks/results/longevity.json

Each run lands one file per source (a few upserts, a delete now and then), runs the pipeline,
then the maintenance policy. Every ``--verify-every`` runs, silver is verified against a
recompute from bronze. The summary compares the first and the last hundred runs.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from cdc_join.maintenance import optimize_pipeline
from cdc_join.session import get_spark
from cdc_join.storage import get_storage
from tests.support import make_pipeline


def simulate(runs: int, work: Path, verify_every: int, seed: int, out: Path | None = None) -> dict[str, Any]:
    spark = get_spark("cdc_join-longevity", quiet=True)
    storage = get_storage(spark, "delta-rs")
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
        row: dict[str, Any] = {"run": n, "run_s": round(run_s, 3), "optimize_s": round(optimize_s, 3)}
        row.update({f"files_{name}": len(storage.files(path)) for name, path in tables.items()})
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
        "max_files": {k: max(r[k] for r in rows) for k in keys if k.startswith("files_")},
        "verified": sum(1 for r in rows if r.get("verify_ok")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--verify-every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="cdc_join_longevity_"))
    result = simulate(args.runs, work, args.verify_every, args.seed, Path(args.out) if args.out else None)
    print(json.dumps(result["summary"], indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
