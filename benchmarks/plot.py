"""Plot run time against table size for a fixed number of changes, from results JSON files.

    python -m benchmarks.plot benchmarks/runtime_vs_size.png results.json [more.json ...]

For every change count (``changed_rows``, the same absolute batch) measured at more than one
scale factor — with ``--scale 0.1 1 --batch-fraction 0.001 0.01 0.1`` those are the batches of
1,500 and 15,000 orders per refresh function — draws the incremental run (join only, and with
the ingest of the batch), the recompute where one ran (chosen by the cost rule or forced with
``--plan recompute``) and the Spark full refresh against the left table's rows, plus the
DuckDB full join as a single-node reference. Both axes are logarithmic.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

#: Lines per change count: result key, plan the rows must have (``None``: any), matplotlib
#: style, opacity, legend text.
SERIES = (
    ("full_refresh_s", None, "s-", 1.0, "full refresh"),
    ("incremental_s", "incremental", "o-", 0.8, "incremental join"),
    ("incremental_s", "recompute", "D-", 0.8, "recompute (join run)"),
    ("incremental_with_ingest_s", "incremental", "o:", 0.6, "incremental incl. ingest"),
    ("duckdb_full_s", None, "^--", 0.5, "DuckDB full join"),
)


def shared_change_counts(results: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """Result rows per change count measured at two or more scales, smallest table first."""
    by_count: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in results:
        by_count[int(r["changed_rows"])].append(r)
    return {
        n: sorted(rows, key=lambda r: r["left_rows"])
        for n, rows in sorted(by_count.items())
        if len({r["scale"] for r in rows}) > 1
    }


def points(rows: list[dict[str, Any]], key: str, plan: str | None) -> tuple[list[int], list[float]]:
    """One point per table size: the median of ``key`` over the rows run with ``plan``."""
    by_size: dict[int, list[float]] = defaultdict(list)
    for r in rows:
        if plan is None or r["plans"] == [plan]:
            by_size[r["left_rows"]].append(r[key])
    sizes = sorted(by_size)
    return sizes, [statistics.median(by_size[n]) for n in sizes]


def load(paths: list[Path]) -> dict[str, Any]:
    """Results JSON files merged (e.g. one run per scale factor): their result rows and scales."""
    merged: dict[str, Any] = {"results": [], "scales": []}
    for path in paths:
        data = json.loads(path.read_text())
        if "results" not in data:  # not a benchmarks.run file (e.g. longevity.json)
            continue
        merged["machine"] = data.get("machine", {})
        merged["results"] += data["results"]
        merged["scales"] += data["scales"]
    return merged


def plot(results_paths: list[Path], out: Path) -> Path:
    """Write the PNG and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = load(results_paths)
    series = shared_change_counts(data["results"])
    if not series:
        raise SystemExit("no change count was measured at more than one scale factor")
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for color, (n, rows) in zip(colors, series.items(), strict=False):
        label = f"{n:,} changed rows"
        for key, plan, style, alpha, what in SERIES:
            xs, ys = points(rows, key, plan)
            if xs:
                ax.plot(xs, ys, style, color=color, alpha=alpha, label=f"{what}, {label}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("orders (left table rows)")
    ax.set_ylabel("seconds (median of repeats)")
    ax.set_title("Run time vs table size for the same absolute batch")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    machine = data.get("machine", {})
    fig.text(0.01, 0.01, f"{machine.get('cores')} cores, {machine.get('cpu', '')}", fontsize=7, alpha=0.7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return out


if __name__ == "__main__":
    print(plot([Path(p) for p in sys.argv[2:]], Path(sys.argv[1])))
