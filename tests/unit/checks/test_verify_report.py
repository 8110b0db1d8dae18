"""What `cdc-join verify` says, from its counts (no Spark needed)."""

from __future__ import annotations

from cdc_join.checks.verify import VerifyReport


def test_landing_files_no_run_will_ingest_make_verify_fail_and_are_named():
    report = VerifyReport(3, 3, 0, 0, 0, unlisted={"orders": ("a.json", "b.json", "c.json", "d.json")})
    assert report.silver_ok and not report.ok
    lines = report.summary().splitlines()
    assert lines[0].startswith("silver matches bronze, but landing files are left out")
    assert lines[1] == (
        "  landing files of orders no run will ingest: 4 (a.json, b.json, c.json and 1 more), modified "
        "before the lookback window; run once without landing_lookback_hours to take them in"
    )
    assert VerifyReport(3, 3, 0, 0, 0).ok
