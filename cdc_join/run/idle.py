"""A run with nothing to do: seen without Spark, ended before a session starts.

Most scheduled runs find nothing new. A run (``--plan auto`` or ``incremental``) has nothing to
do when, as it starts:

1. no landing folder holds a file the ingest log does not name, nor one changed since it was
   read (:func:`cdc_join.landing.ingest.nothing_landed`: local folders, listed directly);
2. every source's bronze table is at the version the last completed run applied: nothing
   another tool wrote, nothing an ingest left unjoined;
3. every table a run writes (state, subscriptions, silver) is at the version the last
   completed run left it: no run stopped after a write, no full refresh half done;
4. silver's definition (:func:`cdc_join.silver.table.redefined`, whose row types are those of
   the same bronze versions) and the settings every run applies
   (:func:`cdc_join.checkpoint.settings`) are those of the last completed run.

Then the run ends with a report that says so and writes nothing, not even a run-log row: the
lake is as it was and the last run's checkpoint stands. Every read here is of a table's log or
of small files the log names, which both backends do without Spark for local tables; the
session is started only when one is needed (:class:`cdc_join.session.DeferredSession`), so such
a run starts no JVM. A landing folder that is not local makes it an ordinary run.
"""

from __future__ import annotations

from collections.abc import Mapping

from cdc_join.checkpoint import settings
from cdc_join.config import PipelineConfig
from cdc_join.landing.ingest import IngestReport, nothing_landed
from cdc_join.run.runlog import RunStart
from cdc_join.silver import table as silver
from cdc_join.storage import Storage

#: The plans a run with nothing to do may skip (a forced recompute recomputes).
PLANS = ("auto", "incremental")


def nothing_to_do(
    storage: Storage, config: PipelineConfig, begin: RunStart, ingest: bool
) -> tuple[str, Mapping[str, IngestReport]] | None:
    """Why the run has nothing to do (module docstring) and what its ingest found (no files,
    its warnings), or ``None`` when it may have something to do.

    Args:
        begin: what the run saw as it started (:func:`cdc_join.run.runlog.start`).
        ingest: whether the run ingests (``False``: another tool fills bronze).
    """
    previous = begin.checkpoint
    if previous.run_id == 0 or config.left not in previous.state_versions:
        return None
    if previous.settings != settings(config):
        return None
    if silver.restated(previous.silver, config) or silver.redefined(previous.silver, config):
        return None
    if any(begin.tables.get(path) != previous.tables.get(path) for path in begin.tables):
        return None
    for name in config.sources:
        path = config.bronze_path(name)
        applied = previous.bronze_versions.get(name)
        if applied is None or not storage.exists(path) or storage.version(path) != applied:
            return None
    landed = nothing_landed(storage, config) if ingest else {}
    if landed is None:
        return None
    what = "no new landing files, " if ingest else ""
    return f"{what}every table as run {previous.run_id} left it", landed
