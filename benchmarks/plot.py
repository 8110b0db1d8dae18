"""Plot run time against table size for a fixed number of changes, from a results JSON.

    python -m benchmarks.plot results.json benchmarks/runtime_vs_size.png

Takes, per scale factor, the result row whose change count per refresh function (``n``) is the
most common one across scales — with the default grid (SF 0.01/0.1/1, fractions
0.1/0.01/0.001) that is ``n = 1,500``, the same absolute batch at every size — and draws the
incremental run, the Spark full refresh and the DuckDB full join against the left table's rows.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any


def fixed_change_rows(results: list[dict[str, Any]]) -> tuple[int, list[dict[str, Any]]]:
    """The change count shared by most scales, and one result row per scale with it."""

    def n(row: dict[str, Any]) -> int:
        return round(row["batch_fraction"] * row["left_rows"])

    counts = Counter(n(r) for r in results)
    common = max(counts, key=lambda k: (len({r["scale"] for r in results if n(r) == k}), k))
    rows = sorted((r for r in results if n(r) == common), key=lambda r: r["left_rows"])
    return common, rows


def plot(results_path: Path, out: Path) -> Path:
    """Write the PNG and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(results_path.read_text())
    n, rows = fixed_change_rows(data["results"])
    sizes = [r["left_rows"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(sizes, [r["full_refresh_s"] for r in rows], "s-", label="full refresh (Spark)")
    ax.plot(sizes, [r["duckdb_full_s"] for r in rows], "^--", label="full join (DuckDB, reference)")
    ax.plot(sizes, [r["incremental_s"] for r in rows], "o-", label="incremental run (ingest + join)")
    for r in rows:
        ax.annotate(
            f"SF {r['scale']:g}, {'/'.join(r['plans'])}",
            (r["left_rows"], r["incremental_s"]),
            textcoords="offset points",
            xytext=(4, -12),
            fontsize=8,
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("orders (left table rows)")
    ax.set_ylabel("seconds (median of repeats)")
    ax.set_title(f"Run time vs table size, {n:,} changed orders per refresh function")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    machine = data.get("machine", {})
    fig.text(0.01, 0.01, f"{machine.get('cores')} cores, {machine.get('cpu', '')}", fontsize=7, alpha=0.7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return out


if __name__ == "__main__":
    print(plot(Path(sys.argv[1]), Path(sys.argv[2] if len(sys.argv) > 2 else "runtime_vs_size.png")))
