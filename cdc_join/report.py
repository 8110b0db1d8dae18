"""The run report: counts, seconds and Spark jobs per step, printed as a summary and logged."""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

_GROUPS = itertools.count()

#: What a hop is handed to time its sub-steps: ``with step("state:orders") as counts: ...``.
Step = Callable[[str], contextlib.AbstractContextManager[dict[str, Any]]]


class SparkJobs:
    """Counts the Spark jobs each step of a run starts, with one job group per step.

    Classic sessions only: Spark Connect has no status tracker, and then nothing is counted.
    """

    def __init__(self, spark: Any) -> None:
        try:
            self._context = spark.sparkContext
        except Exception:  # Spark Connect: no SparkContext on the client
            self._context = None

    @contextlib.contextmanager
    def group(self, name: str) -> Iterator[Callable[[], int | None]]:
        """Run the block in a job group of its own; yields a function that counts its jobs."""
        if self._context is None:
            yield lambda: None
            return
        group = f"cdc_join-{next(_GROUPS)}-{name}"
        previous = self._context.getLocalProperty("spark.jobGroup.id")
        self._context.setLocalProperty("spark.jobGroup.id", group)
        try:
            yield lambda: len(self._context.statusTracker().getJobIdsForGroup(group))
        finally:
            self._context.setLocalProperty("spark.jobGroup.id", previous)


class SimulatedCrash(RuntimeError):
    """Raised by a run told to stop after a given step (tests of crash safety)."""


@dataclass
class RunReport:
    """Collects what a run did. ``steps`` keeps the order steps ran in."""

    run_id: int
    kind: str
    crash_after: str | None = None
    progress: Callable[[str], None] | None = None
    steps: dict[str, dict[str, Any]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    spark_jobs: dict[str, int] = field(default_factory=dict)
    jobs: SparkJobs | None = None
    idle: str | None = None
    """Why the run had nothing to do and wrote nothing (:mod:`cdc_join.run.idle`), if so."""

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[dict[str, Any]]:
        """Time a step, hand it a dict for its counts, and stop here if told to crash."""
        counts = self.steps.setdefault(name, {})
        if self.progress:
            self.progress(f"[run {self.run_id}] {name} ...")
        start = time.perf_counter()
        with self.jobs.group(name) if self.jobs else contextlib.nullcontext(lambda: None) as count:
            yield counts
            jobs = count()
        self.seconds[name] = round(time.perf_counter() - start, 3)
        if jobs is not None:
            self.spark_jobs[name] = jobs
        if self.crash_after == name:
            raise SimulatedCrash(f"simulated crash after step {name!r}")

    def to_dict(self) -> dict[str, Any]:
        found = {
            "run_id": self.run_id,
            "kind": self.kind,
            "steps": self.steps,
            "seconds": self.seconds,
            "spark_jobs": self.spark_jobs,
            "warnings": self.warnings,
        }
        return found if self.idle is None else {**found, "idle": self.idle}

    def ingested(self, results: Mapping[str, Any]) -> None:
        """Record an ingest's results (per source, an :class:`~cdc_join.landing.ingest.IngestReport`)
        in the ``ingest`` step's counts, and their warnings."""
        counts = self.steps.setdefault("ingest", {})
        for name, r in results.items():
            counts[name] = {"files": r.files, "events": r.events, "quarantined": r.quarantined}
            if r.reasons:
                counts[name]["reasons"] = dict(r.reasons)
            if r.unavailable:
                counts[name]["unavailable_values"] = dict(r.unavailable)
            if r.unread:
                counts[name]["unread_files"] = len(r.unread)
            self.warnings += r.warnings()

    def total(self, key: str) -> int:
        """Sum of one count over all steps."""
        return sum(int(c.get(key) or 0) for c in self.steps.values())

    def quarantined(self) -> dict[str, int]:
        """Lines quarantined by this run's ingest, per source."""
        ingest = self.steps.get("ingest", {})
        return {s: int(c.get("quarantined") or 0) for s, c in ingest.items() if c.get("quarantined")}

    def data_problem(self, config: Any) -> bool:
        """Whether the run should end with the "data problem" exit code: it quarantined lines
        and the pipeline does not say ``on_quarantine: warn``."""
        return bool(self.quarantined()) and getattr(config, "on_quarantine", "fail") != "warn"

    def summary(self, verbose: bool = False) -> str:
        """What a person reads after a run: what silver got, the events, the plan and why, the
        seconds per step, warnings. ``verbose`` adds every count of every step (KIP-213
        instructions, files scanned, ...)."""
        kind = "full refresh" if self.kind == "full_refresh" else "run"
        lines = [f"cdc_join {kind} {self.run_id}: {self._plan()}, {sum(self.seconds.values()):.1f}s"]
        silver = self.steps.get("silver")
        if silver is not None:
            changed = ", ".join(f"{silver.get(k) or 0} {k}" for k in ("inserted", "updated", "deleted"))
            replaced = f" (schema replaced: {silver['replaced']})" if silver.get("replaced") else ""
            lines.append(f"  silver     {changed}{replaced}")
        events = self._events()
        if events:
            lines.append(f"  events     {events}")
        resolve = self.steps.get("resolve", {})
        if resolve.get("stale_dropped"):
            lines.append(
                f"  stale      {resolve['stale_dropped']} responses for superseded left values dropped"
            )
        timed = ", ".join(f"{name} {s:.2f}" for name, s in self.seconds.items() if s >= 0.005)
        lines.append(f"  seconds    {timed}")
        if verbose:
            for name, counts in self.steps.items():
                shown = ", ".join(f"{k}={v}" for k, v in counts.items() if v not in (None, {}, []))
                lines.append(f"    {name:<28} {self.seconds.get(name, 0):>7.2f}s  {shown}")
        for source, count in self.quarantined().items():
            reasons = self.steps.get("ingest", {}).get(source, {}).get("reasons") or {}
            top = sorted(reasons.items(), key=lambda kv: -kv[1])[:3]
            why = "; ".join(f"{n} × {reason[:120]}" for reason, n in top)
            more = f"; {len(reasons) - 3} more reasons" if len(reasons) > 3 else ""
            detail = f" ({why}{more})" if why else ""
            lines.append(
                f"  WARNING: {count} line(s) of {source} quarantined{detail}; see 'cdc-join quarantine'"
            )
        lines += [f"  WARNING: {w}" for w in self.warnings]
        return "\n".join(lines)

    def _plan(self) -> str:
        if self.idle is not None:
            return f"nothing to do ({self.idle}); nothing written, no run recorded"
        plan = self.steps.get("plan")
        if plan is None:
            return "nothing to join yet" if "join" in self.steps else "no join run"
        return f"{plan.get('decision', '?')} ({plan.get('reason', '')})"

    def _events(self) -> str:
        """Per source: events ingested and quarantined, events applied, truncates."""
        ingest, parts = self.steps.get("ingest", {}), []
        names = list(
            dict.fromkeys([*ingest, *(k.split(":", 1)[1] for k in self.steps if k.startswith("state:"))])
        )
        for name in names:
            read, state = ingest.get(name, {}), self.steps.get(f"state:{name}", {})
            bits = []
            if read.get("events") or read.get("quarantined"):
                bits.append(f"{read.get('events') or 0} ingested")
            if read.get("quarantined"):
                bits.append(f"{read['quarantined']} quarantined")
            if state.get("keys_changed"):
                bits.append(f"{state['keys_changed']} keys changed")
            if state.get("truncate_applied"):
                bits.append(f"truncate applied ({state.get('truncated') or 0} rows removed)")
            if state.get("rebuilt") is not None:
                bits.append(f"{state['rebuilt']} rows rebuilt")
            if bits:
                parts.append(f"{name}: {', '.join(bits)}")
        return "; ".join(parts)
