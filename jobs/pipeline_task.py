"""Entry point of the bundle's pipeline tasks (Databricks ``spark_python_task``); runs locally too.

    python jobs/pipeline_task.py [--lake URI] [--storage B] run CONFIG [--no-ingest] [--plan P]
    python jobs/pipeline_task.py [--lake URI] [--storage B] check CONFIG [--run-id N]
    python jobs/pipeline_task.py [--lake URI] [--storage B] full-refresh CONFIG
    python jobs/pipeline_task.py [--lake URI] [--storage B] verify CONFIG [--repair]

The commands and exit codes are those of ``cdc-join``: 0 done, 1 a check failed (``verify``
found a difference, or an expectation of severity ``fail`` failed), 2 an error. ``--lake``
replaces the config's ``lake``, so one pipeline YAML serves every bundle target.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable, Sequence

from pyspark.sql import SparkSession

from cdc_join.config import load_config
from cdc_join.cost import PLANS
from cdc_join.errors import CdcJoinError
from cdc_join.pipeline import Pipeline
from cdc_join.quality import check
from cdc_join.session import get_spark
from cdc_join.storage import get_storage

PROG = "pipeline_task.py"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument(
        "--lake", default=None, help="root URI of the pipeline's tables (default: the config's)"
    )
    parser.add_argument("--storage", choices=["auto", "delta-rs", "delta-spark"], default=None)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="ingest new landing files, then one incremental join run")
    run.add_argument("config", help="pipeline YAML")
    run.add_argument("--no-ingest", action="store_true", help="bronze is filled by another tool")
    run.add_argument(
        "--plan",
        choices=PLANS,
        default="auto",
        help="auto: the cost rule picks; or force an incremental run or a recompute of the join",
    )
    quality = sub.add_parser("check", help="quality checks on the rows a run touched")
    quality.add_argument("config")
    quality.add_argument("--run-id", type=int, default=None, help="default: the newest run")
    full = sub.add_parser("full-refresh", help="rebuild state, subscriptions and silver from bronze")
    full.add_argument("config")
    verify = sub.add_parser("verify", help="compare silver with a full recompute")
    verify.add_argument("config")
    verify.add_argument("--repair", action="store_true", help="fix silver in place when it differs")
    optimize = sub.add_parser("optimize", help="compact small files and Z-order subscriptions by fk")
    optimize.add_argument("config")
    optimize.add_argument("--force", action="store_true", help="optimize every table, policy or not")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](open_pipeline(args), args)
    except CdcJoinError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


def open_pipeline(args: argparse.Namespace) -> Pipeline:
    """The configured pipeline, on the cluster's session where there is one."""
    config = load_config(args.config)
    if args.lake:
        config = dataclasses.replace(config, lake=args.lake.rstrip("/"))
    if os.environ.get("DATABRICKS_RUNTIME_VERSION"):
        # A task's process may not have made the runtime's session active yet; doing so first
        # keeps get_spark from applying its small-machine settings to the cluster's session.
        SparkSession.builder.getOrCreate()
    spark = get_spark(f"cdc_join:{config.name}")
    return Pipeline(config, spark, get_storage(spark, args.storage), progress=print)


def _run(pipeline: Pipeline, args: argparse.Namespace) -> int:
    print(pipeline.run(ingest=not args.no_ingest, plan=args.plan).summary())
    return 0


def _check(pipeline: Pipeline, args: argparse.Namespace) -> int:
    report = check(pipeline.config, pipeline.storage, run_id=args.run_id)
    print(report.summary())
    return 0 if report.ok else 1


def _full_refresh(pipeline: Pipeline, args: argparse.Namespace) -> int:
    print(pipeline.full_refresh().summary())
    return 0


def _verify(pipeline: Pipeline, args: argparse.Namespace) -> int:
    result = pipeline.verify(repair=args.repair)
    print(result.summary())
    return 0 if result.ok or result.repaired else 1


def _optimize(pipeline: Pipeline, args: argparse.Namespace) -> int:
    from cdc_join.maintenance import optimize_pipeline, summary

    print(summary(optimize_pipeline(pipeline.storage, pipeline.config, force=args.force)))
    return 0


COMMANDS: dict[str, Callable[[Pipeline, argparse.Namespace], int]] = {
    "run": _run,
    "check": _check,
    "full-refresh": _full_refresh,
    "verify": _verify,
    "optimize": _optimize,
}


if __name__ == "__main__":
    sys.exit(main())
