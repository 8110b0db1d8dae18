"""Rows on the driver as one Parquet data file of a Delta table (cdc_join.storage.arrow_files):
the statistics Delta records for it, and the tables that take no such file. No Spark here;
tests/unit/storage/test_delta_txn.py adds such files to Delta tables on Spark."""

from __future__ import annotations

import datetime as dt
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cdc_join.storage import arrow_files

PLAIN = {"minReaderVersion": 3, "minWriterVersion": 7, "writerFeatures": ["deletionVectors", "invariants"]}


def _metadata(fields: list[dict], **extra) -> dict:
    schema = {"type": "struct", "fields": fields}
    return {"partitionColumns": [], "configuration": {}, "schemaString": json.dumps(schema), **extra}


def _field(name: str, kind, nullable: bool = True, metadata: dict | None = None) -> dict:
    return {"name": name, "type": kind, "nullable": nullable, "metadata": metadata or {}}


def test_stats_bound_integers_dates_and_strings_and_count_every_column_s_nulls():
    long_text = "x" * 40
    table = pa.table(
        {
            "id": pa.array([3, None, 1], pa.int64()),
            "day": pa.array([dt.date(2026, 12, 7), dt.date(2026, 1, 2), None], pa.date32()),
            "name": pa.array(["b", "a" + long_text, None]),
            "long": pa.array(["a", long_text, "b"]),
            "score": pa.array([1.5, None, None], pa.float64()),
            "at": pa.array([None, None, None], pa.timestamp("us", tz="UTC")),
            "none": pa.array([None, None, None], pa.int32()),
            "nested": pa.array([{"a": 1}, None, {"a": 2}]),
        }
    )
    found = json.loads(arrow_files.stats(table))
    assert found["numRecords"] == 3 and found["tightBounds"] is True
    assert found["minValues"] == {"id": 1, "day": "2026-01-02", "name": ("a" + long_text)[:32], "long": "a"}
    # a maximum cut to 32 characters would not bound the column: left out, never wrong
    assert found["maxValues"] == {"id": 3, "day": "2026-12-07", "name": "b"}
    assert found["nullCount"] == {
        "id": 1, "day": 1, "name": 1, "long": 0, "score": 2, "at": 3, "none": 3
    }  # fmt: skip


def test_stats_bound_timestamps_in_utc_cut_to_milliseconds_as_delta_writes_them():
    """The ingest log's newest ``ingested_at`` is read from these bounds (a lookback)."""
    paris = dt.timezone(dt.timedelta(hours=1))
    at = [dt.datetime(2026, 12, 7, 12, 0, 0, 187_999, paris), None, dt.datetime(2026, 1, 2, tzinfo=dt.UTC)]
    table = pa.table(
        {
            "at": pa.array(at, pa.timestamp("us", tz="UTC")),
            "local": pa.array([dt.datetime(2026, 1, 1), None, None], pa.timestamp("us")),
        }
    )
    found = json.loads(arrow_files.stats(table))
    assert found["minValues"] == {"at": "2026-01-02T00:00:00.000Z"}
    assert found["maxValues"] == {"at": "2026-12-07T11:00:00.187Z"}  # no time zone: no bounds
    assert found["nullCount"] == {"at": 1, "local": 2}


def test_a_plain_table_takes_a_file_and_each_other_kind_is_named():
    fields = [_field("id", "long", nullable=False), _field("v", "string")]
    assert arrow_files.refused(PLAIN, _metadata(fields)) is None
    assert arrow_files.refused({"minWriterVersion": 2}, _metadata(fields)) is None
    refusals = {
        "writer feature(s) rowTracking": (
            {**PLAIN, "writerFeatures": ["rowTracking", "domainMetadata"]},
            _metadata(fields),
        ),
        "writer feature(s) clustering": ({**PLAIN, "writerFeatures": ["clustering"]}, _metadata(fields)),
        "partition columns": (PLAIN, _metadata(fields, partitionColumns=["v"])),
        "column mapping": (PLAIN, _metadata(fields, configuration={"delta.columnMapping.mode": "name"})),
        "row tracking": (PLAIN, _metadata(fields, configuration={"delta.enableRowTracking": "true"})),
        "CHECK constraints": (PLAIN, _metadata(fields, configuration={"delta.constraints.pos": "id > 0"})),
        "column 'g': Delta column metadata": (
            PLAIN,
            _metadata([*fields, _field("g", "long", metadata={"delta.generationExpression": "id + 1"})]),
        ),
        "column 's': a nested NOT NULL field": (
            PLAIN,
            _metadata([_field("s", {"type": "struct", "fields": [_field("a", "long", nullable=False)]})]),
        ),
        "column 'a': an array of NOT NULL elements": (
            PLAIN,
            _metadata([_field("a", {"type": "array", "elementType": "long", "containsNull": False})]),
        ),
        "column 'm': type": (
            PLAIN,
            _metadata([_field("m", {"type": "map", "keyType": "string", "valueType": "long"})]),
        ),
        "column 't': type timestamp_ntz": (PLAIN, _metadata([_field("t", "timestamp_ntz")])),
    }
    for reason, (protocol, metadata) in refusals.items():
        found = arrow_files.refused(protocol, metadata)
        assert found is not None and found.startswith(reason), (reason, found)


def test_a_null_in_a_not_null_column_is_named():
    schema = {"fields": [_field("id", "long", nullable=False), _field("v", "string")]}
    assert arrow_files.nulls_where_refused(pa.table({"id": [1, 2], "v": [None, "a"]}), schema) is None
    assert arrow_files.nulls_where_refused(pa.table({"id": [1, None], "v": ["a", "b"]}), schema) == "id"


def test_the_file_holds_the_rows_and_its_add_action_names_it_with_its_size_and_stats(tmp_path):
    table = pa.table({"id": pa.array([1, 2], pa.int64()), "v": ["a", None]})
    written = arrow_files.write(table, str(tmp_path))
    assert written.path.startswith("part-00000-") and written.path.endswith(".snappy.parquet")
    assert pq.read_table(tmp_path / written.path).equals(table)
    add = json.loads(written.add_action())["add"]
    assert add["size"] == (tmp_path / written.path).stat().st_size == written.size
    assert add["dataChange"] is True and add["partitionValues"] == {}
    assert json.loads(add["stats"])["numRecords"] == 2 == written.rows


@pytest.mark.parametrize("kind", ["boolean", "byte", "binary", "decimal(10,2)", "timestamp"])
def test_plain_types_are_taken(kind):
    assert arrow_files.refused(PLAIN, _metadata([_field("c", kind)])) is None
