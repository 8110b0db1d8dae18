"""A run's start and commit: the run log's version it expects, its lock.

A run commits its run-log row last (:func:`commit_run`): the row records the checkpoint
(:mod:`cdc_join.checkpoint`). A run killed before that commit leaves the previous checkpoint in
place, so the rerun reprocesses the same changes through idempotent writes and ends where an
uninterrupted run would have.

Two runs of one pipeline (incremental runs, a full refresh, ``verify --repair``) exclude each
other through the run log itself: a run notes the log's version when it starts
(:func:`start`), and its commit succeeds only if the log is still at that version. Delta's
optimistic concurrency makes that check and the commit one atomic step on every storage,
object stores included. The loser fails with :class:`~cdc_join.errors.ConcurrentRunError`; its
work is redone by the next run. Silver is guarded the same way, so a slower run never
overwrites newer rows. A lock file next to local lakes only makes a second run on the same
machine fail early.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa

from cdc_join.changeset import arrow_schema, from_arrow
from cdc_join.checkpoint import RUNS_SCHEMA, Checkpoint, last_checkpoint
from cdc_join.config import PipelineConfig
from cdc_join.errors import ConcurrentRunError
from cdc_join.run.fence import versions_of
from cdc_join.storage import Storage


@dataclass(frozen=True)
class RunStart:
    """What a run saw when it started: the checkpoint, the run log's version its commit
    expects, and the version of every table it may write (see :mod:`cdc_join.run.fence`)."""

    checkpoint: Checkpoint
    log_version: int
    silver_version: int | None
    tables: Mapping[str, int | None] = field(default_factory=dict)


def written_tables(config: PipelineConfig) -> list[str]:
    """The tables a run writes besides bronze and its logs: every source's state, every join's
    subscriptions, then silver (last)."""
    return [
        *(config.state_path(name) for name in config.sources),
        *(config.subscription_path(join) for join in config.joins),
        config.silver_path,
    ]


def start(storage: Storage, config: PipelineConfig) -> RunStart:
    """The last checkpoint, the run log's version and the versions of the tables the run may
    write, noted at a run's start."""
    storage.create(config.runs_path, RUNS_SCHEMA, cdf=False)
    log_version = storage.version(config.runs_path)
    # Read after the log's version: a run that commits in between makes this run's commit fail.
    tables = versions_of(storage, written_tables(config))
    return RunStart(last_checkpoint(storage, config), log_version, tables[config.silver_path], tables)


def commit_run(
    storage: Storage,
    config: PipelineConfig,
    checkpoint: Checkpoint,
    kind: str,
    started_at: datetime,
    report: Mapping[str, Any],
    expected_version: int | None = None,
) -> None:
    """Append the run's row — report and checkpoint in one commit, the run's last write.

    With ``expected_version`` (from :func:`start`) the commit fails with
    :class:`~cdc_join.errors.ConcurrentRunError` if another run committed since.
    """
    finished = datetime.now(timezone.utc)
    row = (
        checkpoint.run_id,
        kind,
        started_at,
        finished,
        f"{(finished - started_at).total_seconds():.3f}",
        checkpoint.to_json(),
        json.dumps(report, sort_keys=True, default=str),
    )
    storage.create(config.runs_path, RUNS_SCHEMA, cdf=False)
    try:
        # Rows built on the driver as Arrow: the backend writes them without a Spark job.
        table = pa.Table.from_pylist(
            [dict(zip(RUNS_SCHEMA.names, row, strict=True))], arrow_schema(RUNS_SCHEMA)
        )
        storage.append(
            config.runs_path,
            from_arrow(storage.spark, RUNS_SCHEMA, table),
            expected_version=expected_version,
        )
    except ConcurrentRunError as exc:
        raise ConcurrentRunError(
            f"another run of pipeline {config.name!r} committed while this one worked; this run's "
            "work is left for the next run to redo"
        ) from exc


@contextlib.contextmanager
def run_lock(config: PipelineConfig) -> Iterator[None]:
    """Hold the pipeline's lock for the duration of a run; a second run fails fast.

    The lock is a file created with O_EXCL under the pipeline's internal folder (local lakes),
    an early failure for two runs on one machine. A lock left by a process that no longer
    exists on this host is taken over, and so is one whose owner was never written (after
    :data:`UNKNOWN_OWNER_STALE_S`) or that another host took (after :data:`OTHER_HOST_STALE_S`).
    What keeps runs apart everywhere (object stores, other hosts) is the run log's expected
    version (see the module docstring).
    """
    path = config.lock_path
    if path is None:
        yield
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    _acquire(path)
    _HELD.add(path)
    try:
        yield
    finally:
        _HELD.discard(path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _acquire(path: str) -> None:
    owner = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _holder(path)
            if _is_stale(path, holder):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                continue
            raise ConcurrentRunError(
                f"another run of this pipeline holds {path} ({_describe(holder)}); "
                "wait for it to finish, or delete the file if that process is gone"
            ) from None
        with os.fdopen(fd, "w") as f:
            json.dump(owner, f)
        return
    raise ConcurrentRunError(f"could not take the lock {path}")


def _holder(path: str) -> dict[str, Any] | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


#: Lock files this process holds (a second run in another thread must not take them over).
_HELD: set[str] = set()
#: A lock file holding no owner this long after it was made was left by a process killed
#: between creating it and writing to it.
UNKNOWN_OWNER_STALE_S = 60.0
#: A lock taken on another host (a job cluster since gone, with the lake on a shared mount) is
#: honoured this long; the run log's expected version still keeps two runs from both committing.
OTHER_HOST_STALE_S = 6 * 3600.0


def _is_stale(path: str, holder: Mapping[str, Any] | None) -> bool:
    """Whether a lock file was left by a run that is gone and may be taken over."""
    now = time.time()
    if holder is None:
        try:
            return now - os.path.getmtime(path) > UNKNOWN_OWNER_STALE_S
        except OSError:
            return True  # removed meanwhile
    if holder.get("host") != socket.gethostname():
        return now - float(holder.get("since") or 0) > OTHER_HOST_STALE_S
    try:
        pid = int(holder["pid"])
        if pid == os.getpid():  # ours, unless a restarted container got its predecessor's pid
            return path not in _HELD
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, KeyError, ValueError, TypeError):
        return False
    return False


def _describe(holder: Mapping[str, Any] | None) -> str:
    if holder is None:
        return "owner unknown"
    since = datetime.fromtimestamp(float(holder.get("since", 0)), timezone.utc).isoformat(timespec="seconds")
    return f"pid {holder.get('pid')} on {holder.get('host')} since {since}"
