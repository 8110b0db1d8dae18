"""A run's view of the tables it writes: the versions it started from, and its writes on them.

Two runs of a pipeline may overlap (a scheduler retrying, a full refresh started beside the
hourly run, object stores where no lock file keeps them apart). What keeps them from damaging
each other is that every write of a run names the version the run read, so that of two runs
that both wrote a table, the second one's write fails before it lands:

- When a run starts (:func:`cdc_join.run.runlog.start`) it notes the version of every table it may
  write: each source's state table, each join's subscription table, silver.
- :class:`Fenced` wraps the run's storage. Reads of those tables see that version, plus the
  run's own writes; every write on them commits only if the table is still at the version the
  run last saw (the backend's ``expected_version``), and moves that version on. A write whose
  caller read another version fails at once.
- The checkpoint the run commits records these versions (:meth:`Fenced.versions`), so the next
  run reads "the tables as of the last completed run" by time travel to them, whatever a run
  that lost or died wrote after them.

So a run that lost a race stops with :class:`~cdc_join.errors.ConcurrentRunError` at its first
write on a table the winner wrote, and everything it wrote before that is on tables the winner
did not write, which the next run reads past (rows of state tables are true events; silver and
subscriptions are recomputed for every key whose state changed since the checkpoint).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import pyarrow as pa
from pyspark.sql import DataFrame
from pyspark.sql.types import StructType

from cdc_join.changeset import Rows
from cdc_join.errors import ConcurrentRunError
from cdc_join.storage import MergeSpec, Storage, WriteMetrics
from cdc_join.storage.base import FileStats


def versions_of(storage: Storage, paths: Iterable[str]) -> dict[str, int | None]:
    """The latest version of each table (``None`` where there is none yet)."""
    return {path: storage.version(path) if storage.exists(path) else None for path in paths}


class Fenced:
    """The storage of one run, fenced at the versions it started from (see the module docstring).

    Args:
        storage: the backend.
        versions: per table path the run writes, its version when the run started (``None``:
            no table yet). Other paths pass through unchanged.
        note: what every write of the run records in its commit (the attempt's
            :func:`cdc_join.storage.commits.run_note`), unless the write gives its own.
    """

    def __init__(self, storage: Storage, versions: Mapping[str, int | None], note: str | None = None) -> None:
        self.inner = storage
        self.name = storage.name
        self.spark = storage.spark
        self.note = note
        self._seen: dict[str, int | None] = dict(versions)

    def versions(self) -> dict[str, int | None]:
        """What the run has seen of each fenced table: its start version, or its own last write."""
        return dict(self._seen)

    def tables(self) -> dict[str, int]:
        """:meth:`versions` of the tables there are, for the checkpoint."""
        return {path: version for path, version in self._seen.items() if version is not None}

    def seen(self, path: str) -> int | None:
        """The version of a fenced table the run reads (``None``: the run saw no table)."""
        return self._seen[path]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    # ------------------------------------------------------------------ reads: at the run's version

    def _at(self, path: str, version: int | None) -> int | None:
        if version is not None or path not in self._seen:
            return version
        return self._seen[path]

    def exists(self, path: str) -> bool:
        if path in self._seen:
            return self._seen[path] is not None
        return self.inner.exists(path)

    def version(self, path: str) -> int:
        seen = self._seen.get(path)
        return seen if seen is not None else self.inner.version(path)

    def schema(self, path: str) -> StructType:
        return self.inner.schema(path)

    def read(self, path: str, version: int | None = None, files: Sequence[str] | None = None) -> DataFrame:
        return self.inner.read(path, self._at(path, version), files)

    def read_rows(
        self,
        path: str,
        column: str,
        values: Sequence[Any],
        version: int | None = None,
        files: Sequence[str] | None = None,
        *,
        columns: Sequence[str] | None = None,
    ) -> pa.Table | None:
        return self.inner.read_rows(path, column, values, self._at(path, version), files, columns=columns)

    def files(self, path: str, version: int | None = None) -> list[FileStats]:
        return self.inner.files(path, self._at(path, version))

    # ------------------------------------------------------------------ writes: compare and set

    def _expected(self, path: str, given: int | None) -> int | None:
        """The version a write on ``path`` must find: the run's, which a caller's must equal."""
        if path not in self._seen:
            return given
        seen = self._seen[path]
        if seen is None:
            raise ConcurrentRunError(f"the table at {path} did not exist when this run started")
        if given is not None and given != seen:
            raise ConcurrentRunError(
                f"the Delta table at {path} moved past version {seen} while this run worked: "
                "another writer committed to it first"
            )
        return seen

    def _wrote(self, path: str, metrics: WriteMetrics) -> WriteMetrics:
        if path in self._seen:
            self._seen[path] = metrics.version
        return metrics

    def create(
        self,
        path: str,
        schema: StructType,
        *,
        cdf: bool = True,
        properties: Mapping[str, str] | None = None,
    ) -> bool:
        if path not in self._seen:
            return self.inner.create(path, schema, cdf=cdf, properties=properties)
        if self._seen[path] is not None:
            return False
        if not self.inner.create(path, schema, cdf=cdf, properties=properties):
            raise ConcurrentRunError(f"the table at {path} was created by another run while this one worked")
        self._seen[path] = 0
        return True

    def evolve(self, path: str, schema: StructType) -> bool:
        return self._metadata(path, lambda: self.inner.evolve(path, schema))

    def set_properties(self, path: str, properties: Mapping[str, str]) -> bool:
        return self._metadata(path, lambda: self.inner.set_properties(path, properties))

    def _metadata(self, path: str, change: Callable[[], bool]) -> bool:
        """A metadata change (schema, properties) of a table still at the run's version."""
        expected = self._expected(path, None)
        if expected is not None and self.inner.version(path) != expected:
            raise ConcurrentRunError(
                f"the Delta table at {path} moved past version {expected} while this run worked: "
                "another writer committed to it first"
            )
        changed = change()
        if changed and path in self._seen:
            self._seen[path] = self.inner.version(path)
        return changed

    def append(
        self,
        path: str,
        df: Rows,
        *,
        merge_schema: bool = False,
        expected_version: int | None = None,
        note: str | None = None,
    ) -> WriteMetrics:
        expected = self._expected(path, expected_version)
        written = self.inner.append(
            path, df, merge_schema=merge_schema, expected_version=expected, note=note or self.note
        )
        return self._wrote(path, written)

    def overwrite(
        self,
        path: str,
        df: Rows,
        *,
        expected_version: int | None = None,
        replace_schema: bool = False,
        note: str | None = None,
    ) -> WriteMetrics:
        expected = self._expected(path, expected_version)
        written = self.inner.overwrite(
            path, df, expected_version=expected, replace_schema=replace_schema, note=note or self.note
        )
        return self._wrote(path, written)

    def replace_keys(
        self,
        path: str,
        rows: Rows,
        columns: Sequence[str],
        keys: pa.Table,
        *,
        expected_version: int | None = None,
        note: str | None = None,
    ) -> WriteMetrics:
        expected = self._expected(path, expected_version)
        written = self.inner.replace_keys(
            path, rows, columns, keys, expected_version=expected, note=note or self.note
        )
        return self._wrote(path, written)

    def merge(
        self,
        path: str,
        source: Rows,
        spec: MergeSpec,
        *,
        expected_version: int | None = None,
        note: str | None = None,
    ) -> WriteMetrics:
        expected = self._expected(path, expected_version)
        written = self.inner.merge(path, source, spec, expected_version=expected, note=note or self.note)
        return self._wrote(path, written)
