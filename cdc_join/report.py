"""The run report: counts and seconds per step, printed as a short summary and logged."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any


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

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[dict[str, Any]]:
        """Time a step, hand it a dict for its counts, and stop here if told to crash."""
        counts = self.steps.setdefault(name, {})
        if self.progress:
            self.progress(f"[run {self.run_id}] {name} ...")
        start = time.perf_counter()
        yield counts
        self.seconds[name] = round(time.perf_counter() - start, 3)
        if self.crash_after == name:
            raise SimulatedCrash(f"simulated crash after step {name!r}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "kind": self.kind,
            "steps": self.steps,
            "seconds": self.seconds,
            "warnings": self.warnings,
        }

    def total(self, key: str) -> int:
        """Sum of one count over all steps."""
        return sum(int(c.get(key) or 0) for c in self.steps.values())

    def summary(self) -> str:
        """A few lines a person reads after a run."""
        lines = [f"cdc_join {self.kind} run {self.run_id}: {sum(self.seconds.values()):.1f}s"]
        for name, counts in self.steps.items():
            shown = ", ".join(f"{k}={v}" for k, v in counts.items() if v not in (None, {}, []))
            lines.append(f"  {name:<28} {self.seconds.get(name, 0):>7.2f}s  {shown}")
        return "\n".join(lines)
