"""``cdc-join``: a thin argparse shim over :class:`cdc_join.pipeline.Pipeline`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from cdc_join.cost import PLANS
from cdc_join.errors import CdcJoinError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cdc-join", description=__doc__)
    parser.add_argument(
        "--storage",
        choices=["auto", "delta-rs", "delta-spark"],
        default=None,
        help="storage backend (default: $CDC_JOIN_STORAGE or auto)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="ingest new landing files, then one incremental join run")
    run.add_argument("config", help="pipeline YAML")
    run.add_argument(
        "--no-ingest", action="store_true", help="skip ingest (bronze is filled by another tool)"
    )
    run.add_argument(
        "--plan",
        choices=PLANS,
        default="auto",
        help="auto: the cost rule picks; or force an incremental run or a recompute of the join",
    )
    full = sub.add_parser("full-refresh", help="rebuild state, subscriptions and silver from bronze")
    full.add_argument("config")
    verify = sub.add_parser("verify", help="compare silver with a full recompute; exit 1 on any difference")
    verify.add_argument("config")
    verify.add_argument("--repair", action="store_true", help="fix silver in place when it differs")
    check = sub.add_parser(
        "check", help="data-quality checks on the silver rows a run touched; exit 1 when a 'fail' check fails"
    )
    check.add_argument("config")
    check.add_argument("--run-id", type=int, default=None, help="the run to check (default: the newest)")
    optimize = sub.add_parser(
        "optimize", help="compact small files and Z-order subscriptions by fk where the policy says so"
    )
    optimize.add_argument("config")
    optimize.add_argument("--force", action="store_true", help="optimize every table, policy or not")
    demo = sub.add_parser("demo", help="run a self-contained example on the inventory sample data")
    demo.add_argument("--dir", default=None, help="working folder (default: a new temporary folder)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _dispatch(args)
    except CdcJoinError as e:
        print(f"cdc-join: error: {e}", file=sys.stderr)
        return 2


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "demo":
        from cdc_join.demo import run_demo

        run_demo(args.dir)
        return 0
    from cdc_join.config import load_config
    from cdc_join.pipeline import Pipeline
    from cdc_join.session import get_spark
    from cdc_join.storage import get_storage

    config = load_config(args.config)
    spark = get_spark(f"cdc_join:{config.name}")
    pipeline = Pipeline(config, spark, get_storage(spark, args.storage), progress=print)
    if args.command == "run":
        print(pipeline.run(ingest=not args.no_ingest, plan=args.plan).summary())
        return 0
    if args.command == "full-refresh":
        print(pipeline.full_refresh().summary())
        return 0
    if args.command == "check":
        from cdc_join.quality import check

        report = check(config, pipeline.storage, run_id=args.run_id)
        print(report.summary())
        return 0 if report.ok else 1
    if args.command == "optimize":
        from cdc_join.maintenance import optimize_pipeline, summary

        print(summary(optimize_pipeline(pipeline.storage, config, force=args.force)))
        return 0
    if args.command == "verify":
        result = pipeline.verify(repair=args.repair)
        print(result.summary())
        return 0 if result.ok or result.repaired else 1
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
