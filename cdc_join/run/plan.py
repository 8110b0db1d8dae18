"""How a run proceeds, and why: the one place that chooses a run's path.

A run takes one of four paths; :func:`choose` names it, with its reason, as a :class:`RunPlan`
the wiring (:mod:`cdc_join.run.pipeline`) dispatches on. In the order it is decided:

==========================  ===================================================================
path                        when
==========================  ===================================================================
``REBUILD``                 a full refresh; a full refresh that stopped after rebuilding a
                            state table (its rerun finishes it, whatever was asked); a new left
                            source or primary key (state and silver rows are keyed otherwise:
                            silver's rows are replaced); a first run over many bronze rows.
                            Every state table is rebuilt from bronze, subscriptions from the
                            left state, silver from the whole join.
``RECOMPUTE``               a first run, or silver's definition changed: state is applied as
                            usual, then the whole join; subscriptions are rebuilt when the joins
                            changed, else they get the changed left keys' instructions.
``RECOMPUTE_AFFECTED``      the cost rule (:mod:`cdc_join.run.cost`) finds the changes touch enough
                            of the left table: the affected keys are found by joining whole
                            state tables in Spark instead of looking up subscriptions.
``INCREMENTAL``             otherwise: KIP-213, for the changed keys and the subscribers of
                            changed right keys only.
==========================  ===================================================================
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cdc_join.checkpoint import Checkpoint
from cdc_join.config import PipelineConfig
from cdc_join.run import cost
from cdc_join.silver import table as silver
from cdc_join.storage import Storage, commits

#: What ``Pipeline.full_refresh`` asks for (the other requests are :data:`cost.PLANS`).
REFRESH = "refresh"


class RunPath(str, enum.Enum):
    """The four ways a run goes (module docstring)."""

    REBUILD = "rebuild"
    RECOMPUTE = "recompute"
    RECOMPUTE_AFFECTED = "recompute_affected"
    INCREMENTAL = "incremental"


@dataclass(frozen=True)
class RunPlan:
    """A run's path, why, and what the path needs to know."""

    path: RunPath
    reason: str
    replace_silver: str | None = None
    """``REBUILD``: why silver's rows are replaced rather than MERGEd (they are keyed otherwise)."""
    rebuild_subscriptions: bool = False
    """``RECOMPUTE``: the joins changed, so every subscription is rebuilt."""
    cost: cost.PlanDecision | None = None
    """The cost rule's decision, when it was asked."""

    @property
    def recompute(self) -> bool:
        return self.path is not RunPath.INCREMENTAL

    def as_report(self) -> dict[str, Any]:
        """The run report's ``plan`` counts."""
        found = self.cost.as_report() if self.cost is not None else {}
        decision = "recompute" if self.recompute else "incremental"
        return {**found, "decision": decision, "path": self.path.value, "reason": self.reason}


def choose(
    storage: Storage,
    config: PipelineConfig,
    previous: Checkpoint,
    bronze_versions: Mapping[str, int],
    types: Sequence[Sequence[str]],
    requested: str,
    changed_keys: Callable[[], Mapping[str, int]],
) -> RunPlan:
    """The run's path (module docstring).

    Args:
        storage: the run's storage (file statistics only; no Spark job).
        config: the pipeline.
        previous: the last checkpoint.
        bronze_versions: the bronze versions the run pinned.
        types: the joined sources' row types (:func:`cdc_join.silver.table.source_types`).
        requested: ``refresh``, or a plan of :data:`cdc_join.run.cost.PLANS`.
        changed_keys: per source, how many keys the run's increment changes; called only when
            the choice depends on it (it costs reading the increments).
    """
    rebuild = _rebuild_reason(storage, config, previous, bronze_versions, requested)
    if rebuild is not None:
        return RunPlan(
            RunPath.REBUILD,
            f"{rebuild}: state rebuilt from bronze",
            replace_silver=silver.restated(previous.silver, config),
        )
    first_run = config.left not in previous.state_versions
    decision = cost.decide(storage, config, changed_keys(), requested, first_run)
    redefined = silver.redefined(previous.silver, config, types)
    if redefined and not first_run:
        decision = dataclasses.replace(decision, recompute=True, reason=f"{redefined}: every row")
    if decision.recompute and (first_run or redefined):
        joins_changed = not first_run and silver.joins_redefined(previous.silver, config)
        return RunPlan(RunPath.RECOMPUTE, decision.reason, rebuild_subscriptions=joins_changed, cost=decision)
    if decision.recompute:
        return RunPlan(RunPath.RECOMPUTE_AFFECTED, decision.reason, cost=decision)
    return RunPlan(RunPath.INCREMENTAL, decision.reason, cost=decision)


def _rebuild_reason(
    storage: Storage,
    config: PipelineConfig,
    previous: Checkpoint,
    bronze_versions: Mapping[str, int],
    requested: str,
) -> str | None:
    """Why every state table is rebuilt from bronze, or ``None``."""
    if requested == REFRESH:
        return "full refresh"
    first_run = config.left not in previous.state_versions
    # A full refresh stopped after it rebuilt a state table: its rerun finishes it (a rebuilt
    # left state re-hashed every left row, so the subscriptions it did not get to rebuild would
    # make every response stale; a rebuilt right state no longer holds the last run's rows).
    if not first_run and any(
        commits.rebuilt_since(storage, config.state_path(name), version)
        for name, version in previous.state_versions.items()
        if name in config.sources
    ):
        return "full refresh resumed (the last one stopped before it committed)"
    restated = silver.restated(previous.silver, config)
    if restated:
        return restated
    if first_run and requested != "incremental" and cost.rebuild_first(storage, config, bronze_versions):
        return f"first run of {cost.RECOMPUTE_MIN_ROWS}+ rows"
    return None
