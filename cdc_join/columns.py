"""Names of the columns cdc_join adds to its tables, and the properties it creates tables with.

The one low module every hop imports its shared names from; it imports no hop.

State tables (one per source) hold the source's row columns, then:

========================  ==================================================================
``_cdc_seq``              the event's sequence (:mod:`cdc_join.landing.debezium.sequence`)
``_cdc_file``             landing file of the event (ties of equal sequences: later file wins)
``_cdc_line``             line in that file (then later line wins)
``_cdc_op``               Debezium op of the event (``t`` for a row a truncate removed)
``_cdc_deleted``          the row is a tombstone
``_cdc_hash``             value hash of a live row (:mod:`cdc_join.join.hashing`)
``_cdc_ts_ms``            the event's ``ts_ms``
``_cdc_run``              the run that wrote the row
========================  ==================================================================

Subscription tables (one per join) hold ``fk_*`` and ``pk_*`` (the CombinedKey), then
``_lhs_hash``, ``_subscribed`` and ``_cdc_written`` (see :mod:`cdc_join.join.subscription`).
Silver holds the select columns, its merge key ``_pk_*``, lineage ``_seq_<alias>``,
``_run_id`` and ``_values_hash`` (:func:`cdc_join.join.hashing.values_hash` of the select columns).
"""

from __future__ import annotations

from cdc_join.config import JoinConfig, PipelineConfig, SourceConfig

# -- state tables ----------------------------------------------------------------------------
SEQ = "_cdc_seq"
FILE = "_cdc_file"
LINE = "_cdc_line"
OP = "_cdc_op"
DELETED = "_cdc_deleted"
HASH = "_cdc_hash"
TS_MS = "_cdc_ts_ms"
RUN = "_cdc_run"
STATE_METADATA = (SEQ, FILE, LINE, OP, DELETED, HASH, TS_MS, RUN)

# -- subscription tables ---------------------------------------------------------------------
LHS_HASH = "_lhs_hash"
SUBSCRIBED = "_subscribed"
WRITTEN = "_cdc_written"

# -- silver ----------------------------------------------------------------------------------
RUN_ID = "_run_id"
VALUES_HASH = "_values_hash"
ACTION = "_action"  # upsert | delete, on rows on their way into silver


def fk_columns(join: JoinConfig) -> list[str]:
    """The CombinedKey's foreign-key columns of a join's subscription table."""
    return [f"fk_{c}" for c in join.foreign_key]


def pk_columns(left: SourceConfig) -> list[str]:
    """The CombinedKey's primary-key columns (also the left key in responses and rows)."""
    return [f"pk_{c}" for c in left.primary_key]


def silver_key_columns(config: PipelineConfig) -> list[str]:
    """Silver's merge key: the left primary key as ``_pk_*`` columns."""
    return [f"_pk_{c}" for c in config.left_source.primary_key]


def output_columns(config: PipelineConfig) -> list[str]:
    """Silver's data columns, one per select entry."""
    return [name for name, _ in config.select]


def lineage_column(alias: str) -> str:
    """Silver's column holding the sequence of the ``alias`` row a silver row was built from."""
    return f"_seq_{alias}"


# -- table properties ------------------------------------------------------------------------
TARGET_FILE_SIZE_PROPERTY = "delta.targetFileSize"
CHANGE_DATA_FEED_PROPERTY = "delta.enableChangeDataFeed"
#: Subscription tables: small files, so fk lookups read little.
SUBSCRIPTION_TARGET_FILE_SIZE = 16 * 1024
#: State and silver tables: rewritten files stay small enough that a MERGE touching a few keys
#: rewrites little, large enough that a big table keeps its file count in the hundreds.
TABLE_TARGET_FILE_SIZE = 8 * 1024 * 1024


def target_file_size(kind: str) -> int:
    """Target data file size of a table of ``kind`` (``subscription``, ``state``, ``silver``)."""
    return SUBSCRIPTION_TARGET_FILE_SIZE if kind == "subscription" else TABLE_TARGET_FILE_SIZE


def table_properties(kind: str) -> dict[str, str]:
    """Properties for a new table of ``kind``: its target file size."""
    return {TARGET_FILE_SIZE_PROPERTY: str(target_file_size(kind))}
