"""Landing files → bronze, exactly once per file.

A run lists a source's landing folder (:mod:`cdc_join.landing.listing`), drops the files the ingest
log already names, reads the rest and parses them with :func:`cdc_join.landing.debezium.parse_events`;
the parsed lines stay in Spark, counted per file (:mod:`cdc_join.landing.outcome`).

Landing files are immutable: a file the log names that changed since (its size; or its
modification time, when its bytes' MD5 differs too or can't be read) stops the run with an
error naming it, since its new content could be read neither exactly once nor silently
skipped. With ``landing_lookback_hours`` only files modified after the newest ingest minus
the lookback are listed, and the log is read only where its name ranges hold a listed file,
so finding new files does not grow with every file ever ingested. A file holding one JSON array
instead of JSON lines is quarantined with one reason for the whole file.

Exactly once, even when a run is killed between any two steps, comes from the order of the
writes and from making each write idempotent:

1. bronze: an append when bronze holds no line of the batch's files, else an INSERT-only MERGE
   on ``(_file, _line)``: a line already there is skipped;
2. quarantine: the same MERGE on ``(source, _file, _line)``;
3. the ingest log, appended last (once for all sources, by :func:`ingest_all`): once a file is
   named there it is never read again.

A run killed before step 3 leaves its files out of the log, so the next run reads them again,
and the two MERGEs insert only the lines the killed run did not write.

Tables: bronze at ``config.bronze_path(source)`` (the event columns of
:data:`cdc_join.landing.debezium.EVENT_COLUMNS` plus ``_ingested_at``), one quarantine table for all
sources at ``config.quarantine_path``, the ingest log at ``config.ingest_log_path``. All are
created with Change Data Feed on. ``_file`` is the file's path inside its landing folder (e.g.
``topics/orders/partition=0/orders+0+0000000000.json``), so moving or re-mounting the folder does
not make its files new.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import astuple, dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import (
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from cdc_join.changeset import ChangeSet, arrow_schema, frame_of, from_arrow, materialize
from cdc_join.config import PipelineConfig
from cdc_join.errors import ConfigError, InputError, StorageError
from cdc_join.landing.debezium import parse_events
from cdc_join.landing.debezium.sequence import LEGACY_RULES, kept_legacy_rule
from cdc_join.landing.debezium.unavailable import UNAVAILABLE_VALUE
from cdc_join.landing.listing import (
    LandedFile,
    folder_warnings,
    landing_files,
    list_folder,
    list_folders,
    list_landing,
    list_local_folders,
    read_lines,
    text_bytes,
    unread_files,
)
from cdc_join.landing.outcome import QUARANTINE_TABLE_SCHEMA, FileCounts, Outcome
from cdc_join.locations import glob_escape, local_path
from cdc_join.schemas import conform, conforms
from cdc_join.storage.base import MergeSpec, Storage

#: A batch of landing files of less text than this (:func:`~cdc_join.landing.listing.text_bytes`)
#: is read and parsed by one task, not cached, and brought to the driver by the job that counts
#: its lines (:mod:`cdc_join.landing.outcome`): its events are appended to bronze as rows on the
#: driver, which delta-rs takes as they are, without Spark's estimate of their size (0.1 s), and
#: delta-spark adds as one file written here, without Spark's writer. Each shuffle, cache or
#: write from Spark is a Spark job of its own, which costs a small batch more than its lines.
ONE_TASK_BYTES = 4 * 1024 * 1024

STEPS = ("bronze", "quarantine", "log")
"""The writes of one ingest, in order; ``after_step`` hooks see these names."""

INGEST_LOG_SCHEMA = StructType(
    [
        StructField("source", StringType()),
        StructField("file", StringType()),
        StructField("size", LongType()),
        StructField("lines", LongType()),
        StructField("events", LongType()),
        StructField("quarantined", LongType()),
        StructField("tombstones", LongType()),
        StructField("ingested_at", TimestampType()),
        StructField("modified_at", TimestampType()),
        StructField("content_md5", StringType()),
    ]
)
_BRONZE_MERGE = MergeSpec(on="t._file = s._file AND t._line = s._line", update=False, merge_schema=True)
_QUARANTINE_MERGE = MergeSpec(
    on="t.source = s.source AND t._file = s._file AND t._line = s._line", update=False, merge_schema=True
)

StepHook = Callable[[str], None]
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IngestReport:
    """What one ingest of one source did.

    ``lines`` counts non-blank lines: ``lines == events + quarantined + tombstones``.
    """

    source: str
    files: int
    lines: int
    events: int
    tombstones: int
    quarantined: int
    seconds: float
    reasons: Mapping[str, int] = field(default_factory=dict)
    """Quarantined lines per reason."""
    unavailable: Mapping[str, int] = field(default_factory=dict)
    """Per column, the events whose ``after`` image holds Debezium's placeholder for a value it
    could not read (see :mod:`cdc_join.landing.debezium.unavailable`)."""
    unread: tuple[str, ...] = ()
    """Files in the landing folder a run does not read: their names end otherwise than
    ``.json``, ``.jsonl``, ``.json.gz`` or ``.jsonl.gz`` (and do not mark them as still being
    written)."""
    missing_folder: str | None = None
    """The landing folder, when it does not exist (yet)."""
    legacy_sequence: str | None = None
    """The rule of an earlier version this batch's events were ordered by, as bronze's were
    (:data:`~cdc_join.landing.debezium.sequence.LEGACY_RULES`)."""

    def warnings(self) -> list[str]:
        """What the run report says about :attr:`missing_folder`, :attr:`unread`,
        :attr:`unavailable` and :attr:`legacy_sequence`, if anything."""
        found = folder_warnings(self.source, self.missing_folder, self.unread)
        if self.unavailable:
            found.append(self._unavailable_warning())
        if self.legacy_sequence is not None:
            found.append(_legacy_warning(self.source, self.legacy_sequence))
        return found

    def _unavailable_warning(self) -> str:
        columns = ", ".join(f"{c} ({n})" for c, n in sorted(self.unavailable.items()))
        return (
            f"source {self.source!r}: events carry Debezium's placeholder {UNAVAILABLE_VALUE!r} instead "
            f"of a value it could not read, in column(s) {columns}; state and silver hold the "
            "placeholder for those rows until a later event carries the value. PostgreSQL sends it for "
            "an unchanged TOASTed value when the table's REPLICA IDENTITY is not FULL, Oracle for an "
            "unchanged LOB: set REPLICA IDENTITY FULL (or enable LOB capture), then snapshot the "
            "table again (a Debezium incremental snapshot) to replace the placeholders"
        )


def _legacy_warning(source: str, rule: str) -> str:
    return (
        f"source {source!r}: its bronze was ingested with the sequence rule {rule!r}, which its "
        "new events keep (values of two encodings do not compare): an initial snapshot run again "
        "after streaming does not replace the rows streamed before it (README, \"PostgreSQL's "
        'null first element"). To take the current rule, ingest the landing files again into a '
        "new lake, or start one from the latest snapshot's files"
    )


def legacy_warnings(storage: Storage, config: PipelineConfig) -> list[str]:
    """What to say about sources whose bronze keeps a rule of an earlier version (see
    :data:`~cdc_join.landing.debezium.sequence.LEGACY_RULES`)."""
    found = []
    for name, source in config.sources.items():
        bronze = config.bronze_path(name)
        rule = (
            kept_legacy_rule(source, recorded_sequence(storage, bronze)) if storage.exists(bronze) else None
        )
        if rule is not None:
            found.append(_legacy_warning(name, rule))
    return found


@dataclass(frozen=True)
class Logged:
    """What the ingest log recorded of a file when it was read (``None``: not recorded then)."""

    size: int | None
    modified_ms: int | None = None
    content_md5: str | None = None


def ingest_all(
    spark: SparkSession,
    storage: Storage,
    config: PipelineConfig,
    *,
    after_step: StepHook | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, IngestReport]:
    """Ingest every source that has a landing folder; see :func:`ingest_source`.

    The landing folders are listed first (with ``landing_lookback_hours``, only files modified
    since the newest ingest minus the lookback), then the ingest log is read once for all of
    them, and only its data files whose name range can hold a listed file. The ingest log's
    rows of every source's files are appended in one commit, once every source's bronze holds
    their lines (a run killed before it reads those files again, and bronze takes none of their
    lines twice, see :func:`_write_bronze`).
    """
    found = list_folders(spark, config, _listing_since(storage, config))
    listed = {name: landing_files(files) for name, files in found.items()}
    done = logged_files(storage, config, listed)
    log: list[pa.Table] = []
    reports = {
        name: ingest_source(
            spark,
            storage,
            config,
            name,
            after_step=after_step,
            done=done.get(name, {}),
            listed=files,
            unread=unread_files(found[name]),
            missing=found[name] is None,
            progress=progress,
            log=log,
        )
        for name, files in listed.items()
    }
    if log:
        _write_log(spark, storage, config.ingest_log_path, log)
        _after(after_step, "log")
    return reports


def nothing_landed(storage: Storage, config: PipelineConfig) -> dict[str, IngestReport] | None:
    """Without Spark, where every landing folder is local: when none holds a file the ingest
    log does not name (nor one that changed since it was read), what :func:`ingest_all` would
    report (no files, the same warnings); ``None`` otherwise, and where it cannot tell."""
    started = time.monotonic()
    found = list_local_folders(config, _listing_since(storage, config))
    if found is None or _unlogged(storage, config, found):
        return None
    seconds = time.monotonic() - started
    return {
        name: IngestReport(
            name,
            *(0, 0, 0, 0, 0),
            seconds=seconds,
            unread=tuple(unread_files(files)),
            missing_folder=config.sources[name].landing if files is None else None,
        )
        for name, files in found.items()
    }


def landed_bytes(storage: Storage, config: PipelineConfig) -> int | None:
    """Without Spark, where every landing folder is local: the bytes of the files an ingest
    would read now (those the ingest log does not name, or that changed since); ``None`` where
    it cannot tell. A session started for a run asks it
    (:attr:`cdc_join.session.DeferredSession.work_bytes`)."""
    found = list_local_folders(config, _listing_since(storage, config))
    if found is None:
        return None
    return sum(f.size for f in _unlogged(storage, config, found))


def _unlogged(
    storage: Storage, config: PipelineConfig, found: Mapping[str, Sequence[LandedFile] | None]
) -> list[LandedFile]:
    """The listed landing files the ingest log does not name, or that changed since."""
    listed = {name: landing_files(files) for name, files in found.items()}
    done = logged_files(storage, config, listed)
    return [
        f
        for name, files in listed.items()
        for f in files
        if f.name not in done.get(name, {}) or _change(f, done[name][f.name])
    ]


def ingest_source(
    spark: SparkSession,
    storage: Storage,
    config: PipelineConfig,
    source_name: str,
    *,
    after_step: StepHook | None = None,
    done: Mapping[str, Logged] | None = None,
    listed: Sequence[LandedFile] | None = None,
    unread: Sequence[str] = (),
    missing: bool = False,
    progress: Callable[[str], None] | None = None,
    log: list[pa.Table] | None = None,
) -> IngestReport:
    """Ingest one source's landing files the ingest log does not name yet; its counts (zeros: none).

    Args:
        after_step: called with each name of :data:`STEPS` after that write; an exception it
            raises stops the ingest there (tests use it to simulate a crash).
        done: what the ingest log records of this source's files, when the caller has read it.
        listed: the source's landing files, when the caller has listed them (then ``unread``
            names the folder's other files, and ``missing`` says the folder does not exist).
        progress: called with a line before and after parsing new files (for long ingests).
        log: where the ingest log's rows are left for the caller (default: appended here).

    Raises:
        InputError: the source has no landing folder, a file it already ingested has changed,
            or its lines cannot be ingested as a whole (:func:`~cdc_join.landing.debezium.parse_events`).
    """
    started = time.monotonic()
    source = config.sources[source_name]
    if source.landing is None:
        raise InputError(f"source {source_name!r} has no landing folder to ingest")
    if listed is None:
        found = list_folder(spark, source.landing, _listing_since(storage, config))
        listed, unread, missing = landing_files(found), unread_files(found), found is None
    if done is None:
        done = logged_files(storage, config, {source_name: listed}).get(source_name, {})
    _fail_on_changed_files(source_name, listed, done)
    pending = [f for f in listed if f.name not in done]
    say = _Progress(source_name, progress if pending else None, started)
    say.before(pending)
    counts, reasons, unavailable, rule = (
        _ingest_files(spark, storage, config, source_name, pending, after_step, log)
        if pending
        else ({}, {}, {}, "")
    )
    total = FileCounts(*(sum(column) for column in zip(*(astuple(c) for c in counts.values()), strict=True)))
    say.after(total)
    return IngestReport(
        source_name,
        len(pending),
        *(total.lines, total.events, total.tombstones, total.quarantined),
        seconds=time.monotonic() - started,
        reasons=reasons,
        unavailable=unavailable,
        unread=tuple(unread),
        missing_folder=source.landing if missing else None,
        legacy_sequence=rule if rule in LEGACY_RULES.values() else None,
    )


@dataclass(frozen=True)
class _Progress:
    """The lines a long ingest prints before and after its files (``say`` None: none)."""

    source: str
    say: Callable[[str], None] | None
    started: float

    def before(self, pending: Sequence[LandedFile]) -> None:
        if self.say is not None:
            size = sum(f.size for f in pending) / 1e6
            self.say(f"  ingest {self.source}: {len(pending)} new file(s), {size:.1f} MB ...")

    def after(self, total: FileCounts) -> None:
        if self.say is not None:
            self.say(
                f"  ingest {self.source}: {total.events} events, {total.quarantined} quarantined, "
                f"{time.monotonic() - self.started:.1f}s"
            )


def _fail_on_changed_files(
    source_name: str, listed: Sequence[LandedFile], done: Mapping[str, Logged]
) -> None:
    changed = [(f, why) for f in listed if f.name in done for why in [_change(f, done[f.name])] if why]
    if not changed:
        return
    shown = ", ".join(f"{f.name} ({why})" for f, why in changed[:5])
    more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
    raise InputError(
        f"source {source_name!r}: landing file(s) changed after they were ingested: {shown}{more}. "
        "Landing files must not change once written: land new events in new files, and a changed "
        "file's content under a new name.",
        hint="move the changed file out of the landing folder (to take its new lines in, land them "
        "under a new name), then run again",
    )


def _change(file: LandedFile, logged: Logged) -> str | None:
    """How ``file`` differs from what the log recorded of it, or ``None`` when it doesn't.

    A different size is a change. With the same size, a moved modification time is one when
    the content's MD5 differs from the logged one, or when either can't be had (a file that
    is not on a local path, or a log row written before the log kept them).
    """
    if logged.size is not None and logged.size != file.size:
        return f"{logged.size} → {file.size} bytes"
    if logged.modified_ms is None or file.modified_ms is None or logged.modified_ms == file.modified_ms:
        return None
    md5 = _content_md5(file)
    if md5 is not None and md5 == logged.content_md5:
        return None  # copied again or touched: same content
    when = datetime.fromtimestamp(file.modified_ms / 1000, timezone.utc).isoformat(timespec="seconds")
    return f"same size, rewritten at {when}"


def _content_md5(file: LandedFile) -> str | None:
    """The MD5 of a local file's bytes; ``None`` for a file on another file system."""
    local = local_path(file.path)
    if local is None or not os.path.isfile(local):
        return None
    digest = hashlib.md5(usedforsecurity=False)
    with open(local, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _ingest_files(
    spark: SparkSession,
    storage: Storage,
    config: PipelineConfig,
    source_name: str,
    pending: Sequence[LandedFile],
    after_step: StepHook | None,
    log: list[pa.Table] | None,
) -> tuple[dict[str, FileCounts], dict[str, int], dict[str, int], str]:
    """Parse ``pending`` (one Spark job for the batch's schemas, one counting its lines and, for
    a batch under :data:`ONE_TASK_BYTES`, bringing them to the driver: see
    :mod:`cdc_join.landing.outcome`), then write them (a larger batch from Spark's cache);
    return the outcome counts per file, the quarantined lines per reason, per column the events
    holding Debezium's placeholder for a value it could not read, and the name of the sequence
    rule the events were ordered by ('' when no file could be read).

    A file Spark cannot read at all (a truncated gzip, say) fails the batch's job; then each
    file is tried alone, and those that fail are quarantined whole, with the reason, while the
    rest are ingested. Without that, the file would fail every later run without being named.
    """
    now = datetime.now(timezone.utc)
    try:
        outcome = _parse(spark, storage, config, source_name, pending, now)
    except StorageError:
        raise  # a table or the session failed, not a landing file (an unreachable server)
    except Exception as failure:
        unreadable = _unreadable(spark, pending)
        if not unreadable:
            raise
        _log.warning(
            "source %r: landing file(s) Spark cannot read: %s (%s)", source_name, unreadable, failure
        )
        readable = [f for f in pending if f.name not in unreadable]
        parsed = (
            _parse(spark, storage, config, source_name, readable, now)
            if readable
            else Outcome.nothing(spark, now)
        )
        outcome = parsed.with_unreadable(spark, source_name, unreadable)
    try:
        counts = _write_all(spark, storage, config, source_name, pending, outcome, after_step, log)
        return counts, outcome.reasons(), dict(outcome.unavailable), outcome.sequence_rule
    finally:
        outcome.release()


def _parse(
    spark: SparkSession,
    storage: Storage,
    config: PipelineConfig,
    source_name: str,
    files: Sequence[LandedFile],
    ingested_at: datetime,
) -> Outcome:
    bronze = config.bronze_path(source_name)
    known = _known_row(storage, bronze)
    lines = read_lines(spark, files)
    # A large batch is cached once parsed: the statistics job and the outcome's job then parse
    # each line once.
    large = text_bytes(files) >= ONE_TASK_BYTES
    try:
        parsed = parse_events(
            lines if large else lines.coalesce(1),
            config.sources[source_name],
            known,
            cache=large,
            recorded=recorded_sequence(storage, bronze) if known is not None else None,
        )
    except ConfigError as e:
        raise ConfigError(e.message, key=e.key, path=config.config_path, hint=e.hint) from None
    try:
        return Outcome.of(parsed, source_name, ingested_at, on_driver=not large)
    except BaseException:
        parsed.unpersist()
        raise


def _unreadable(spark: SparkSession, files: Sequence[LandedFile]) -> dict[str, str]:
    """The files Spark fails to read on their own, with the first line of why (a job per file:
    only done once a batch has failed)."""
    found = {}
    for file in files:
        try:
            spark.read.text(glob_escape(file.path), wholetext=True).selectExpr("length(value)").collect()
        except Exception as e:
            found[file.name] = _cause(e)
    return found


_JAVA_EXCEPTION = re.compile(
    r"^\s*(?:Caused by: )?((?:[a-z]\w*\.)+\w*(?:Exception|Error)(?::[^\n]*)?)$", re.M
)


def _cause(e: Exception) -> str:
    """The most specific line of a Spark failure: the last Java exception it names."""
    text = str(e)
    causes = _JAVA_EXCEPTION.findall(text)
    if causes:
        return causes[-1][:300]
    return text.strip().splitlines()[0][:300] if text.strip() else type(e).__name__


def _write_all(
    spark: SparkSession,
    storage: Storage,
    config: PipelineConfig,
    source_name: str,
    pending: Sequence[LandedFile],
    outcome: Outcome,
    after_step: StepHook | None,
    log: list[pa.Table] | None,
) -> dict[str, FileCounts]:
    """The three writes, in the order that makes a killed run safe to repeat (the ingest log's
    left in ``log`` when the caller appends it)."""
    _write_bronze(storage, config.bronze_path(source_name), source_name, outcome, pending)
    _after(after_step, "bronze")
    if outcome.quarantined:
        storage.create(config.quarantine_path, QUARANTINE_TABLE_SCHEMA, cdf=True)
        storage.merge(config.quarantine_path, outcome.quarantine, _QUARANTINE_MERGE)
    _after(after_step, "quarantine")
    rows = _log_rows(source_name, pending, outcome.counts, outcome.ingested_at)
    if log is not None:
        log.append(rows)
        return outcome.counts
    _write_log(spark, storage, config.ingest_log_path, [rows])
    _after(after_step, "log")
    return outcome.counts


def _after(hook: StepHook | None, step: str) -> None:
    if hook is not None:
        hook(step)


def _write_bronze(
    storage: Storage, path: str, source_name: str, outcome: Outcome, files: Sequence[LandedFile]
) -> None:
    """Insert the batch's events into bronze, exactly once per line.

    A batch none of whose files bronze holds a line of (the case of every batch but the rerun
    of one killed after this write) is appended, at the version checked: a racing ingest of the
    same files makes one of the two fail. Otherwise an insert-only MERGE on ``(_file, _line)``
    inserts the lines still missing. Which files bronze may hold is read from the statistics of
    its ``_file`` column: no Spark job unless a data file's range holds one of the names. (A
    MERGE costs delta-spark 15 Spark jobs whatever it inserts; a guarded append 4.)
    """
    if not outcome.event_count:
        return
    if not storage.exists(path):
        if not outcome.row_schema.fields:
            raise InputError(
                f"source {source_name!r}: the first events have no row columns to create bronze with "
                "(only truncates, or images holding only nulls)"
            )
        storage.create(path, outcome.event_schema, cdf=True)
    else:
        # New columns (nested ones too) are added and widened types widen before the write: a
        # MERGE would otherwise cast values back to the old type or fail on them.
        storage.evolve(path, outcome.event_schema)
    version = storage.version(path)
    if _holds_lines_of(storage, path, sorted(f.name for f in files), version):
        storage.merge(path, outcome.events, _BRONZE_MERGE)
        return
    rows = outcome.events
    target = storage.schema(path)
    if not conforms(rows.schema, target):
        # A small batch's rows on the driver are reshaped by Spark over them (no file read).
        rows = conform(frame_of(rows), target)
        if isinstance(outcome.events, ChangeSet):
            rows = materialize(rows)
    storage.append(path, rows, expected_version=version)


def _holds_lines_of(storage: Storage, path: str, names: Sequence[str], version: int) -> bool:
    """Whether bronze (at ``version``) holds a line of one of the files ``names`` (sorted)."""
    candidates = _files_that_may_hold(storage, path, "_file", names, version)
    if not candidates:
        return False
    found = storage.read_rows(path, "_file", names, version, candidates)
    if found is not None:
        return found.num_rows > 0
    rows = storage.read(path, version, candidates).filter(F.col("_file").isin(list(names)))
    return bool(rows.limit(1).count())


def _log_rows(
    source_name: str, pending: Sequence[LandedFile], counts: Mapping[str, FileCounts], ingested_at: datetime
) -> pa.Table:
    """The ingest log's row of each file read, including files without a single line."""
    rows = []
    for f in pending:
        c = counts.get(f.name, FileCounts())
        modified = (
            None if f.modified_ms is None else datetime.fromtimestamp(f.modified_ms / 1000, timezone.utc)
        )
        counts_of_file = (c.lines, c.events, c.quarantined, c.tombstones)
        rows.append((source_name, f.name, f.size, *counts_of_file, ingested_at, modified, _content_md5(f)))
    return pa.Table.from_pylist(
        [dict(zip(INGEST_LOG_SCHEMA.names, r, strict=True)) for r in rows],
        schema=arrow_schema(INGEST_LOG_SCHEMA),
    )


def _write_log(spark: SparkSession, storage: Storage, path: str, tables: Sequence[pa.Table]) -> None:
    """Append the ingest log's rows (of one or more sources) in one commit."""
    if not storage.create(path, INGEST_LOG_SCHEMA, cdf=True):
        storage.evolve(path, INGEST_LOG_SCHEMA)  # a log written before it kept modified_at, content_md5
    storage.append(path, from_arrow(spark, INGEST_LOG_SCHEMA, pa.concat_tables(tables)))


def _listing_since(storage: Storage, config: PipelineConfig) -> datetime | None:
    """With ``landing_lookback_hours``: the newest ``ingested_at`` of the ingest log (from its
    file statistics, no scan) minus the lookback; files modified before it are not listed."""
    hours = config.landing_lookback_hours
    if hours is None or not storage.exists(config.ingest_log_path):
        return None
    newest = [f.max_values.get("ingested_at") for f in storage.files(config.ingest_log_path)]
    if not newest or any(n is None for n in newest):
        return None
    latest = max(newest)
    if not isinstance(latest, datetime):
        return None
    return _utc(latest) - timedelta(hours=hours)


def beyond_lookback(
    spark: SparkSession,
    storage: Storage,
    config: PipelineConfig,
    found: Mapping[str, list[LandedFile] | None] | None = None,
) -> dict[str, list[str]]:
    """Per source, the landing files no run will ingest: not in the ingest log, and modified
    before ``landing_lookback_hours`` lets a run look (a file copied in with an old time).

    Lists every landing file (what the lookback spares a run), unless ``found`` holds the
    listings (see :func:`list_folders`); empty without a lookback.
    """
    since = _listing_since(storage, config)
    if since is None:
        return {}
    cutoff = since.timestamp() * 1000
    out = {}
    for name, source in config.sources.items():
        if source.landing is None:
            continue
        files = list_landing(spark, source.landing) if found is None else landing_files(found.get(name))
        old = [f for f in files if f.modified_ms is not None and f.modified_ms < cutoff]
        logged = logged_files(storage, config, {name: old}).get(name, {})
        missing = [f.name for f in old if f.name not in logged]
        if missing:
            out[name] = missing
    return out


def logged_files(
    storage: Storage, config: PipelineConfig, listed: Mapping[str, Sequence[LandedFile]]
) -> dict[str, dict[str, Logged]]:
    """Per source, what the ingest log records of the ``listed`` files.

    Only the log's data files whose ``file`` statistics range holds a listed name are read, so
    the read follows the listing, not every file ever ingested (the maintenance policy
    compacts the log and keeps those ranges narrow).
    """
    if not storage.exists(config.ingest_log_path) or not any(listed.values()):
        return {}
    names = sorted({f.name for files in listed.values() for f in files})
    wanted = _files_that_may_hold(storage, config.ingest_log_path, "file", names)
    if not wanted:
        return {}
    # Every column, then those this reads: a log written before it kept modified_at and
    # content_md5 has fewer (asking delta-spark for the schema first would take a Spark job).
    found = storage.read_arrow(config.ingest_log_path, files=wanted)
    columns = [c for c in ("source", "file", "size", "modified_at", "content_md5") if c in found.column_names]
    log = found.select(columns).to_pylist()
    keep = {(source, f.name) for source, files in listed.items() for f in files}
    done: dict[str, dict[str, Logged]] = {}
    for row in log:
        if (row["source"], row["file"]) in keep:
            modified = row.get("modified_at")
            done.setdefault(row["source"], {})[row["file"]] = Logged(
                row["size"], None if modified is None else _epoch_ms(modified), row.get("content_md5")
            )
    return done


def _files_that_may_hold(
    storage: Storage, path: str, column: str, names: Sequence[str], version: int | None = None
) -> list[str]:
    """The data files of ``path`` (at ``version``) whose ``column`` statistics range may hold one
    of the sorted ``names``: read from the table's file list, no Spark job."""
    return [
        f.path
        for f in storage.files(path, version)
        if f.num_records != 0 and _may_hold(names, f.min_values.get(column), f.max_values.get(column))
    ]


def _may_hold(names: Sequence[str], low: Any, high: Any) -> bool:
    """Whether a sorted ``names`` has one within ``[low, high]`` (unknown bounds: yes)."""
    if not isinstance(low, str) or not isinstance(high, str):
        return True
    at = bisect.bisect_left(names, low)
    return at < len(names) and names[at] <= high


def _utc(value: datetime) -> datetime:
    """A timestamp read back from a table (naive means UTC) as an aware one."""
    return value if value.tzinfo else value.replace(tzinfo=timezone.utc)


def _epoch_ms(value: datetime) -> int:
    return round(_utc(value).timestamp() * 1000)


def recorded_sequence(storage: Storage, bronze_path: str) -> tuple[str, ...] | None:
    """The sequence fields bronze's events were ordered by (the names in ``_seq_values`` of one
    of its rows), or ``None`` when it has no such row. Reads one column of its smallest file.

    Rows ingested since 2026-11-27 name every field of the rule. Older rows left out the fields
    their event lacked (a SQL Server snapshot row has no ``change_lsn``); the rule read from
    them is the one earlier versions read too, and kept ordering later batches by, so a lake
    goes on as it was (see the README's sequence defaults).
    """
    if "_seq_values" not in storage.schema(bronze_path).names:
        return None
    files = [f for f in storage.files(bronze_path) if f.num_records != 0]
    if not files:
        return None
    smallest = min(files, key=lambda f: f.size_bytes)
    values = storage.read_arrow(bronze_path, columns=["_seq_values"], files=[smallest.path]).column(0)
    valid = values.filter(pc.is_valid(values))
    return tuple(json.loads(valid[0].as_py())) if len(valid) else None


def _known_row(storage: Storage, bronze_path: str) -> StructType | None:
    if not storage.exists(bronze_path):
        return None
    schema = storage.schema(bronze_path)
    after = schema["_after"].dataType if "_after" in schema.names else None
    return after if isinstance(after, StructType) else None


def quarantined(
    storage: Storage, config: PipelineConfig, *, source: str | None = None, limit: int = 20
) -> list[dict[str, Any]]:
    """The newest quarantined lines (source, file, line, reason, raw text), at most ``limit``."""
    if not storage.exists(config.quarantine_path):
        return []
    rows = storage.read(config.quarantine_path)
    if source is not None:
        rows = rows.filter(F.col("source") == source)
    newest = rows.orderBy(F.col("_ingested_at").desc(), "_file", "_line").limit(limit)
    return [r.asDict() for r in newest.collect()]
