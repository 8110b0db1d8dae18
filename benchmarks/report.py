"""Turn a results JSON into the README's tables.

python -m benchmarks.report results.json
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def results_table(results: list[dict[str, Any]]) -> str:
    """One row per scale factor and batch fraction (medians of the repeats)."""
    head = (
        "| SF | batch fraction | orders | customers | changed rows | ingest s | incremental s | "
        "full refresh s | DuckDB full s | speedup | speedup with ingest | plan | subscription files read "
        "| silver rows written / changed (amplification) | verify | load |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in results:
        lines.append(
            f"| {r['scale']:g} | {r['batch_fraction']:g} | {_fmt(r['left_rows'])} | {_fmt(r['right_rows'])} "
            f"| {_fmt(r['changed_rows'])} | {_fmt(r.get('ingest_s'))} | {_fmt(r['incremental_s'])} "
            f"| {_fmt(r['full_refresh_s'])} | {_fmt(r['duckdb_full_s'])} | {_fmt(r['speedup'], 2)} "
            f"| {_fmt(r.get('speedup_with_ingest'), 2)} | {'/'.join(r['plans'])} "
            f"| {_fmt(r['subscription_files_scanned'])} / {_fmt(r['subscription_files_total'])} "
            f"| {_fmt(r['silver_rows_written'])} / {_fmt(r['silver_rows_changed'])} "
            f"({_fmt(r['write_amplification'])}) | {'ok' if r['verify'] else 'FAILED'} "
            f"| {r['load'][0]:.1f}–{r['load'][1]:.1f} |"
        )
    return "\n".join(lines)


def steps_table(batch: dict[str, Any]) -> str:
    """Seconds per step of one incremental run."""
    lines = ["| step | seconds |", "|---|---|"]
    lines += [f"| {name} | {seconds:.2f} |" for name, seconds in batch["steps_s"].items()]
    return "\n".join(lines)


def same_changes_steps_table(scales: list[dict[str, Any]]) -> str:
    """Median seconds per step for the same absolute batch at each scale: what grows with size."""
    import statistics

    batches = [b for s in scales for b in s["batches"] if str(b.get("label", "")).startswith("f ")]
    by_count: dict[int, dict[float, list[dict[str, Any]]]] = {}
    for b in batches:
        by_count.setdefault(int(b["changed_rows"]), {}).setdefault(b["scale"], []).append(b)
    shared = {n: per for n, per in by_count.items() if len(per) > 1}
    if not shared:
        return ""
    n = min(shared)
    per_scale = dict(sorted(shared[n].items()))
    steps: list[str] = []
    for rows in per_scale.values():
        for b in rows:
            steps += [k for k in b["steps_s"] if k not in steps]
    head = "| step | " + " | ".join(f"SF {sc:g} s" for sc in per_scale) + " |"
    lines = [f"{n:,} changed rows per batch, median of the repeats:", "", head]
    lines.append("|---|" + "---|" * len(per_scale))
    for step in [*steps, "total"]:
        cells = []
        for rows in per_scale.values():
            if step == "total":
                values = [sum(b["steps_s"].values()) for b in rows]
            else:
                values = [b["steps_s"].get(step, 0.0) for b in rows]
            cells.append(f"{statistics.median(values):.2f}")
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def experiment_table(scales: list[dict[str, Any]]) -> str:
    """The RF3a-only batch before and after ``optimize``, per scale."""
    lines = [
        "| SF | RF3a batch | subscription files read | incremental s | optimize s |",
        "|---|---|---|---|---|",
    ]
    for s in scales:
        e = s.get("optimize_experiment")
        if not e:
            continue
        for when in ("before", "after"):
            b = e[when]
            lines.append(
                f"| {s['scale']:g} | {b['customers_updated']} customers, {when} optimize "
                f"| {b['subscription_files_scanned']} / {b['subscription_files_total']} "
                f"| {b['incremental_s']:.1f} | {e['optimize_s'] if when == 'after' else ''} |"
            )
    return "\n".join(lines)


def main(paths: list[str]) -> None:
    from benchmarks.plot import load

    data = load([Path(p) for p in paths])
    print(results_table(data["results"]))
    print()
    print(experiment_table(data["scales"]))
    print()
    print(same_changes_steps_table(data["scales"]))


if __name__ == "__main__":
    main(sys.argv[1:])
