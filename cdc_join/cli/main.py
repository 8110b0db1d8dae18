"""cdc-join: keep a denormalized Delta table up to date from Debezium change feeds.

Exit codes, for schedulers:

  0  done
  1  verify found differences, or a quality check of severity fail failed
  2  the configuration (pipeline YAML with its quality section, options, CDC_JOIN_STORAGE)
     is invalid
  3  a data problem: events were quarantined or a type changed (see 'cdc-join quarantine'),
     a source the join needs has no events yet, a landing file changed after it was
     ingested, or a batch has no usable sequence field or mixes connectors
  4  another run holds the pipeline, or committed first while this one worked (run again);
     verify: a run stopped before its commit (run again, then verify)
  5  a storage or internal error
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from cdc_join import __version__
from cdc_join.errors import (
    CdcJoinError,
    ConcurrentRunError,
    ConfigError,
    ConfigErrors,
    InputError,
    first_line,
)
from cdc_join.run.cost import PLANS

OK, DIFFERENCES, CONFIG_ERROR, DATA_PROBLEM, BUSY, FAILURE = 0, 1, 2, 3, 4, 5
#: The shape of every ``--json`` document; it grows when a field changes meaning or goes.
JSON_SCHEMA_VERSION = 1
STORAGES = ("auto", "delta-rs", "delta-spark")


def _global_options(parser: argparse.ArgumentParser, defaults: bool) -> None:
    """Options accepted before and after the command (``cdc-join run --storage delta-rs p.yml``)."""
    value = (lambda v: v) if defaults else (lambda v: argparse.SUPPRESS)
    parser.add_argument(
        "--storage",
        choices=STORAGES,
        default=value(None),
        help="storage backend (default: $CDC_JOIN_STORAGE, else auto)",
    )
    parser.add_argument(
        "--lake",
        default=value(None),
        help="root folder or URI of the pipeline's tables, instead of the config's 'lake' and 'tables'",
    )
    parser.add_argument(
        "--tables",
        default=value(None),
        metavar="CATALOG.SCHEMA",
        help="address every table by name in this schema, instead of the config's 'tables' (delta-spark)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        default=value(False),
        help="print the report as one JSON document on stdout",
    )
    parser.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        default=value(False),
        help="print only errors and the final result",
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", default=value(False), help="print every count of every step"
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        default=value(False),
        help="print the full error and stack trace on failure, and Spark's own start-up output",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cdc-join",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"cdc-join {__version__}")
    _global_options(parser, defaults=True)
    common = argparse.ArgumentParser(add_help=False)
    _global_options(common, defaults=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, text: str) -> argparse.ArgumentParser:
        cmd = sub.add_parser(name, help=text, description=text, parents=[common])
        if name != "demo":
            cmd.add_argument("config", help="the pipeline YAML")
        return cmd

    run = command("run", "ingest new landing files, then one join run")
    run.add_argument(
        "--no-ingest", action="store_true", help="skip ingest (bronze is filled by another tool)"
    )
    run.add_argument(
        "--plan",
        choices=PLANS,
        default="auto",
        help="auto lets the cost rule pick; incremental or recompute force one",
    )
    command("full-refresh", "rebuild state, subscriptions and silver from bronze")
    verify = command("verify", "compare silver with a recompute from bronze; exit 1 on a difference")
    verify.add_argument(
        "--repair", action="store_true", help="when it differs, run a full refresh and check again"
    )
    verify.add_argument(
        "--from",
        dest="source",
        choices=("bronze", "state"),
        default="bronze",
        help="recompute from bronze (default), or from the state tables: faster, blind to damaged state",
    )
    check = command(
        "check", "data-quality checks on the silver rows a run touched; exit 1 when a fail check fails"
    )
    check.add_argument("--run-id", type=int, default=None, help="the run to check (default: the newest)")
    optimize = command("optimize", "compact the tables whose file statistics call for it")
    optimize.add_argument(
        "--force", action="store_true", help="compact every table, whatever the policy says"
    )
    quarantine = command("quarantine", "list quarantined lines: file, line, reason and raw text")
    quarantine.add_argument("--source", default=None, help="only this source")
    quarantine.add_argument("--limit", type=int, default=20, help="at most this many lines (default 20)")
    command("status", "the last runs, an unfinished one, each source's lag and quarantine, table sizes")
    command("plan", "what the next run would do and why, without writing anything")
    demo = command("demo", "run a self-contained example on the Debezium tutorial's inventory data")
    demo.add_argument("--dir", default=None, help="working folder (default: a new temporary folder)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    say = _Printer(args)
    try:
        return COMMANDS[args.command](args, say)
    except ConfigError as e:
        return say.error(e, CONFIG_ERROR, e.hint or "fix the pipeline YAML and run again")
    except ConcurrentRunError as e:
        return say.error(e, BUSY, e.hint or "run again when the other run is done")
    except InputError as e:
        return say.error(e, DATA_PROBLEM, e.hint or "fix the input the message names, then run again")
    except CdcJoinError as e:
        return say.error(e, FAILURE, e.hint or "rerun with --debug for details; a rerun is safe")
    except Exception as e:
        return say.error(e, FAILURE, "rerun with --debug for details; a rerun is safe", internal=True)


class _Printer:
    """What the CLI prints, by verbosity: progress and reports on stdout, errors on stderr."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def progress(self, line: str) -> None:
        if not (self.args.quiet or self.args.json):
            print(line, flush=True)

    def result(self, text: str, document: Any = None) -> None:
        if self.args.json:
            # One document, whatever the command: its fields, with the command and the version
            # of this shape (a list is the document's "items").
            body = document if isinstance(document, Mapping) else {"items": document}
            shaped = {**body, "command": self.args.command, "schema_version": JSON_SCHEMA_VERSION}
            print(json.dumps(shaped, default=str, sort_keys=True))
        else:
            print(text)

    def error(self, e: BaseException, code: int, hint: str, *, internal: bool = False) -> int:
        if self.args.debug:
            traceback.print_exception(e, file=sys.stderr)
        what = f"{type(e).__name__}: {first_line(e)}" if internal else first_line(e)
        if isinstance(e, ConfigErrors):  # every mistake, one per line, indented under the first
            what = str(e).replace("\n  ", "\n    ")
        print(f"cdc-join: error: {what}\n  next: {hint}", file=sys.stderr)
        return code


def open_pipeline(args: argparse.Namespace, progress: Callable[[str], None] | None = None):  # type: ignore[no-untyped-def]
    """The pipeline of parsed arguments; config and storage choice are checked before Spark starts."""
    from cdc_join.config import load_config, parse_tables
    from cdc_join.storage.select import requested_backend

    config = load_config(args.config, lake=args.lake or None, tables=parse_tables(args.tables or None))
    if config.quality:  # checked by every command, not only by `check`, which would come too late
        from cdc_join.checks.quality_config import (
            parse_quality,  # imports great-expectations: only when needed
        )

        parse_quality(config)
    try:
        requested_backend(args.storage)
    except CdcJoinError as e:
        raise ConfigError(str(e)) from None
    from cdc_join.run.pipeline import Pipeline
    from cdc_join.session import DeferredSession, quiet_query_context_logs
    from cdc_join.storage import get_storage

    # Started when first needed: a run with nothing to do, on a local lake, needs no JVM.
    spark = DeferredSession(
        f"cdc_join:{config.name}", quiet=not args.debug, storage=args.storage, class_archive=True
    )
    quiet_query_context_logs(not args.debug)  # also for a session that was already running
    return Pipeline(config, spark, get_storage(spark, args.storage), progress=progress)


def _pipeline(args: argparse.Namespace, say: _Printer):  # type: ignore[no-untyped-def]
    return open_pipeline(args, say.progress)


def _run(args: argparse.Namespace, say: _Printer) -> int:
    pipeline = _pipeline(args, say)
    if args.command == "full-refresh":
        report = pipeline.full_refresh()
    else:
        report = pipeline.run(ingest=not args.no_ingest, plan=args.plan)
    say.result(report.summary(verbose=args.verbose), report.to_dict())
    return DATA_PROBLEM if report.data_problem(pipeline.config) else OK


def _verify(args: argparse.Namespace, say: _Printer) -> int:
    result = _pipeline(args, say).verify(repair=args.repair, source=args.source)
    say.result(result.summary(), dataclasses.asdict(result) | {"ok": result.ok})
    if result.unfinished:
        return BUSY  # not a difference: the rerun of the stopped run finishes it
    return OK if result.ok else DIFFERENCES


def _check(args: argparse.Namespace, say: _Printer) -> int:
    from cdc_join.checks.quality import check

    pipeline = _pipeline(args, say)
    report = check(pipeline.config, pipeline.storage, run_id=args.run_id)
    say.result(report.summary(), {"ok": report.ok, "summary": report.summary()})
    return OK if report.ok else DIFFERENCES


def _optimize(args: argparse.Namespace, say: _Printer) -> int:
    from cdc_join.run.maintenance import optimize_pipeline, summary

    pipeline = _pipeline(args, say)
    done = optimize_pipeline(pipeline.storage, pipeline.config, force=args.force)
    say.result(summary(done), done)
    return OK


def _quarantine(args: argparse.Namespace, say: _Printer) -> int:
    from cdc_join.landing.ingest import quarantined

    pipeline = _pipeline(args, say)
    rows = quarantined(pipeline.storage, pipeline.config, source=args.source, limit=args.limit)
    lines = [f"{r['source']} {r['_file']}:{r['_line']}: {r['reason']}\n    {r['raw']}" for r in rows]
    say.result("\n".join(lines) if lines else "no quarantined lines", rows)
    return OK


def _status(args: argparse.Namespace, say: _Printer) -> int:
    from cdc_join.cli.status import status

    pipeline = _pipeline(args, say)
    found = status(pipeline.storage, pipeline.config)
    say.result(found.summary(), found.as_dict())
    return OK


def _plan(args: argparse.Namespace, say: _Printer) -> int:
    from cdc_join.cli.status import next_run

    pipeline = _pipeline(args, say)
    found = next_run(pipeline.storage, pipeline.config)
    say.result(found.summary(), found.as_dict())
    return OK


def _demo(args: argparse.Namespace, say: _Printer) -> int:
    from cdc_join.cli.demo import run_demo

    for option in ("json", "lake", "tables"):
        if getattr(args, option):
            raise ConfigError(
                f"demo writes its own pipeline and prints a walkthrough: --{option} does not apply"
            )

    run_demo(args.dir, quiet=not args.debug, storage=args.storage)
    return OK


COMMANDS: dict[str, Callable[[argparse.Namespace, _Printer], int]] = {
    "run": _run,
    "full-refresh": _run,
    "verify": _verify,
    "check": _check,
    "optimize": _optimize,
    "quarantine": _quarantine,
    "status": _status,
    "plan": _plan,
    "demo": _demo,
}


if __name__ == "__main__":
    sys.exit(main())
