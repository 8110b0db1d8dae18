"""Landing folders: which files a run reads, and their lines as Spark rows.

A source's landing folder and its subfolders hold its events as JSON lines: ``*.json``,
``*.jsonl``, gzipped as ``*.json.gz``, ``*.jsonl.gz``. A name starting with ``_``, ``.`` or
``+``, file or folder, is still being written (e.g. Kafka Connect's ``+tmp``) and is left for a
later run; files with other name endings are not read, and each run that lists them names them
in a warning (:func:`landing_warnings`), so nothing is skipped in silence. A local folder is
listed directly (no Spark job), any other location through Spark's ``binaryFile`` source.
Lines are read with Spark's text reader, large batches in splits (:data:`SPLIT_READ_BYTES`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone

from pyspark.errors import AnalysisException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from cdc_join.config import PipelineConfig
from cdc_join.locations import URI_SCHEME, glob_escape, local_path
from cdc_join.schemas import sql_string as lit

_LANDING_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz")


#: First characters of files and folders still being written.
_IN_PROGRESS = ("_", ".", "+")


#: A batch of landing files this large or larger is read in splits by several tasks; a smaller
#: one a file per task (fewer Spark jobs, which is most of a small batch's cost).
SPLIT_READ_BYTES = 32 * 1024 * 1024

#: How many bytes of text a gzipped landing file is taken to hold per byte of its size: a
#: Debezium event's JSON compresses about tenfold (8 times without its schema, 10 to 20 with).
GZIP_RATIO = 10


def folder_warnings(source: str, missing_folder: str | None, unread: Sequence[str]) -> list[str]:
    """What to say about a source's landing folder that is missing, or holds files no run reads."""
    found = []
    if missing_folder is not None:
        found.append(
            f"source {source!r}: its landing folder {missing_folder} does not exist (yet), "
            "so nothing was ingested from it; check the source's 'landing' path if events should be there"
        )
    if unread:
        more = len(unread) - 5
        shown = ", ".join(unread[:5]) + (f" and {more} more" if more > 0 else "")
        found.append(
            f"source {source!r}: {len(unread)} file(s) in its landing folder are not read, as "
            f"their names do not end in .json, .jsonl, .json.gz or .jsonl.gz: {shown}. Land their "
            "events again under such a name, or move the files out of the folder"
        )
    return found


def list_folders(
    spark: SparkSession, config: PipelineConfig, modified_after: datetime | None = None
) -> dict[str, list[LandedFile] | None]:
    """Per source with a landing folder, every file in it, or only those modified after
    ``modified_after`` (``None``: the folder is not there)."""
    return {
        name: list_folder(spark, source.landing, modified_after)
        for name, source in config.sources.items()
        if source.landing is not None
    }


def list_local_folders(
    config: PipelineConfig, modified_after: datetime | None = None
) -> dict[str, list[LandedFile] | None] | None:
    """:func:`list_folders` without Spark: ``None`` unless every landing folder is local."""
    local = {name: local_path(s.landing) for name, s in config.sources.items() if s.landing is not None}
    if any(path is None for path in local.values()):
        return None
    return {name: _list_local(path, modified_after) for name, path in local.items() if path is not None}


def landing_warnings(config: PipelineConfig, found: Mapping[str, list[LandedFile] | None]) -> list[str]:
    """What a run would say about the landing folders listed in ``found`` (see
    :func:`list_folders`): a missing folder, files no run reads."""
    return [
        warning
        for name, files in found.items()
        for warning in folder_warnings(
            name, config.sources[name].landing if files is None else None, unread_files(files)
        )
    ]


@dataclass(frozen=True)
class LandedFile:
    """A landing file: its name inside the folder, the path Spark reads, its size in bytes and
    its modification time (ms since the epoch, when the file system gives one)."""

    name: str
    path: str
    size: int
    modified_ms: int | None = None


def list_landing(
    spark: SparkSession, folder: str, *, modified_after: datetime | None = None
) -> list[LandedFile]:
    """The landing files in ``folder`` and its subfolders, by name (their path inside it).

    A local folder is listed directly (no Spark job); any other location through Spark (the
    ``binaryFile`` source, content not read), so every file system Spark can read works. With
    ``modified_after``, files modified before it are left out.
    """
    return landing_files(list_folder(spark, folder, modified_after))


def list_folder(spark: SparkSession, folder: str, modified_after: datetime | None) -> list[LandedFile] | None:
    """Every file in ``folder`` and its subfolders that is not still being written, by name:
    the landing files and the files a run does not read (other name endings). ``None`` when
    the folder does not exist (yet)."""
    local = local_path(folder)
    if local is not None:
        return _list_local(local, modified_after)
    reader = spark.read.format("binaryFile").option("recursiveFileLookup", "true")
    if modified_after is not None:
        at = modified_after.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
        reader = reader.option("modifiedAfter", at).option("timeZone", "UTC")
    try:
        found = (
            reader.load(glob_escape(folder.rstrip("/")))
            .select("path", "length", (F.unix_micros("modificationTime") // 1000).alias("modified_ms"))
            .collect()
        )
    except AnalysisException as exc:
        if "PATH_NOT_FOUND" in str(exc.getCondition() or exc):
            return None  # the folder is not there (yet)
        raise
    key = _folder_key(folder)
    files = []
    for r in found:
        path = str(r["path"])
        at = path.find(key)
        name = path[at + len(key) :] if at >= 0 else path.rsplit("/", 1)[-1]
        files.append(LandedFile(name, path, int(r["length"]), r["modified_ms"]))
    return sorted((f for f in files if not _in_progress(f.name)), key=lambda f: f.name)


def _folder_key(folder: str) -> str:
    """What every path under ``folder`` contains right before the file's name in it: the
    folder without scheme and leading slashes, with a trailing slash."""
    return URI_SCHEME.sub("", folder).strip("/") + "/"


def _list_local(folder: str, modified_after: datetime | None = None) -> list[LandedFile] | None:
    root = os.path.abspath(folder)
    if not os.path.isdir(root):
        return None  # the folder is not there (yet)
    after_ns = None if modified_after is None else int(modified_after.timestamp() * 1e9)
    files = []
    for parent, folders, names in os.walk(root):
        folders[:] = [d for d in folders if not d.startswith(_IN_PROGRESS)]
        for name in names:
            path = os.path.join(parent, name)
            if not os.path.isfile(path):
                continue
            stat = os.stat(path)
            if after_ns is not None and stat.st_mtime_ns < after_ns:
                continue
            relative = os.path.relpath(path, root).replace(os.sep, "/")
            # The form Spark's own listing gives (``file:`` plus the absolute path, not URI-encoded).
            modified_ms = stat.st_mtime_ns // 1_000_000
            files.append(LandedFile(relative, "file:" + path, stat.st_size, modified_ms))
    return sorted((f for f in files if not _in_progress(f.name)), key=lambda f: f.name)


def landing_files(found: Sequence[LandedFile] | None) -> list[LandedFile]:
    """The files of a folder's listing that a run reads, by their names."""
    return [f for f in found or [] if f.name.endswith(_LANDING_SUFFIXES)]


def unread_files(found: Sequence[LandedFile] | None) -> list[str]:
    """The names of ``found`` a run does not read, bar empty files (such as the ``_$folder$``
    markers some object-store clients write): nothing in them is left out."""
    return [f.name for f in found or [] if not f.name.endswith(_LANDING_SUFFIXES) and f.size > 0]


def _in_progress(name: str) -> bool:
    return any(part.startswith(_IN_PROGRESS) for part in name.split("/"))


def text_bytes(files: Sequence[LandedFile]) -> int:
    """About how many bytes of text ``files`` hold (a gzipped file :data:`GZIP_RATIO` times its size)."""
    return sum(f.size * (GZIP_RATIO if f.name.endswith(".gz") else 1) for f in files)


def read_lines(spark: SparkSession, files: Sequence[LandedFile]) -> DataFrame:
    """The lines of ``files`` as ``_file, _line (1-based), value``.

    Lines end at ``\\n`` only (a ``\\r`` before it and a leading byte-order mark are dropped);
    the empty string after a final newline is not a line. A batch of under
    :data:`SPLIT_READ_BYTES` of text (:func:`text_bytes`: a gzipped file counts for what it
    unpacks to) is read a file per row and split into lines (fewest Spark jobs: a small batch's
    cost is its jobs); a larger one is read line by line, in splits by several tasks.
    """
    # _metadata.file_path is URL-encoded; '+' stays literal in it, so protect it from decoding.
    # A file's name is its path after its landing folder's (files of several folders may come).
    path = "try_url_decode(replace(_metadata.file_path, '+', '%2B'))"
    prefixes = sorted({f.path[: len(f.path) - len(f.name)] for f in files if f.path.endswith(f.name)})
    keys = [lit(_folder_key(p)) for p in prefixes]
    cases = " ".join(
        f"WHEN instr(__path, {k}) > 0 THEN substr(__path, instr(__path, {k}) + length({k}))" for k in keys
    )
    name = f"CASE {cases} ELSE regexp_extract(__path, '[^/]*$', 0) END" if cases else "__name"
    paths = [glob_escape(f.path) for f in files]
    if text_bytes(files) < SPLIT_READ_BYTES:
        numbered = _whole_files(spark, paths, path)
    else:
        numbered = _in_splits(spark, paths, path)
    return numbered.selectExpr(f"{name} AS _file", "_line", f"{_without_bom_and_cr('value')} AS value")


#: Characters before which (at the end of a line) Java's ``$`` also matches.
_LINE_TERMINATORS = ("\r", "\u0085", "\u2028", "\u2029")


def _without_bom_and_cr(value: str) -> str:
    """``value`` without a leading byte-order mark (it would make the line invalid JSON) and a
    ``\\r`` at its end (left by CRLF endings); ``value`` holds no ``\\n`` (lines end there).

    The regular expression runs only on lines it can change: one that starts with ``{`` (every
    event), ends in no line terminator and is valid UTF-8 has no byte-order mark and no ``\\r``
    that ``\\r$`` matches. Run on every 480-byte line of a large batch it cost 1.8 s of 226 MB.
    A line with malformed UTF-8 still takes it: the replace decodes the line, so each malformed
    sequence becomes U+FFFD, as in a file read whole and split.
    """
    # The characters themselves, not escapes: an escape reads otherwise with
    # spark.sql.parser.escapedStringLiterals on (see cdc_join.schemas.sql_string).
    replaced = f"regexp_replace({value}, {lit('^' + chr(0xFEFF) + '|' + chr(13) + '$')}, '')"
    ends = " OR ".join(f"endswith({value}, {lit(c)})" for c in _LINE_TERMINATORS)
    kept = f"startswith({value}, '{{') AND NOT ({ends}) AND is_valid_utf8({value})"
    return f"CASE WHEN {kept} THEN {value} ELSE {replaced} END"


def _whole_files(spark: SparkSession, paths: list[str], path: str) -> DataFrame:
    """Each file read as one row and split on ``\\n``: exact numbers, one task per file."""
    pieces = f"split(value, {lit(chr(10))}, -1)"
    without_last = f"slice({pieces}, 1, size({pieces}) - 1)"
    kept = f"CASE WHEN element_at({pieces}, -1) = '' THEN {without_last} ELSE {pieces} END"
    text = spark.read.text(paths, wholetext=True)
    text = text.selectExpr("value", f"{path} AS __path", "_metadata.file_name AS __name")
    exploded = text.selectExpr("__path", "__name", f"posexplode({kept}) AS (pos, value)")
    return exploded.selectExpr("__path", "__name", "CAST(pos + 1 AS BIGINT) AS _line", "value")


def _in_splits(spark: SparkSession, paths: list[str], path: str) -> DataFrame:
    """Files read in splits by several tasks, lines still numbered exactly.

    A split's lines come in file order within one task, so a line's number is the count of
    lines in its file's earlier splits plus its place in its own split. Those counts are one
    small aggregate per split, broadcast back: no shuffle of the lines, nothing collected.
    """
    text = spark.read.option("lineSep", "\n").text(paths)
    # monotonically_increasing_id counts up within a task in read order; both reads of the
    # scan below plan the same splits, so they give every line the same id.
    located = text.selectExpr(
        "value",
        f"{path} AS __path",
        "_metadata.file_name AS __name",
        "_metadata.file_block_start AS __block",
        "monotonically_increasing_id() AS __id",
    )
    splits = located.groupBy("__path", "__block").agg(
        F.count(F.lit(1)).alias("__n"), F.min("__id").alias("__first")
    )
    earlier = (
        "sum(__n) OVER (PARTITION BY __path ORDER BY __block "
        "ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING)"
    )
    splits = splits.selectExpr("__path", "__block", "__first", f"coalesce({earlier}, 0) AS __before")
    numbered = located.join(F.broadcast(splits), ["__path", "__block"])
    return numbered.selectExpr("__path", "__name", "__before + (__id - __first) + 1 AS _line", "value")
