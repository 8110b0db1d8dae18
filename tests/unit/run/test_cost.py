"""The cost rule that picks an incremental run or a recompute (no Spark needed)."""

from __future__ import annotations

import pytest

from cdc_join.config import parse_config
from cdc_join.run.cost import FITS, RECOMPUTE_MIN_ROWS, choose_plan, decide, forced, threshold_rows
from cdc_join.storage.base import FileStats


def _plan(**kw):
    args = dict(
        first_run=False,
        left_rows=1_000_000,
        changed_left_keys=1_000,
        changed_right_keys={"c": 10},
        subscription_rows={"c": 1_000_000},
        right_rows={"c": 100_000},
    )
    args.update(kw)
    return choose_plan(**args)


def test_estimate_adds_changed_left_keys_and_right_fanout_from_table_sizes():
    decision = _plan()
    assert decision.fanout == {"c": 10.0}
    assert decision.estimated_affected_rows == 1_000 + 10 * 10
    assert not decision.recompute
    assert decision.as_report()["threshold_rows"] == threshold_rows(1_000_000)


def test_recompute_from_the_threshold_on():
    at = threshold_rows(1_000_000)
    assert _plan(changed_left_keys=at, changed_right_keys={"c": 0}).recompute
    assert not _plan(changed_left_keys=at - 1, changed_right_keys={"c": 0}).recompute
    # A right-side change with a large fan-out counts as the left rows it touches.
    assert _plan(changed_left_keys=0, changed_right_keys={"c": at // 10}).recompute


def test_first_run_recomputes_and_small_tables_stay_incremental():
    assert _plan(first_run=True, changed_left_keys=None).recompute
    small = _plan(left_rows=RECOMPUTE_MIN_ROWS - 1, changed_left_keys=RECOMPUTE_MIN_ROWS - 1)
    assert not small.recompute and "fewer than" in small.reason


def test_a_given_share_is_the_one_reported():
    decision = _plan(share=0.5, fixed_rows=0, changed_left_keys=400_000, changed_right_keys={"c": 0})
    assert not decision.recompute
    assert decision.as_report()["threshold_rows"] == 500_000


def test_the_fixed_part_of_the_threshold_keeps_small_tables_incremental_longer():
    # A recompute costs more than an incremental run even when both touch few rows: the
    # threshold is a fixed number of rows plus a share of the table.
    plain = _plan(share=0.01, fixed_rows=0, left_rows=100_000, changed_left_keys=1_500, changed_right_keys={})
    fixed = _plan(
        share=0.01, fixed_rows=5_000, left_rows=100_000, changed_left_keys=1_500, changed_right_keys={}
    )
    assert plain.recompute and not fixed.recompute
    assert fixed.as_report()["threshold_rows"] == 6_000
    assert "6000 (5000 + 0.01 × 100000 left rows, the delta-rs fit)" in fixed.reason
    assert _plan(share=0.01, fixed_rows=5_000, left_rows=100_000, changed_left_keys=6_000).recompute


def test_a_forced_plan_says_so_and_a_first_run_says_why_it_keeps_the_rule():
    rule = _plan()
    assert forced(rule, "auto", first_run=False) is rule
    assert forced(rule, "incremental", first_run=False) is rule
    recompute = forced(rule, "recompute", first_run=False)
    assert recompute.recompute and recompute.reason.startswith("forced by plan=recompute (the rule said: ")
    # A first run builds every row whichever plan: the flag is not applied, and the report says so.
    small = _plan(first_run=True, left_rows=10, changed_left_keys=None)
    kept = forced(small, "recompute", first_run=True)
    assert not kept.recompute
    assert kept.reason == f"{small.reason}; plan=recompute does not apply to a first run"
    big = _plan(first_run=True, changed_left_keys=None)
    assert (
        forced(big, "incremental", first_run=True).reason
        == "first run; plan=incremental does not apply to a first run"
    )


def test_a_change_at_the_end_of_a_chain_counts_the_left_rows_it_reaches_through_each_hop():
    # orders → customers (10 orders each) → nations (6,000 customers each) → regions (5 nations
    # each): one region renamed reaches 5 × 6,000 × 10 orders.
    chain = {"customers": None, "nations": "customers", "regions": "nations"}
    decision = _plan(
        left_rows=1_500_000,
        changed_left_keys=0,
        changed_right_keys={"customers": 0, "nations": 0, "regions": 1},
        subscription_rows={"customers": 1_500_000, "nations": 150_000, "regions": 25},
        right_rows={"customers": 150_000, "nations": 25, "regions": 5},
        chain=chain,
    )
    assert decision.estimated_affected_rows == 300_000
    # Without the chain each hop would count only its own keys: 5 nations' worth of nothing.
    moved = _plan(
        left_rows=1_500_000,
        changed_left_keys=0,
        changed_right_keys={"customers": 1, "nations": 0, "regions": 0},
        subscription_rows={"customers": 1_500_000, "nations": 150_000, "regions": 25},
        right_rows={"customers": 150_000, "nations": 25, "regions": 5},
        chain=chain,
    )
    assert moved.estimated_affected_rows == 10


class _Tables:
    """A storage whose tables are row counts (by path), as their file statistics give them."""

    def __init__(self, name, rows):
        self.name = name
        self.rows = rows

    def exists(self, path):
        return path in self.rows

    def files(self, path, version=None):
        return [FileStats(f"{path}/part-0.parquet", 1, self.rows[path], {}, {})]


def _config():
    raw = {
        "name": "p",
        "lake": "/lake",
        "sources": {
            "orders": {"landing": "/landing/orders", "primary_key": ["id"]},
            "customers": {"landing": "/landing/customers", "primary_key": ["id"]},
        },
        "left": "orders",
        "joins": [{"right": "customers", "foreign_key": ["customer_id"], "type": "left"}],
        "select": {"id": "orders.id", "name": "customers.name"},
        "output": "out",
    }
    return parse_config(raw, check_paths=False)


@pytest.mark.parametrize("backend", sorted(FITS))
def test_a_run_uses_its_backend_s_fit_and_its_report_names_it(backend):
    config = _config()
    alias = config.joins[0].alias
    left = 1_000_000
    storage = _Tables(
        backend,
        {
            config.state_path("orders"): left,
            config.state_path("customers"): 100_000,
            config.subscription_path(config.joins[0]): left,
        },
    )
    fit = FITS[backend]
    at = fit.fixed_rows + round(fit.share * left)

    below = decide(storage, config, {"orders": at - 1, "customers": 0})
    reached = decide(storage, config, {"orders": at, "customers": 0})

    assert not below.recompute and reached.recompute
    assert below.as_report()["threshold_rows"] == at
    assert below.as_report()["fit"] == backend
    assert f"the {backend} fit" in below.reason
    assert below.changed_right_keys == {alias: 0}


def test_the_fits_differ_and_another_backend_gets_the_delta_rs_fit():
    assert FITS["delta-spark"] != FITS["delta-rs"]
    config = _config()
    storage = _Tables("in-memory", {config.state_path("orders"): 1_000_000})
    decision = decide(storage, config, {"orders": 10, "customers": 0})
    assert decision.fit == "delta-rs"
    assert decision.threshold_rows == threshold_rows(1_000_000)
