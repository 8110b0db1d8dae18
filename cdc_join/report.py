"""The run report: counts, seconds and Spark jobs per step, printed as a summary and logged."""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterator
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
        return {
            "run_id": self.run_id,
            "kind": self.kind,
            "steps": self.steps,
            "seconds": self.seconds,
            "spark_jobs": self.spark_jobs,
            "warnings": self.warnings,
        }

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
        """A few lines a person reads after a run."""
        lines = [f"cdc_join {self.kind} run {self.run_id}: {sum(self.seconds.values()):.1f}s"]
        for name, counts in self.steps.items():
            shown = ", ".join(f"{k}={v}" for k, v in counts.items() if v not in (None, {}, []))
            lines.append(f"  {name:<28} {self.seconds.get(name, 0):>7.2f}s  {shown}")
        for source, count in self.quarantined().items():
            lines.append(f"  WARNING: {count} line(s) of {source} quarantined; see 'cdc-join quarantine'")
        lines += [f"  WARNING: {w}" for w in self.warnings]
        return "\n".join(lines)
