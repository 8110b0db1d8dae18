"""What `cdc-join status` and `cdc-join plan` print, as a person reads it (no Spark needed)."""

from __future__ import annotations

import re

from cdc_join.cli.status import NextRun, Status, age


def test_an_age_reads_in_minutes_hours_then_days_with_the_date():
    assert age(0.4) == "under a minute ago"
    assert age(42.2) == "42 min ago"
    assert age(125) == "2 h 5 min ago"
    assert re.fullmatch(r"1 day ago \(\d{4}-\d\d-\d\d \d\d:\d\d UTC\)", age(24 * 60 + 30))
    # A lag of 29,935,862 minutes (an event time of 1970) was shown as such.
    assert re.fullmatch(r"20789 days ago \(1970-01-0\d \d\d:\d\d UTC\)", age(29935862))


def test_status_shows_a_source_s_newest_event_as_a_readable_age():
    status = Status(
        runs=[],
        unfinished=[],
        sources={
            "orders": {"lag_minutes": 29935862.0, "pending_files": 0, "quarantined": 0},
            "customers": {"lag_minutes": None, "pending_files": 1, "quarantined": 0},
        },
        tables={},
    )
    text = status.summary()
    assert "orders: newest event 20789 days ago (" in text and "min ago" not in text
    assert "customers: no events yet" in text


def test_plan_names_events_per_source_and_never_a_count_of_nothing():
    idle = NextRun(pending={}, path="incremental", reason="r", events_to_apply={"lhs": 0})
    assert "ingested, not yet applied: no events" in idle.summary()
    busy = NextRun(pending={}, path="incremental", reason="r", events_to_apply={"lhs": 3, "rhs": 1})
    assert "ingested, not yet applied: lhs: 3 event(s), rhs: 1 event(s)" in busy.summary()
    first = NextRun(pending={"lhs": {"files": 1, "bytes": 10}}, path=None, reason="the first run: ...")
    assert "path: chosen after the ingest (the first run: ...)" in first.summary()
    assert "nothing event" not in first.summary() + idle.summary()
