"""Helpers shared by scenario and property tests: build a pipeline folder, read silver."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from cdc_join.config import load_config
from cdc_join.landing.event_writer import EventWriter
from cdc_join.run.pipeline import Pipeline

LHS_RHS_TABLES = {
    "lhs": {"id": "string", "fk": "int64", "v": "int64"},
    "rhs": {"id": "int64", "value": "string"},
}
SEQUENCE_BY_LSN = ("source.lsn",)


def make_pipeline(
    root: Path,
    spark,
    storage,
    *,
    tables: dict[str, dict[str, str]] = LHS_RHS_TABLES,
    left: str = "lhs",
    joins: list[dict[str, Any]] | None = None,
    select: dict[str, str] | None = None,
    join_type: str = "inner",
    primary_keys: dict[str, list[str]] | None = None,
    sequence_by: tuple[str, ...] | None = SEQUENCE_BY_LSN,
) -> tuple[Pipeline, EventWriter]:
    """A pipeline over ``tables`` landed under ``root``, with its event writer.

    Each table is keyed by its first column unless ``primary_keys`` says otherwise. Events are
    ordered by ``sequence_by``; with None the config names none, and each source takes the
    default rule of the connector its events name.
    """
    writer = EventWriter(root / "landing", tables)
    spec = {
        "name": "test",
        "lake": "lake",
        "sources": {
            t: {
                "landing": f"landing/{t}",
                "primary_key": (primary_keys or {}).get(t, [next(iter(cols))]),
                **({"sequence_by": list(sequence_by)} if sequence_by is not None else {}),
            }
            for t, cols in tables.items()
        },
        "left": left,
        "joins": joins or [{"right": "rhs", "foreign_key": ["fk"], "type": join_type}],
        "select": select or {"key": "lhs.id", "fk": "lhs.fk", "v": "lhs.v", "value": "rhs.value"},
        "output": "out",
    }
    path = root / "pipeline.yml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return Pipeline(load_config(path), spark, storage), writer


def silver_rows(pipeline: Pipeline, columns: list[str] | None = None) -> set[tuple]:
    """Silver's data columns as a set of tuples (empty before silver exists)."""
    cfg = pipeline.config
    if not pipeline.storage.exists(cfg.silver_path):
        return set()
    cols = columns or [name for name, _ in cfg.select]
    return {tuple(r) for r in pipeline.storage.read(cfg.silver_path).select(*cols).collect()}


def subscriptions(pipeline: Pipeline, join_index: int = 0) -> set[tuple]:
    """The current subscriptions of a join as ``(fk…, pk…)`` tuples."""
    from cdc_join.columns import fk_columns, pk_columns
    from cdc_join.join.subscription import current

    join = pipeline.config.joins[join_index]
    path = pipeline.config.subscription_path(join)
    if not pipeline.storage.exists(path):
        return set()
    left = pipeline.config.hop_left(join)
    rows, _ = current(pipeline.storage, path, join, left)
    cols = [*fk_columns(join), *pk_columns(left)]
    return {tuple(r) for r in rows.select(*cols).collect()}


class PauseAt:
    """A run's progress hook that holds the run at the start of one of its steps until released.

    ``Pipeline(..., progress=PauseAt("silver"))`` run in a thread stops when it reaches step
    ``silver`` (``reached`` is set) and goes on once ``release()`` is called; with ``step`` None
    it never stops. ``steps`` lists the steps the run started, in order.
    """

    def __init__(self, step: str | None = None) -> None:
        import threading

        self.step = step
        self.steps: list[str] = []
        self.reached = threading.Event()
        self._go = threading.Event()

    def __call__(self, line: str) -> None:
        if not (line.startswith("[run ") and line.endswith(" ...")):
            return  # an ingest's progress, not the start of a step
        name = line.split("] ", 1)[-1].removesuffix(" ...")
        self.steps.append(name)
        if name == self.step and not self._go.is_set():
            self.reached.set()
            if not self._go.wait(600):
                raise TimeoutError(f"the run held at step {name!r} was never released")

    def release(self) -> None:
        self._go.set()


def in_thread(work: Any) -> Any:
    """Start ``work()`` in a thread; the returned handle's ``result()`` joins it and gives
    ``"committed"``, or the name of the exception it raised."""
    import threading

    outcome: list[str] = []

    def target() -> None:
        try:
            work()
            outcome.append("committed")
        except BaseException as e:  # the outcome is what the caller checks
            outcome.append(type(e).__name__)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()

    class Handle:
        @staticmethod
        def result(timeout: float = 600) -> str:
            thread.join(timeout)
            if thread.is_alive():
                raise TimeoutError("the operation did not finish")
            return outcome[0]

    return Handle()
