"""Per run, the cost rule that picks an incremental run or a recompute of the whole join.

An incremental run costs in proportion to the left rows it affects: each changed left key,
plus every subscriber of each changed right key, goes through instructions, lookups, the stale
check and the silver MERGE, and the change-set steps move those rows between Spark and the
driver; on delta-rs its MERGEs also rewrite every state and silver file holding a changed key
(copy-on-write), which for keys spread over the table is most files. A recompute finds the
same rows by set operations in Spark instead: one scan of the left state for the rows naming a
changed right key (no subscription lookups, no stale check), the newest rows of the affected
keys joined to the whole right state tables, one MERGE; its cost follows the table size more
and the affected rows less. (A first run, a changed silver definition and a full refresh
compute every silver row instead, and MERGE only those that differ from silver.)

The rule: estimate the affected left rows as

    changed left keys + sum over joins of (changed right keys × subscriptions per right row)

(in a chain, a hop's changed right keys include the estimate of the keys the hops after it
reach: a region rename reaches its nations' customers, × orders per customer)
(fan-outs from the file statistics of the subscription and right state tables, so deciding
costs no Spark job) and recompute when the estimate reaches

    RECOMPUTE_FIXED_ROWS + RECOMPUTE_SHARE × left state rows

or when there is no previous run to be incremental from — provided the left state holds at
least :data:`RECOMPUTE_MIN_ROWS` rows: below that a run's fixed cost dominates whichever path
it takes, and the incremental path is the one that keeps its instructions.

Where the two terms come from: both plans pay the run's fixed costs and grow with the rows
they affect; the recompute spends more per left row (its scan of the left state) and less per
affected row (no lookups, no stale check, rows built in Spark). Measured, the recompute costs
about ``a + c × left rows − d × affected`` more than an incremental run, so it wins once
``affected ≥ a / d + c / d × left rows``: a fixed number of rows (its extra fixed cost, in
affected rows) plus a share of the table. Both are fitted from the TPC-H benchmark
(``benchmarks/README.md``, "The cost rule"). ``Pipeline.run(plan=...)`` / ``cdc-join run
--plan`` override the rule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cdc_join.config import PipelineConfig
from cdc_join.storage import Storage

#: What a run may be told to do: let the rule decide, or force either plan.
PLANS = ("auto", "incremental", "recompute")
#: Recompute when the estimated affected left rows reach RECOMPUTE_FIXED_ROWS plus this share
#: of the left state's rows. Fitted from the TPC-H benchmark (benchmarks/README.md, "The cost
#: rule"; 2 cores, delta-rs, 2026-11-25, both plans forced on the same workloads): at 150,000
#: orders the two cost the same for 6,000 and for 58,000 affected rows (3.7 and 9.5 s); at 1.5 M
#: the recompute costs 2.6 s more for 5,800 (7.8 against 5.2 s) and 2.5 s more for 60,000, and
#: 1.9 s less for 571,000 (35.1 against 37.0 s). Least squares: the recompute costs 0.07 s +
#: 1.8 µs per left row − 8.1 µs per affected row more, so it wins from 8,500 rows plus 22% of
#: the left rows on.
RECOMPUTE_SHARE = 0.22
#: ... plus this many rows: what a recompute's extra fixed cost buys an incremental run.
RECOMPUTE_FIXED_ROWS = 8_500
#: ... and the left state has at least this many rows.
RECOMPUTE_MIN_ROWS = 10_000


@dataclass(frozen=True)
class PlanDecision:
    """What a run will do, and the numbers the rule looked at."""

    recompute: bool
    reason: str
    left_rows: int
    changed_left_keys: int | None
    changed_right_keys: Mapping[str, int]
    fanout: Mapping[str, float]
    estimated_affected_rows: int | None
    share: float = RECOMPUTE_SHARE
    fixed_rows: int = RECOMPUTE_FIXED_ROWS

    @property
    def threshold_rows(self) -> int:
        """The estimate from which the rule recomputes."""
        return threshold_rows(self.left_rows, self.share, self.fixed_rows)

    def as_report(self) -> dict[str, Any]:
        """The decision as run-report counts."""
        return {
            "decision": "recompute" if self.recompute else "incremental",
            "reason": self.reason,
            "left_rows": self.left_rows,
            "changed_left_keys": self.changed_left_keys,
            "changed_right_keys": dict(self.changed_right_keys),
            "fanout": {k: round(v, 2) for k, v in self.fanout.items()},
            "estimated_affected_rows": self.estimated_affected_rows,
            "threshold_rows": self.threshold_rows,
        }


def threshold_rows(
    left_rows: int, share: float = RECOMPUTE_SHARE, fixed_rows: int = RECOMPUTE_FIXED_ROWS
) -> int:
    """Estimated affected rows from which a recompute is chosen, for a left state of ``left_rows``."""
    return fixed_rows + round(share * left_rows)


def choose_plan(
    *,
    first_run: bool,
    left_rows: int,
    changed_left_keys: int | None,
    changed_right_keys: Mapping[str, int],
    subscription_rows: Mapping[str, int],
    right_rows: Mapping[str, int],
    share: float = RECOMPUTE_SHARE,
    min_rows: int = RECOMPUTE_MIN_ROWS,
    fixed_rows: int = RECOMPUTE_FIXED_ROWS,
    chain: Mapping[str, str | None] | None = None,
) -> PlanDecision:
    """Apply the rule of this module's docstring.

    Args:
        first_run: no run has processed the left state yet (or a full refresh reset it).
        left_rows: rows of the left state (tombstones included).
        changed_left_keys: distinct left keys changed since the last run (``None`` on a first run).
        changed_right_keys: per join alias, distinct right keys changed since the last run.
        subscription_rows: per join alias, rows of its subscription table.
        right_rows: per join alias, rows of its right state table.
        share: the threshold's part that grows with the table, as a share of ``left_rows``.
        min_rows: below this many left rows the run stays incremental.
        fixed_rows: the threshold's fixed part, in rows.
        chain: per join alias (in config order), the alias it hangs off (``None``: the left).
    """
    fanout = {
        alias: subscription_rows.get(alias, 0) / right_rows[alias] if right_rows.get(alias) else 0.0
        for alias in changed_right_keys
    }

    def decision(
        recompute: bool, reason: str, changed_left: int | None, estimate: int | None
    ) -> PlanDecision:
        return PlanDecision(
            recompute,
            reason,
            left_rows,
            changed_left,
            dict(changed_right_keys),
            fanout,
            estimate,
            share,
            fixed_rows,
        )

    if left_rows < min_rows:
        return decision(
            False, f"left state has {left_rows} rows, fewer than {min_rows}", changed_left_keys, None
        )
    if first_run or changed_left_keys is None:
        return decision(True, "first run", None, None)
    estimate = changed_left_keys + _reached(changed_right_keys, fanout, chain or {})
    threshold = threshold_rows(left_rows, share, fixed_rows)
    recompute = estimate >= threshold
    sign = ">=" if recompute else "<"
    parts = f"{fixed_rows} + {share:g} × {left_rows} left rows"
    reason = f"estimated affected rows {estimate} {sign} {threshold} ({parts})"
    return decision(recompute, reason, changed_left_keys, estimate)


def _reached(
    changed_right_keys: Mapping[str, int], fanout: Mapping[str, float], chain: Mapping[str, str | None]
) -> int:
    """Estimated left rows the right changes reach, hop by hop from the end of each chain."""
    reach: dict[str, float] = {}
    for alias in reversed(list(changed_right_keys)):
        below = sum(n for later, n in reach.items() if chain.get(later) == alias)
        reach[alias] = (changed_right_keys[alias] + below) * fanout[alias]
    return round(sum(n for alias, n in reach.items() if chain.get(alias) is None))


def decide(
    storage: Storage,
    config: PipelineConfig,
    changed: Mapping[str, int],
    plan: str = "auto",
    first_run: bool = False,
) -> PlanDecision:
    """The rule's decision for a run whose sources have ``changed`` keys, from file statistics
    only; ``plan`` other than ``auto`` overrides it (the reason says so)."""
    decision = choose_plan(
        first_run=first_run,
        left_rows=_rows(storage, config.state_path(config.left)),
        changed_left_keys=None if first_run else changed[config.left],
        changed_right_keys={j.alias: changed[j.right] for j in config.joins},
        subscription_rows={j.alias: _rows(storage, config.subscription_path(j)) for j in config.joins},
        right_rows={j.alias: _rows(storage, config.state_path(j.right)) for j in config.joins},
        chain={j.alias: None if j.source == config.left else j.source for j in config.joins},
    )
    return forced(decision, plan, first_run)


def forced(decision: PlanDecision, plan: str, first_run: bool) -> PlanDecision:
    """``decision`` as ``plan`` asks (``auto``: as it is). A first run keeps the rule's
    decision, and its reason says so: it builds every row either way."""
    if plan == "auto" or decision.recompute == (plan == "recompute"):
        return decision
    if first_run:
        return dataclasses.replace(
            decision, reason=f"{decision.reason}; plan={plan} does not apply to a first run"
        )
    reason = f"forced by plan={plan} (the rule said: {decision.reason})"
    return dataclasses.replace(decision, recompute=plan == "recompute", reason=reason)


def _rows(storage: Storage, path: str, version: int | None = None) -> int:
    """Rows of a table from its file statistics (no Spark job); 0 when it does not exist yet."""
    if version is None and not storage.exists(path):
        return 0
    return sum(f.num_records or 0 for f in storage.files(path, version))


def rebuild_first(storage: Storage, config: PipelineConfig, versions: Mapping[str, int]) -> bool:
    """Whether a first run should rebuild the state tables from bronze snapshots (in Spark)
    rather than apply them as one big increment (through the driver): when the bronze tables
    hold :data:`RECOMPUTE_MIN_ROWS` rows or more, by their file statistics."""
    total = sum(_rows(storage, config.bronze_path(name), version) for name, version in versions.items())
    return total >= RECOMPUTE_MIN_ROWS
