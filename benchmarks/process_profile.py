"""Where a new ``cdc-join run`` process spends its seconds, per phase.

    python -m benchmarks.process_profile --storage delta-rs delta-spark --repeat 3 --out F

Each repeat is a new Python process that does what ``cdc-join run`` does, timed phase by phase:
the interpreter's start (an empty ``python -c pass`` beside it), the imports of the command line
and PySpark, the Spark session (the JVM's start, the Delta jars from the cache, the session),
the config, then a run of 10 changed rows with the seconds and Spark jobs of each of its steps
(the *cold* run). Then the same process lands another 10 changed rows and runs again (the *warm*
run; ``--warm-runs N`` runs N of them and takes each step's median): a step's cold seconds minus
its warm seconds is what a new process pays for it (class loading, JIT, Spark's and Delta's first
use of each plan). With several warm runs, the later ones are what a session that runs the
pipeline again and again pays per run. The lake is the scheduler's benchmark's
(:mod:`benchmarks.scheduled`), with its first run made beforehand in a process of its own.
Medians over ``--repeat``; one JSON document, and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.scheduled import _command, _first_events, _pipeline

_CHILD = r"""
import json, sys, time
began = time.perf_counter()
marks = {}
def mark(name):
    global began
    now = time.perf_counter()
    marks[name] = round(now - began, 3)
    began = now
import cdc_join.cli.main, pyspark.sql, cdc_join.run.pipeline
mark("imports")
from cdc_join.config import load_config
from cdc_join.session import get_spark
from cdc_join.storage import get_storage
from cdc_join.run.pipeline import Pipeline
config = load_config(sys.argv[1])
mark("config")
extra = dict(kv.split("=", 1) for kv in filter(None, sys.argv[4].split(",")))
spark = get_spark(extra_conf=extra, quiet=True, storage=sys.argv[2])
mark("spark session")
storage = get_storage(spark, sys.argv[2])
mark("storage")
from benchmarks.process_profile import land_changes
runs = []
for n in range(1, int(sys.argv[5]) + 2):
    land_changes(sys.argv[3], n)
    took = time.perf_counter()
    report = Pipeline(config, spark, storage).run().to_dict()
    took = round(time.perf_counter() - took, 3)
    runs.append({"wall": took, "seconds": report["seconds"], "spark_jobs": report.get("spark_jobs", {})})
    mark(f"run {n}")
print("PROFILE " + json.dumps({"phases": marks, "runs": runs}))
"""


def land_changes(root: str, n: int) -> None:
    """A file of 10 order changes (batch ``n``) in the benchmark's landing folder."""
    from benchmarks.scheduled import TABLES
    from cdc_join.landing.event_writer import EventWriter

    w = EventWriter(Path(root) / "landing", TABLES)
    changes = [
        {"id": i, "customer_id": 1 + (i + n) % 3, "amount": 100 * n + i, "status": f"batch{n}"}
        for i in range(10)
    ]
    events = [w.upsert("orders", o, 1000 * n + k) for k, o in enumerate(changes)]
    w.write("orders", events, name=f"orders-p{n}.jsonl")


def profile(storage: str, conf: str = "", warm_runs: int = 1) -> dict[str, Any]:
    """One new process: its phases and its cold and warm runs (see the module's docstring)."""
    root = Path(tempfile.mkdtemp(prefix="cdc_join_profile_"))
    config, writer = _pipeline(root)
    _first_events(writer)
    seconds, _, _ = _command(storage, "run", "--json", config)
    began = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    interpreter = time.perf_counter() - began
    began = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, config, storage, str(root), conf, str(warm_runs)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
        env={**os.environ, "CDC_JOIN_STORAGE": storage},
    )
    wall = time.perf_counter() - began
    line = next((x for x in done.stdout.splitlines() if x.startswith("PROFILE ")), None)
    if done.returncode or line is None:
        raise RuntimeError(f"the profiled process failed ({done.returncode}): {done.stderr[-3000:]}")
    found = json.loads(line.removeprefix("PROFILE "))
    return {
        "wall": round(wall, 3),
        "interpreter": round(interpreter, 3),
        "first_run_process": round(seconds, 3),
        **found,
    }


def table(storage: str, samples: list[dict[str, Any]]) -> str:
    """Medians per phase, then per step of the cold and the warm run (seconds, Spark jobs)."""

    def med(values: list[float]) -> float:
        return round(statistics.median(values), 2)

    lines = [f"## {storage} (medians of {len(samples)})", "| phase | seconds |", "| --- | --- |"]
    lines.append(f"| interpreter start (python -c pass) | {med([s['interpreter'] for s in samples])} |")
    for phase in samples[0]["phases"]:
        lines.append(f"| {phase} | {med([s['phases'][phase] for s in samples])} |")
    lines.append(f"| whole process | {med([s['wall'] for s in samples])} |")
    lines += [
        "",
        "| step | cold s | warm s | cold - warm | jobs cold / warm |",
        "| --- | --- | --- | --- | --- |",
    ]

    def warm(sample: dict[str, Any], value: Any) -> float:  # the median over its warm runs
        return statistics.median([value(run) for run in sample["runs"][1:]])

    def row(name: str, value: Any) -> str:
        cold = med([value(s["runs"][0]) for s in samples])
        hot = med([warm(s, value) for s in samples])
        return f"| {name} | {cold} | {hot} | {round(cold - hot, 2)} |"

    for step in samples[0]["runs"][0]["seconds"]:
        jobs = [
            med([s["runs"][0]["spark_jobs"].get(step, 0) for s in samples]),
            med([warm(s, lambda run, step=step: run["spark_jobs"].get(step, 0)) for s in samples]),
        ]
        line = row(step, lambda run, step=step: run["seconds"].get(step, 0.0))
        lines.append(f"{line} {jobs[0]:g} / {jobs[1]:g} |")
    jobs = [
        med([sum(s["runs"][0]["spark_jobs"].values()) for s in samples]),
        med([warm(s, lambda run: sum(run["spark_jobs"].values())) for s in samples]),
    ]
    lines.append(f"{row('the whole run', lambda run: run['wall'])} {jobs[0]:g} / {jobs[1]:g} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage", nargs="+", default=["delta-rs", "delta-spark"])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--conf", default="", help="Spark settings for the session: key=value,...")
    parser.add_argument("--warm-runs", type=int, default=1, help="warm runs after the cold one")
    args = parser.parse_args(argv)
    results = {s: [profile(s, args.conf, args.warm_runs) for _ in range(args.repeat)] for s in args.storage}
    for storage, samples in results.items():
        print(table(storage, samples), end="\n\n")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
