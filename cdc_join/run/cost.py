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
affected rows) plus a share of the table. Both are fitted per storage backend from the TPC-H
benchmark (:data:`FITS`; ``benchmarks/README.md``, "The cost rule"), and the run report's plan
step names the fit it used. ``Pipeline.run(plan=...)`` / ``cdc-join run
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


@dataclass(frozen=True)
class Fit:
    """The threshold's two terms for one storage backend, fitted from the TPC-H benchmark with
    both plans forced on the same batches (benchmarks/README.md, "The cost rule")."""

    #: The threshold's fixed part: what a recompute's extra fixed cost buys an incremental run.
    fixed_rows: int
    #: ... plus this share of the left state's rows.
    share: float


#: Per backend (``Storage.name``). delta-rs (2 cores, 2026-11-25): at 150,000 orders the two
#: plans cost the same for 6,000 and for 58,000 affected rows (3.7 and 9.5 s); at 1.5 M the
#: recompute costs 2.6 s more for 5,800 (7.8 against 5.2 s) and 2.5 s more for 60,000, and 1.9 s
#: less for 571,000 (35.1 against 37.0 s). Least squares: the recompute costs 0.07 s + 1.8 µs per
#: left row − 8.1 µs per affected row more, so it wins from 8,500 rows plus 22% of the left rows
#: on. delta-spark (2 cores, 2026-11-28, medians of 2 batches, the same five workloads): the
#: recompute costs 1.7 and 0.4 s more than an incremental run for 6,000 and 58,000 affected rows
#: at 150,000 orders (10.1 against 8.5 s, 15.6 against 15.1 s), 1.3 and 1.1 s more for 5,800 and
#: 60,000 at 1.5 M (13.4 against 12.2 s, 18.9 against 17.8 s), and 0.4 s less for 571,000 (46.7
#: against 47.1 s): 1.1 s + 0.13 µs per left row − 3.1 µs per affected row more, so it wins from
#: 365,000 rows plus 4% of the left rows on. Spark's scan of the left state costs little; what
#: a recompute saves per row costs little on delta-spark too (no copy-on-write), so its ~20
#: more Spark jobs take a third of a 1.5 M-row table to repay.
FITS: Mapping[str, Fit] = {
    "delta-rs": Fit(fixed_rows=8_500, share=0.22),
    "delta-spark": Fit(fixed_rows=365_000, share=0.04),
}
#: The delta-rs fit's terms, the defaults of :func:`choose_plan`.
RECOMPUTE_SHARE = FITS["delta-rs"].share
RECOMPUTE_FIXED_ROWS = FITS["delta-rs"].fixed_rows
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
    #: The backend whose fit gave ``share`` and ``fixed_rows``.
    fit: str = "delta-rs"

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
            "fit": self.fit,
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
    fit: str = "delta-rs",
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
        fit: the backend whose fit ``share`` and ``fixed_rows`` are (named in the reason).
    """
    fanout = {
        alias: subscription_rows.get(alias, 0) / right_rows[alias] if right_rows.get(alias) else 0.0
        for alias in changed_right_keys
    }

    decided = PlanDecision(
        False,
        "",
        left_rows,
        changed_left_keys,
        dict(changed_right_keys),
        fanout,
        None,
        share,
        fixed_rows,
        fit,
    )
    if left_rows < min_rows:
        return dataclasses.replace(decided, reason=f"left state has {left_rows} rows, fewer than {min_rows}")
    if first_run or changed_left_keys is None:
        return dataclasses.replace(decided, recompute=True, reason="first run", changed_left_keys=None)
    estimate = changed_left_keys + _reached(changed_right_keys, fanout, chain or {})
    threshold = threshold_rows(left_rows, share, fixed_rows)
    recompute = estimate >= threshold
    sign = ">=" if recompute else "<"
    parts = f"{fixed_rows} + {share:g} × {left_rows} left rows, the {fit} fit"
    reason = f"estimated affected rows {estimate} {sign} {threshold} ({parts})"
    return dataclasses.replace(decided, recompute=recompute, reason=reason, estimated_affected_rows=estimate)


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
    only, with the fit of ``storage``'s backend (delta-rs's for another backend); ``plan`` other
    than ``auto`` overrides it (the reason says so)."""
    fit = storage.name if storage.name in FITS else "delta-rs"
    decision = choose_plan(
        first_run=first_run,
        left_rows=_rows(storage, config.state_path(config.left)),
        changed_left_keys=None if first_run else changed[config.left],
        changed_right_keys={j.alias: changed[j.right] for j in config.joins},
        subscription_rows={j.alias: _rows(storage, config.subscription_path(j)) for j in config.joins},
        right_rows={j.alias: _rows(storage, config.state_path(j.right)) for j in config.joins},
        chain={j.alias: None if j.source == config.left else j.source for j in config.joins},
        share=FITS[fit].share,
        fixed_rows=FITS[fit].fixed_rows,
        fit=fit,
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
