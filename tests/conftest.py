"""Shared fixtures: one local SparkSession for the whole test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session")
def spark():
    from cdc_join.session import get_spark

    session = get_spark(
        "cdc_join-tests", {"spark.sql.shuffle.partitions": "2", "spark.default.parallelism": "2"}
    )
    yield session


@pytest.fixture(scope="session")
def storage(spark):
    """The embedded default backend (delta-rs)."""
    from cdc_join.storage import get_storage

    return get_storage(spark, os.environ.get("CDC_JOIN_TEST_STORAGE", "delta-rs"))
