"""The scheduler's case: every command a new ``cdc-join`` process, as cron, Airflow or a
Databricks job starts it.

    python -m benchmarks.scheduled --storage delta-rs delta-spark --repeat 5 --out F

A two-source pipeline (``orders`` ⋈ ``customers``, a left join), on each backend:

- ``first run``: a new lake, a few events (3 customers, 8 orders), its first ``cdc-join run``;
- ``nothing landed``: ``cdc-join run`` again, with no new file;
- ``10 changed rows``: a file of 10 order changes lands, then ``cdc-join run``;
- ``status``, ``plan``, ``verify`` on that lake;
- ``demo``: ``cdc-join demo`` (with ``--demo``);
- ``1,500 changed rows (SF 0.1)`` (with ``--sf01``): the TPC-H lake of :mod:`benchmarks.run` at
  scale 0.1 (150,000 orders, 15,000 customers), loaded and run once untimed, then per repeat a
  batch that changes 1,500 rows (484 new orders, 484 deleted, 484 moved to another customer, 48
  customers renamed) lands and ``cdc-join run`` runs.

Each is timed as a whole process (its wall time, Python's start and imports included) and, for
runs, as the run report's seconds; medians over ``--repeat`` (each repeat a new lake for the
first run). Spark's jars are fetched once before timing (the first start on a machine, which a
scheduler pays once), by a first run on a lake of its own, twice: the first process marks the
machine, the second writes the JVM's class archive (``cdc_join/class_archive.py``) into a folder
of this benchmark's own (``--class-archive off``: none, as before 2026-12-07); their seconds are
kept as ``warm_up_s``. Results: one JSON document;
a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from cdc_join.class_archive import ENV as ARCHIVE_ENV
from cdc_join.landing.event_writer import EventWriter

TABLES = {
    "customers": {"id": "int64", "name": "string", "city": "string"},
    "orders": {"id": "int64", "customer_id": "int64", "amount": "int64", "status": "string"},
}
SF01 = "1,500 changed rows (SF 0.1)"
MEASURES = ("first run", "nothing landed", "10 changed rows", "status", "plan", "verify", "demo", SF01)
#: Orders per change batch of the SF 0.1 measure: 3 x 484 order events and 484 // 10 customers.
SF01_ORDERS = 484

_LOAD = r"""
import pickle, sys
from pathlib import Path
from benchmarks.workload import Workload
from cdc_join.config import load_config
from cdc_join.session import get_spark
from cdc_join.storage import get_storage
root, storage_name = Path(sys.argv[1]), sys.argv[2]
wl = Workload(root, 0.1, seed=7, cache=root.parent / "tpch")
config = load_config(wl.write_config())
spark = get_spark(quiet=True, storage=storage_name)
wl.load_snapshot(spark, get_storage(spark, storage_name), config)
(root / "workload.pkl").write_bytes(pickle.dumps(wl))
"""


def _pipeline(root: Path) -> tuple[str, EventWriter]:
    writer = EventWriter(root / "landing", TABLES)
    spec = {
        "name": "scheduled",
        "lake": "lake",
        "sources": {t: {"landing": f"landing/{t}", "primary_key": ["id"]} for t in TABLES},
        "left": "orders",
        "joins": [{"right": "customers", "foreign_key": ["customer_id"], "type": "left"}],
        "select": {
            "order_id": "orders.id",
            "amount": "orders.amount",
            "status": "orders.status",
            "customer": "customers.name",
            "city": "customers.city",
        },
        "output": "orders_enriched",
    }
    path = root / "pipeline.yml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return str(path), writer


def _first_events(w: EventWriter) -> None:
    w.write(
        "customers",
        [w.upsert("customers", {"id": i, "name": f"c{i}", "city": "x"}, i, "c") for i in (1, 2, 3)],
    )
    orders = [{"id": i, "customer_id": 1 + i % 3, "amount": 10 * i, "status": "new"} for i in range(8)]
    w.write("orders", [w.upsert("orders", o, 10 + n, "c") for n, o in enumerate(orders)])


def _command(storage: str, *args: str) -> tuple[float, dict[str, Any] | None, str]:
    """Run one ``cdc-join`` process; its wall seconds, its JSON report (if any) and stderr."""
    began = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "cdc_join.cli", "--storage", storage, *args],
        capture_output=True,
        text=True,
        timeout=900,
    )
    seconds = time.perf_counter() - began
    if done.returncode not in (0, 1):
        raise RuntimeError(f"cdc-join {' '.join(args)} exited {done.returncode}: {done.stderr[-2000:]}")
    try:
        report = json.loads(done.stdout.strip().splitlines()[-1]) if "--json" in args else None
    except (ValueError, IndexError):
        report = None
    return seconds, report, done.stderr


def _run_seconds(report: dict[str, Any] | None) -> float | None:
    if not report or "seconds" not in report:
        return None
    return round(sum(report["seconds"].values()), 3)


def _row(seconds: float, report: dict[str, Any] | None) -> dict[str, Any]:
    """One command's measurement: its process's seconds, and its run report's seconds, idle
    reason and Spark jobs where it has them."""
    row: dict[str, Any] = {"process_s": round(seconds, 3), "run_s": _run_seconds(report)}
    if report and report.get("idle"):
        row["idle"] = report["idle"]
    if report and report.get("spark_jobs"):
        row["spark_jobs"] = sum(report["spark_jobs"].values())
    return row


def measure(storage: str, repeat: int, demo: bool) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = {m: [] for m in MEASURES}

    def note(measure: str, seconds: float, report: dict[str, Any] | None) -> None:
        row = _row(seconds, report)
        found[measure].append(row)
        print(f"{storage} {measure}: {row}", flush=True)

    lsn = 1000
    for _ in range(repeat):
        with tempfile.TemporaryDirectory(prefix="cdc_join_scheduled_") as folder:
            config, w = _pipeline(Path(folder))
            _first_events(w)
            note("first run", *_command(storage, "--json", "run", config)[:2])
            note("nothing landed", *_command(storage, "--json", "run", config)[:2])
            lsn += 100
            changes = [
                {"id": i, "customer_id": 1 + (i + lsn) % 3, "amount": lsn, "status": "paid"}
                for i in range(10)
            ]
            w.write("orders", [w.upsert("orders", o, lsn + n) for n, o in enumerate(changes)])
            note("10 changed rows", *_command(storage, "--json", "run", config)[:2])
            for command in ("status", "plan", "verify"):
                note(command, *_command(storage, "--json", command, config)[:2])
    if demo:
        for _ in range(repeat):
            with tempfile.TemporaryDirectory(prefix="cdc_join_demo_") as folder:
                note("demo", _command(storage, "demo", "--dir", folder)[0], None)
    return found


def measure_sf01(storage: str, repeat: int, work: Path) -> list[dict[str, Any]]:
    """The SF 0.1 lake's change batches, each run by a new process (see the module docstring)."""
    import pickle

    root = work / f"sf01-{storage}"
    # A lake left by an earlier call in the same --work: its landing files carry the names the
    # new workload's batches get, and its runs would find nothing new (the TPC-H data is kept).
    shutil.rmtree(root, ignore_errors=True)
    done = subprocess.run(
        [sys.executable, "-c", _LOAD, str(root), storage],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
        env={**os.environ, "CDC_JOIN_STORAGE": storage},
    )
    if done.returncode:
        raise RuntimeError(f"loading the SF 0.1 lake failed: {done.stderr[-3000:]}")
    config = str(root / "pipeline.yml")
    _command(storage, "-q", "run", config)  # the initial run, untimed
    workload = pickle.loads((root / "workload.pkl").read_bytes())
    rows = []
    for _ in range(repeat):
        batch = workload.change_batch(0.0, changes=SF01_ORDERS)
        seconds, report, _ = _command(storage, "--json", "run", config)
        if report and report.get("idle"):
            raise RuntimeError(f"the SF 0.1 run found nothing to do ({report['idle']}): not a measurement")
        row = {**_row(seconds, report), "changed_rows": batch.changed_rows}
        rows.append(row)
        print(f"{storage} {SF01}: {row}", flush=True)
    return rows


def summary(results: dict[str, dict[str, list[dict[str, Any]]]]) -> str:
    lines = ["| measure | " + " | ".join(f"{s}: process / run s (median)" for s in results) + " |"]
    lines.append("| --- |" + " --- |" * len(results))
    for measure in MEASURES:
        if not any(rows.get(measure) for rows in results.values()):
            continue  # not measured this time
        cells = []
        for rows in results.values():
            got = rows.get(measure) or []
            if not got:
                cells.append("—")
                continue
            process = statistics.median(r["process_s"] for r in got)
            runs = [r["run_s"] for r in got if r["run_s"] is not None]
            run = f" / {statistics.median(runs):.2f}" if runs else ""
            cells.append(f"{process:.2f}{run} (n={len(got)})")
        lines.append(f"| {measure} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--storage", nargs="+", default=["delta-rs", "delta-spark"])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--demo", action="store_true", help="also time `cdc-join demo`")
    parser.add_argument("--sf01", action="store_true", help="also time 1,500 changed rows on an SF 0.1 lake")
    parser.add_argument("--only-sf01", action="store_true", help="time only the SF 0.1 measure")
    parser.add_argument("--work", default=None, help="where the SF 0.1 lake and TPC-H data go")
    parser.add_argument("--out", default=None, help="write the results here (JSON)")
    parser.add_argument(
        "--class-archive", choices=("on", "off"), default="on", help="the JVM's class archive (default on)"
    )
    args = parser.parse_args(argv)
    archives = tempfile.mkdtemp(prefix="cdc_join_class_archive_") if args.class_archive == "on" else "off"
    os.environ[ARCHIVE_ENV] = archives  # every command below inherits it
    results, warm_up = {}, {}
    for storage in args.storage:
        warm_up[storage] = []
        for _ in range(2):  # fetch the jars, mark the machine, then write the class archive: untimed
            with tempfile.TemporaryDirectory() as warm:
                config, w = _pipeline(Path(warm))
                _first_events(w)
                warm_up[storage].append(round(_command(storage, "-q", "run", config)[0], 3))
        results[storage] = {} if args.only_sf01 else measure(storage, args.repeat, args.demo)
        if args.sf01 or args.only_sf01:
            work = Path(args.work or tempfile.mkdtemp(prefix="cdc_join_sf01_"))
            results[storage][SF01] = measure_sf01(storage, args.repeat, work)
    text = summary(results)
    print(text)
    if args.out:
        load = os.getloadavg()
        document = {
            "repeat": args.repeat,
            "class_archive": args.class_archive,
            "warm_up_s": warm_up,
            "load_after": [round(x, 2) for x in load],
            "results": results,
        }
        Path(args.out).write_text(json.dumps(document, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
