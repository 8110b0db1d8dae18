"""Entry point of the bundle's integration-test task: the project's pytest suite on a cluster.

    python jobs/run_tests.py [--project-dir DIR] [--storage B] [-- PYTEST ARGS...]

Runs ``pytest`` in the project folder (default: the folder above ``jobs/``) with
``CDC_JOIN_STORAGE`` and ``CDC_JOIN_TEST_STORAGE`` set to ``--storage`` (default
``delta-spark``), so the contract suite's delta-spark half and every test using the ``storage``
fixture run on the cluster's Delta. Without pytest arguments it runs ``tests/contract`` and
``tests/scenarios``.
Exits with pytest's exit code.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

DEFAULT_PROJECT = Path(__file__).resolve().parents[1]
DEFAULT_TESTS = ["tests/contract", "tests/scenarios"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="run_tests.py", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--project-dir", type=Path, default=DEFAULT_PROJECT, help="folder with pyproject.toml"
    )
    parser.add_argument("--storage", choices=["delta-spark", "delta-rs"], default="delta-spark")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (put them after --)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ["CDC_JOIN_STORAGE"] = args.storage
    os.environ["CDC_JOIN_TEST_STORAGE"] = args.storage
    if os.environ.get("DATABRICKS_RUNTIME_VERSION"):
        from pyspark.sql import SparkSession

        # Make the runtime's session the active one before the tests' fixture asks for one.
        SparkSession.builder.getOrCreate()
    os.chdir(args.project_dir)
    # Workspace files are slow and sometimes read-only: no bytecode or cache files there.
    sys.dont_write_bytecode = True
    import pytest

    selected = args.pytest_args or DEFAULT_TESTS
    return int(pytest.main([*selected, "--storage", args.storage, "-p", "no:cacheprovider"]))


if __name__ == "__main__":
    sys.exit(main())
