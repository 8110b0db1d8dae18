"""Debezium change events (JSON lines) → typed change rows (the bronze contract) and quarantine.

The parser is split by concern:

- :mod:`~cdc_join.landing.debezium.envelope`: envelopes, ops, tombstones, quarantine reasons, and the
  one driver round trip per batch (:func:`parse_events`);
- :mod:`~cdc_join.landing.debezium.sequence`: which event of a key is newest, per connector;
- :mod:`~cdc_join.landing.debezium.types`: Spark types of row images, inference and type widening;
- :mod:`~cdc_join.landing.debezium.decode`: JSON and Kafka Connect values → typed columns;
- :mod:`~cdc_join.landing.debezium.sql`: the SQL text helpers the stages are built from.
"""

from cdc_join.landing.debezium.envelope import (
    EVENT_COLUMNS,
    OPS,
    QUARANTINE_SCHEMA,
    UPSERT_OPS,
    ParsedBatch,
    parse_events,
)
from cdc_join.landing.debezium.sequence import SEQ_SEPARATOR, SequenceRule, sequence_rule
from cdc_join.landing.debezium.types import connect_type, merge_row_types
from cdc_join.schemas import widens_to, wider_type

__all__ = [
    "EVENT_COLUMNS",
    "OPS",
    "QUARANTINE_SCHEMA",
    "SEQ_SEPARATOR",
    "UPSERT_OPS",
    "ParsedBatch",
    "SequenceRule",
    "connect_type",
    "merge_row_types",
    "parse_events",
    "sequence_rule",
    "widens_to",
    "wider_type",
]
