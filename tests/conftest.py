"""Shared fixtures: one local SparkSession for the whole test session."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"

# The `cdc-join` processes tests start keep their JVM's class archive (cdc_join/class_archive.py)
# here, not in the user's cache folder; every process of a test run shares it.
ARCHIVES = os.path.join(tempfile.gettempdir(), "cdc_join-tests-class-archive")
os.environ.setdefault("CDC_JOIN_CLASS_ARCHIVE", ARCHIVES)


BACKENDS = ("delta-rs", "delta-spark")


def pytest_addoption(parser):
    parser.addoption(
        "--storage",
        choices=BACKENDS,
        default=os.environ.get("CDC_JOIN_TEST_STORAGE") or "delta-rs",
        help="the storage backend of the scenario, property, crash and race tests "
        "(default: $CDC_JOIN_TEST_STORAGE, else delta-rs); the contract tests run both",
    )


@pytest.fixture(scope="session")
def backend(request) -> str:
    """The storage backend the suites run on (``--storage``)."""
    return request.config.getoption("--storage")


@pytest.fixture(scope="session")
def spark(backend):
    from cdc_join.session import get_spark

    # Test data is tiny: compiling generated code for every new plan costs more than it saves
    # (measured: the KIP-213 and regression scenarios 95 s → 78-82 s), and one shuffle
    # partition is enough. CDC_JOIN_TEST_SPARK_CONF="key=value,..." overrides for experiments.
    conf = {
        "spark.sql.shuffle.partitions": "1",
        "spark.default.parallelism": "2",
        "spark.sql.codegen.wholeStage": "false",
        "spark.sql.codegen.factoryMode": "NO_CODEGEN",
        # Adaptive execution re-plans after every shuffle: for tiny data that is all cost
        # (measured: two scenario files 99 s -> 92 s).
        "spark.sql.adaptive.enabled": "false",
    }
    extra = os.environ.get("CDC_JOIN_TEST_SPARK_CONF", "")
    conf.update(item.split("=", 1) for item in extra.split(",") if "=" in item)
    # The session always has the Delta jars: the contract tests run on both backends. Code that
    # picks a backend itself (the CLI in-process, `auto`) is told which one the suites run on.
    os.environ["CDC_JOIN_STORAGE"] = backend
    session = get_spark("cdc_join-tests", conf, storage="delta-spark")
    yield session


@pytest.fixture(scope="session")
def storage(spark, backend):
    """The backend the suites run on (``--storage``, default delta-rs)."""
    from cdc_join.storage import get_storage

    return get_storage(spark, backend)


#: Folders whose tests run whole pipelines: each is marked by what it is (``scenario`` or
#: ``property``) unless it is one of the few ``core`` scenarios README's command runs.
_TIERS = {"scenarios": "scenario", "property": "property", "benchmarks": "scenario"}


def pytest_collection_modifyitems(config, items):
    """Mark what each test is, for the tiers (pyproject.toml's markers): the tests of
    ``tests/scenarios`` and ``tests/benchmarks`` that are not ``core`` are ``scenario``, those of
    ``tests/property`` are ``property``; a test that reads or writes through the ``storage``
    fixture, or runs the CLI on it, is ``backend`` (CI runs it on each backend)."""
    root = Path(__file__).parent
    for item in items:
        folder = Path(str(item.fspath)).relative_to(root).parts[0]
        tier = _TIERS.get(folder)
        if tier is not None and item.get_closest_marker("core") is None:
            item.add_marker(getattr(pytest.mark, tier))
        if "storage" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.backend)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A skip raised while setting up a fixture (e.g. the delta-spark backend without its jars)
    is reported once per file and reason, not once per test: its line number is dropped, which
    is how pytest folds skips in the ``-ra`` summary."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "setup" and report.skipped and isinstance(report.longrepr, tuple):
        path, _, reason = report.longrepr
        report.longrepr = (path, None, reason)
