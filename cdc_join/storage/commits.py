"""What was committed to a pipeline's tables after its last completed run, read from their logs.

Rows do not say which attempt wrote them: two runs started from one checkpoint carry the same
run id, so the rows of a run that lost a race look like the winner's. The tables' Delta logs
tell them apart. The checkpoint records the version of every table a run writes as the
completed run left it (:attr:`cdc_join.checkpoint.Checkpoint.tables`), and every write of a run
records a note in its commit (the commit's user metadata):

- :func:`run_note`: a write of one run attempt (``cdc_join:run <attempt>``). Such a commit
  after the checkpoint's version was made by a run that did not commit: killed, beaten by
  another, or still going (:func:`unfinished_since`).
- :data:`REBUILD`: a state table rewritten from bronze by a full refresh. Rebuilt rows may hash
  differently from the rows the subscriptions were made for (a widened column type), so a
  rebuild that did not commit must be finished before any run reads the table
  (:func:`rebuilt_since`).
- :data:`COMPACTION`: maintenance rewriting a table with the rows it holds, like Delta's own
  OPTIMIZE: it changes no row a reader sees.

A commit without a note was made by another tool or by hand: ``verify`` compares what it wrote
like any other row. Reading the notes costs nothing when a table did not move since the
checkpoint (the common case); otherwise one read of the newer commits (local tables: their
commit files).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from cdc_join.storage import Storage
from cdc_join.storage.base import DATA_PRESERVING_OPERATIONS

#: The note of every write of a run (with the attempt's token after it).
RUN = "cdc_join:run"
#: The note of a state table's (or a subscription table's) rebuild from bronze.
REBUILD = "cdc_join:rebuild"
#: The note of maintenance's compaction of a state or subscription table.
COMPACTION = "cdc_join:compaction"
#: Commits that write no row: a table created empty, a metadata change.
_NO_ROWS = DATA_PRESERVING_OPERATIONS | {"CREATE TABLE"}


def run_note() -> str:
    """The note of one run attempt's writes: unique to the attempt."""
    return f"{RUN} {uuid.uuid4().hex}"


def since(storage: Storage, path: str, version: int | None) -> list[dict[str, Any]]:
    """The commits of the table at ``path`` after ``version`` (``None``: every commit), newest
    first; none when the table does not exist or did not move."""
    if not storage.exists(path):
        return []
    if version is None:
        return storage.history(path)
    limit = storage.version(path) - version
    if limit <= 0:
        return []
    entries = storage.history(path, limit)
    # More commits may have come since the version was read: read back to ``version``.
    while len(entries) == limit and int(entries[-1]["version"]) > version + 1:
        limit *= 2
        entries = storage.history(path, limit)
    return [e for e in entries if int(e["version"]) > version]


def noted(entry: Mapping[str, Any], note: str) -> bool:
    """Whether a commit carries ``note``."""
    return str(entry.get("userMetadata") or "").startswith(note)


def _by_a_run(entry: Mapping[str, Any]) -> bool:
    """Whether a commit is a run's write that may have changed rows."""
    writes = str(entry.get("operation") or "").upper() not in _NO_ROWS
    return writes and (noted(entry, RUN) or noted(entry, REBUILD))


def rebuilt_since(storage: Storage, path: str, version: int | None) -> bool:
    """Whether the table was rebuilt from bronze after ``version`` (a full refresh that did not
    commit: the next run finishes it)."""
    return any(noted(e, REBUILD) for e in since(storage, path, version))


def unfinished_since(storage: Storage, path: str, version: int | None) -> bool:
    """Whether a run that did not commit wrote rows to the table after ``version``."""
    return any(_by_a_run(e) for e in since(storage, path, version))


def appended_files(storage: Storage, path: str, version: int | None) -> list[str]:
    """The data files, of the snapshot ``storage`` reads, that runs which did not commit added
    after ``version`` (the checkpoint's): what a run that lost a race, or died, appended.

    A compaction rewrites the rows it finds into new files, so the files are those added since
    the newest compaction that no such commit precedes (maintenance does not compact a table
    holding an unfinished run's rows).
    """
    if version is None or not storage.exists(path):
        return []
    read = storage.version(path)
    entries = [e for e in since(storage, path, version) if int(e["version"]) <= read]
    if not any(_by_a_run(e) for e in entries):
        return []
    base = version
    for entry in sorted(entries, key=lambda e: int(e["version"])):
        if _by_a_run(entry):
            break
        if noted(entry, COMPACTION):
            base = int(entry["version"])
    before = {f.path for f in storage.files(path, base)}
    return [f.path for f in storage.files(path) if f.path not in before]
