"""Unit tests of cdc_join.landing.ingest: landing files → bronze, exactly once per file."""

from __future__ import annotations

import base64
import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from deltalake import DeltaTable
from pyspark.sql import functions as F

from cdc_join.config import PipelineConfig, parse_config
from cdc_join.errors import ConcurrentRunError
from cdc_join.landing.debezium import EVENT_COLUMNS
from cdc_join.landing.ingest import STEPS, IngestReport, beyond_lookback, ingest_all, ingest_source
from cdc_join.landing.listing import list_landing, read_lines

FIXTURES = Path(__file__).parents[2] / "fixtures" / "debezium"
CUSTOMERS = "mysql-inventory-customers.schema.jsonl"  # 10 events
TOMBSTONE = "mysql-inventory-customers.tutorial-tombstone.schema.jsonl"  # 1 tombstone


class Crash(Exception):
    """Stands in for a process killed between two writes."""


def pipeline(root: Path) -> PipelineConfig:
    spec = {
        "name": "ingest_test",
        "lake": "lake",
        "sources": {"customers": {"landing": "landing/customers", "primary_key": ["id"]}},
        "left": "customers",
        "select": {"customer_id": "customers.id"},
        "output": "out",
    }
    (root / "landing" / "customers").mkdir(parents=True)
    return parse_config(spec, base_dir=root)


def land(config: PipelineConfig, name: str, text: str) -> None:
    """Write a landing file the way a landing tool must: temporary name, then rename."""
    folder = Path(config.sources["customers"].landing or "")
    temporary = folder / f"_{name}.tmp"
    temporary.write_text(text)
    temporary.rename(folder / name)


def event(op: str, after: dict, pos: int) -> str:
    source = {"connector": "mysql", "file": "mysql-bin.000001", "pos": pos, "row": 0}
    return json.dumps({"op": op, "before": None, "after": after, "source": source, "ts_ms": pos})


def land_three_files(root: Path) -> PipelineConfig:
    """Three landing files (10 events, 1 tombstone, 2 garbage lines + 1 event) and decoys."""
    config = pipeline(root)
    folder = Path(config.sources["customers"].landing or "")
    shutil.copy(FIXTURES / CUSTOMERS, folder / CUSTOMERS)
    shutil.copy(FIXTURES / TOMBSTONE, folder / TOMBSTONE)
    land(config, "bad.jsonl", "not json\n" + event("c", {"id": 2001}, 9000) + '\n{"op": "?"}\n')
    (folder / "_still_writing.json").write_text("garbage\n")
    (folder / ".hidden.jsonl").write_text("garbage\n")
    (folder / "notes.txt").write_text("garbage\n")
    return config


@pytest.fixture(params=["one task", "cached"])
def batch_path(request, monkeypatch) -> str:
    """Each of ingest's two paths: a small batch read, parsed and counted by one task and
    brought to the driver by that job; a large one (here every batch) cached once parsed, in
    several tasks, and written from Spark."""
    import cdc_join.landing.ingest as ingest

    if request.param == "cached":
        monkeypatch.setattr(ingest, "ONE_TASK_BYTES", 0)
    return request.param


@pytest.fixture
def landed(tmp_path) -> PipelineConfig:
    return land_three_files(tmp_path)


def bronze_keys(spark, storage, config: PipelineConfig) -> list[tuple[str, int]]:
    rows = storage.read(config.bronze_path("customers")).select("_file", "_line").collect()
    return sorted((r._file, r._line) for r in rows)


def quarantine_keys(storage, config: PipelineConfig) -> list[tuple[str, int]]:
    if not storage.exists(config.quarantine_path):
        return []
    return sorted((r._file, r._line) for r in storage.read(config.quarantine_path).collect())


EXPECTED_BRONZE = sorted([(CUSTOMERS, n) for n in range(1, 11)] + [("bad.jsonl", 2)])
EXPECTED_QUARANTINE = [("bad.jsonl", 1), ("bad.jsonl", 3)]


def test_landing_listing_skips_temporary_hidden_and_other_files(spark, landed):
    names = [f.name for f in list_landing(spark, landed.sources["customers"].landing or "")]
    assert names == ["bad.jsonl", CUSTOMERS, TOMBSTONE]


@pytest.mark.parametrize("split_read_bytes", [0, 1 << 30], ids=["in splits", "whole files"])
def test_lines_are_numbered_exactly_from_one(spark, tmp_path, monkeypatch, split_read_bytes):
    import cdc_join.landing.listing as landing

    monkeypatch.setattr(landing, "SPLIT_READ_BYTES", split_read_bytes)
    folder = tmp_path / "landing"
    folder.mkdir()
    (folder / "a b+c.json").write_bytes(b'\xef\xbb\xbf{"n": 1}\r\n\r\n{"n": 3}\r\n')
    (folder / "empty.jsonl").write_text("")
    (folder / "no_final_newline.jsonl").write_text('{"n": 1}\n{"n": 2}')
    lines = read_lines(spark, list_landing(spark, str(folder))).collect()
    assert sorted((r._file, r._line, r.value) for r in lines) == [
        ("a b+c.json", 1, '{"n": 1}'),
        ("a b+c.json", 2, ""),
        ("a b+c.json", 3, '{"n": 3}'),
        ("no_final_newline.jsonl", 1, '{"n": 1}'),
        ("no_final_newline.jsonl", 2, '{"n": 2}'),
    ]


def test_a_gzipped_file_is_read_by_the_text_it_unpacks_to_not_its_size(spark, tmp_path, monkeypatch):
    # A few KB of gzip can be GB of JSON: one row holding the whole text is not an option.
    import gzip

    import cdc_join.landing.listing as landing

    text = "".join(f'{{"n": {i}}}\n' for i in range(200))
    folder = tmp_path / "landing"
    folder.mkdir()
    (folder / "batch.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    size = (folder / "batch.jsonl.gz").stat().st_size
    monkeypatch.setattr(landing, "SPLIT_READ_BYTES", size * 2)  # its size under it, its text over

    def whole(*args, **kwargs):
        raise AssertionError("a gzipped file of much text was read as one row")

    monkeypatch.setattr(landing, "_whole_files", whole)
    lines = read_lines(spark, list_landing(spark, str(folder))).collect()
    assert sorted((r._line, r.value) for r in lines) == [(i + 1, f'{{"n": {i}}}') for i in range(200)]


@pytest.mark.parametrize("split_read_bytes", [0, 1 << 30], ids=["in splits", "whole files"])
def test_malformed_utf8_in_a_line_becomes_the_replacement_character(
    spark, tmp_path, monkeypatch, split_read_bytes
):
    import cdc_join.landing.listing as landing

    monkeypatch.setattr(landing, "SPLIT_READ_BYTES", split_read_bytes)
    folder = tmp_path / "landing"
    folder.mkdir()
    (folder / "bad.jsonl").write_bytes(b'{"a": "\xff"}\n{"b": 1}\n')
    lines = read_lines(spark, list_landing(spark, str(folder)))
    checked = lines.selectExpr("_line", "value", "is_valid_utf8(value) AS valid").collect()
    assert sorted((r._line, r.value, r.valid) for r in checked) == [
        (1, '{"a": "\ufffd"}', True),
        (2, '{"b": 1}', True),
    ]


# (line, the line without a byte-order mark and CR, blank?): Java's regex semantics, where `$`
# also matches before a final line terminator (\r, \u0085, \u2028, \u2029).
LINE_CLEANING = [
    ('{"n": 1}', '{"n": 1}', False),
    ('{"n": 1}\r', '{"n": 1}', False),
    ('{"n": 1}\r\r', '{"n": 1}', False),
    ('{"n": 1}\r\u2028', '{"n": 1}\u2028', False),
    ('{"n": 1}\u2028', '{"n": 1}\u2028', False),
    ('{"n": 1}\r\u0085', '{"n": 1}\u0085', False),
    ('{"n": 1}\r\u2029', '{"n": 1}\u2029', False),
    ('\ufeff{"n": 1}', '{"n": 1}', False),
    ("\ufeff\r", "", False),
    (" {}", " {}", False),
    ("x\r", "x", False),
    ("{\r", "{", False),
    ("", "", True),
    (" \t", " \t", True),
    (" \u2028", " \u2028", True),
    ("\x0b \x0c", "\x0b \x0c", True),
    ("\r", "", True),
]


def test_a_byte_order_mark_and_a_final_cr_are_dropped_and_blank_lines_found_as_the_regex_would(spark):
    from cdc_join.landing.debezium.envelope import _blank
    from cdc_join.landing.listing import _without_bom_and_cr

    rows = [(i, v) for i, (v, _, _) in enumerate(LINE_CLEANING)]
    lines = spark.createDataFrame(rows, "i int, value string")
    got = lines.selectExpr("i", f"{_without_bom_and_cr('value')} AS cleaned", f"{_blank('value')} AS blank")
    got_rows = {r.i: (r.cleaned, r.blank) for r in got.collect()}
    assert [got_rows[i] for i in range(len(LINE_CLEANING))] == [(c, b) for _, c, b in LINE_CLEANING]


@pytest.mark.storage_path
@pytest.mark.parametrize("crash_after", ["bronze", "quarantine"])
def test_a_run_killed_between_writes_is_completed_exactly_once_by_the_next(
    spark, storage, landed, crash_after, batch_path
):
    def crash(step: str) -> None:
        if step == crash_after:
            raise Crash(step)

    with pytest.raises(Crash):
        ingest_source(spark, storage, landed, "customers", after_step=crash)
    assert bronze_keys(spark, storage, landed) == EXPECTED_BRONZE
    assert not storage.exists(landed.ingest_log_path)  # so the files are read again

    steps: list[str] = []
    report = ingest_source(spark, storage, landed, "customers", after_step=steps.append)

    assert steps == list(STEPS)
    assert (report.files, report.lines, report.events, report.quarantined, report.tombstones) == (
        3,
        14,
        11,
        2,
        1,
    )
    assert bronze_keys(spark, storage, landed) == EXPECTED_BRONZE  # each line exactly once
    assert quarantine_keys(storage, landed) == EXPECTED_QUARANTINE
    log = {r.file: r for r in storage.read(landed.ingest_log_path).collect()}
    assert set(log) == {"bad.jsonl", CUSTOMERS, TOMBSTONE}
    assert (log[CUSTOMERS].lines, log[CUSTOMERS].events, log[CUSTOMERS].size) == (
        10,
        10,
        (FIXTURES / CUSTOMERS).stat().st_size,
    )
    assert (log["bad.jsonl"].events, log["bad.jsonl"].quarantined) == (1, 2)
    assert (log[TOMBSTONE].tombstones, log[TOMBSTONE].events) == (1, 0)


@pytest.mark.race
def test_two_ingests_of_one_batch_that_both_find_it_new_write_each_line_once(
    spark, storage, landed, monkeypatch
):
    # Both look at bronze before either writes, so both would append the batch: the second
    # append, at the version the first moved, is refused (the run stops as a lost race), and
    # bronze holds each line once; the loser's rerun finds the batch ingested.
    import cdc_join.landing.ingest as ingest

    real = ingest._holds_lines_of
    raced: list[bool] = []

    def look_then_let_the_other_win(*args):
        held = real(*args)
        if not raced:
            raced.append(True)
            ingest_source(spark, storage, landed, "customers")  # the other ingest, start to end
        return held

    monkeypatch.setattr(ingest, "_holds_lines_of", look_then_let_the_other_win)
    with pytest.raises(ConcurrentRunError, match="another writer committed to it first"):
        ingest_source(spark, storage, landed, "customers")
    assert raced and bronze_keys(spark, storage, landed) == EXPECTED_BRONZE

    assert ingest_source(spark, storage, landed, "customers").files == 0
    assert bronze_keys(spark, storage, landed) == EXPECTED_BRONZE


@pytest.mark.kill
def test_every_source_s_files_are_logged_in_one_commit_once_every_bronze_has_them(spark, storage, tmp_path):
    # Killed after the second source's bronze write: neither source's files are logged yet, so
    # the next ingest reads both again, and bronze holds each line once.
    spec = {
        "name": "two_sources",
        "lake": "lake",
        "sources": {
            name: {"landing": f"landing/{name}", "primary_key": ["id"]} for name in ("customers", "copies")
        },
        "left": "customers",
        "joins": [{"right": "copies", "foreign_key": ["id"]}],
        "select": {"customer_id": "customers.id"},
        "output": "out",
    }
    for name in ("customers", "copies"):
        (tmp_path / "landing" / name).mkdir(parents=True)
        shutil.copy(FIXTURES / CUSTOMERS, tmp_path / "landing" / name / CUSTOMERS)
    config = parse_config(spec, base_dir=tmp_path)
    bronzes = [config.bronze_path("customers"), config.bronze_path("copies")]
    seen: list[str] = []

    def crash(step: str) -> None:
        seen.append(step)
        if seen.count("bronze") == 2:
            raise Crash(step)

    with pytest.raises(Crash):
        ingest_all(spark, storage, config, after_step=crash)
    assert not storage.exists(config.ingest_log_path)

    steps: list[str] = []
    reports = ingest_all(spark, storage, config, after_step=steps.append)

    assert steps == ["bronze", "quarantine", "bronze", "quarantine", "log"]
    assert {name: r.events for name, r in reports.items()} == {"customers": 10, "copies": 10}
    for path in bronzes:
        rows = storage.read(path).groupBy("_file", "_line").count()
        assert (rows.count(), rows.filter("count > 1").count()) == (10, 0)
    log = storage.read(config.ingest_log_path)
    logged = sorted((r.source, r.file) for r in log.collect())
    assert logged == [("copies", CUSTOMERS), ("customers", CUSTOMERS)]
    assert storage.version(config.ingest_log_path) == 1  # created, then one append
    assert all(ingest_all(spark, storage, config)[name].files == 0 for name in ("customers", "copies"))


@pytest.fixture(scope="module")
def ingested(spark, storage, tmp_path_factory) -> tuple[PipelineConfig, IngestReport]:
    """The three files of :func:`land_three_files`, ingested once by ``ingest_all``."""
    config = land_three_files(tmp_path_factory.mktemp("ingested"))
    return config, ingest_all(spark, storage, config)["customers"]


def test_a_second_ingest_of_the_same_folder_adds_nothing(spark, storage, ingested):
    config, first = ingested
    tables = (config.bronze_path("customers"), config.quarantine_path, config.ingest_log_path)
    versions = [storage.version(p) for p in tables]

    again = ingest_all(spark, storage, config)["customers"]

    assert (first.files, first.events) == (3, 11)
    assert again == IngestReport("customers", 0, 0, 0, 0, 0, again.seconds, unread=("notes.txt",))
    assert [storage.version(p) for p in tables] == versions
    assert bronze_keys(spark, storage, config) == EXPECTED_BRONZE


def test_bronze_contract_columns_and_change_data_feed(storage, ingested):
    config, _ = ingested
    bronze = storage.read(config.bronze_path("customers"))
    assert bronze.columns == [*EVENT_COLUMNS, "_ingested_at"]
    assert dict(bronze.dtypes)["_ingested_at"] == "timestamp"
    row = bronze.filter("_file = 'mysql-inventory-customers.schema.jsonl' AND _line = 6").first()
    assert (row._op, row._before.first_name, row._after.first_name) == ("u", "Anne", "Anne1")
    for path in (config.bronze_path("customers"), config.quarantine_path, config.ingest_log_path):
        assert DeltaTable(path).metadata().configuration.get("delta.enableChangeDataFeed") == "true"
    quarantined = storage.read(config.quarantine_path).filter("_line = 1").first()
    assert (quarantined.source, quarantined.reason, quarantined.raw) == (
        "customers",
        "not valid JSON",
        "not json",
    )


def test_later_files_add_columns_and_never_retype_known_ones(spark, storage, tmp_path):
    config = pipeline(tmp_path)
    land(config, "001.jsonl", event("c", {"id": 1, "name": "a"}, 1) + "\n")
    ingest_source(spark, storage, config, "customers")
    land(
        config,
        "002.jsonl",
        event("u", {"id": 1, "name": "b", "tier": 3}, 2) + "\n" + event("c", {"id": "x"}, 3),
    )

    report = ingest_source(spark, storage, config, "customers")

    assert (report.files, report.events, report.quarantined) == (1, 1, 1)
    after = storage.schema(config.bronze_path("customers"))["_after"].dataType
    assert [(f.name, f.dataType.simpleString()) for f in after.fields] == [
        ("id", "bigint"),
        ("name", "string"),
        ("tier", "bigint"),
    ]
    rows = {(r._file, r._line): r._after for r in storage.read(config.bronze_path("customers")).collect()}
    assert rows[("001.jsonl", 1)].tier is None  # written before the column existed
    assert rows[("002.jsonl", 1)].tier == 3
    reason = storage.read(config.quarantine_path).first().reason
    assert reason == 'column id: expected bigint, got "x"'


def test_kafka_connect_sink_layout_and_gzip_files_are_ingested_with_their_paths(spark, storage, tmp_path):
    import gzip

    config = pipeline(tmp_path)
    folder = Path(config.sources["customers"].landing or "")
    topic = folder / "topics" / "inventory.customers"
    (topic / "partition=0").mkdir(parents=True)
    (topic / "partition=1").mkdir()
    (topic / "partition=0" / "inventory.customers+0+0000000000.json").write_text(
        event("c", {"id": 1}, 1) + "\n" + event("c", {"id": 2}, 2) + "\n"
    )
    with gzip.open(topic / "partition=1" / "inventory.customers+1+0000000000.json.gz", "wt") as f:
        f.write(event("c", {"id": 3}, 3) + "\n")
    (folder / "+tmp" / "x").mkdir(parents=True)  # a sink's files still being written
    (folder / "+tmp" / "x" / "part.json").write_text("garbage\n")

    report = ingest_source(spark, storage, config, "customers")

    assert (report.files, report.events, report.quarantined) == (2, 3, 0)
    prefix = "topics/inventory.customers/"
    assert bronze_keys(spark, storage, config) == [
        (prefix + "partition=0/inventory.customers+0+0000000000.json", 1),
        (prefix + "partition=0/inventory.customers+0+0000000000.json", 2),
        (prefix + "partition=1/inventory.customers+1+0000000000.json.gz", 1),
    ]
    assert ingest_source(spark, storage, config, "customers").files == 0


def test_a_file_changed_after_it_was_ingested_stops_the_run_naming_it(spark, storage, tmp_path):
    from cdc_join.errors import InputError

    config = pipeline(tmp_path)
    land(config, "001.jsonl", event("c", {"id": 1}, 1) + "\n")
    ingest_source(spark, storage, config, "customers")
    path = Path(config.sources["customers"].landing or "") / "001.jsonl"
    with path.open("a") as f:  # a line appended to a file already ingested
        f.write(event("c", {"id": 2}, 2) + "\n")
    with pytest.raises(InputError, match=r"001\.jsonl \(\d+ → \d+ bytes\).*new files"):
        ingest_source(spark, storage, config, "customers")
    assert bronze_keys(spark, storage, config) == [("001.jsonl", 1)]


def test_a_file_relanded_with_other_content_of_the_same_size_stops_the_run(spark, storage, tmp_path):
    import os

    from cdc_join.errors import InputError

    config = pipeline(tmp_path)
    land(config, "001.jsonl", event("c", {"id": 1}, 1) + "\n")
    ingest_source(spark, storage, config, "customers")
    path = Path(config.sources["customers"].landing or "") / "001.jsonl"
    text = path.read_text()
    stat = path.stat()
    # Copied again with the same bytes and a newer modification time: not a change.
    land(config, "001.jsonl", text)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 5_000_000_000))
    assert ingest_source(spark, storage, config, "customers").files == 0
    # The same size, other content (id 1 → id 7): the run stops and names the file.
    land(config, "001.jsonl", text.replace('"id": 1}', '"id": 7}'))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 9_000_000_000))
    assert path.stat().st_size == stat.st_size
    with pytest.raises(InputError, match=r"001\.jsonl \(same size, rewritten at .*\).*new name"):
        ingest_source(spark, storage, config, "customers")
    assert bronze_keys(spark, storage, config) == [("001.jsonl", 1)]


@pytest.mark.storage_path  # the ingest log's statistics are written per backend
def test_a_lookback_lists_only_files_modified_since_the_last_ingest(spark, storage, tmp_path):
    import dataclasses
    import os
    import time

    config = dataclasses.replace(pipeline(tmp_path), landing_lookback_hours=1.0)
    folder = Path(config.sources["customers"].landing or "")
    land(config, "001.jsonl", event("c", {"id": 1}, 1) + "\n")
    old = time.time() - 3 * 3600  # landed three hours before the first ingest
    os.utime(folder / "001.jsonl", (old, old))
    assert ingest_all(spark, storage, config)["customers"].files == 1  # no ingest yet: lists all
    land(config, "002.jsonl", event("c", {"id": 2}, 2) + "\n")
    os.utime(folder / "001.jsonl", (old, old))
    names = [f.name for f in list_landing(spark, str(folder))]
    assert names == ["001.jsonl", "002.jsonl"]
    assert ingest_all(spark, storage, config)["customers"].files == 1  # 002 only: 001 not listed
    # A file that lands late with an old modification time is outside the lookback: the
    # README's contract (new files carry the time they land) is what makes the option safe.
    land(config, "000.jsonl", event("c", {"id": 0}, 0) + "\n")
    os.utime(folder / "000.jsonl", (old, old))
    assert ingest_all(spark, storage, config)["customers"].files == 0
    # Not silently: verify lists every landing file and names those no run will see.
    assert beyond_lookback(spark, storage, config) == {"customers": ["000.jsonl"]}
    assert ingest_all(spark, storage, pipeline_again(config))["customers"].files == 1
    assert beyond_lookback(spark, storage, config) == {}


def pipeline_again(config: PipelineConfig) -> PipelineConfig:
    import dataclasses

    return dataclasses.replace(config, landing_lookback_hours=None)


@pytest.mark.storage_path
def test_a_json_array_file_is_quarantined_once_with_one_reason(spark, storage, tmp_path, batch_path):
    from cdc_join.landing.outcome import JSON_ARRAY_REASON

    config = pipeline(tmp_path)
    events = [json.loads(event("c", {"id": i}, i)) for i in (1, 2)]
    land(config, "array.json", json.dumps(events, indent=2) + "\n")
    land(config, "one_line_array.json", json.dumps(events) + "\n")
    # Its first line is blank: the array opens on the next one (whose element parses as an event).
    land(
        config,
        "blank_then_array.json",
        "\n  \n[\n" + json.dumps(events[0]) + ",\n" + json.dumps(events[1]) + "\n]\n",
    )
    land(config, "ok.jsonl", event("c", {"id": 3}, 3) + "\n")

    report = ingest_source(spark, storage, config, "customers")

    assert (report.events, report.quarantined) == (1, 3)
    assert bronze_keys(spark, storage, config) == [("ok.jsonl", 1)]
    rows = storage.read(config.quarantine_path).collect()
    assert sorted((r._file, r._line, r.reason) for r in rows) == [
        ("array.json", 1, JSON_ARRAY_REASON),
        ("blank_then_array.json", 3, JSON_ARRAY_REASON),  # the line that opens it
        ("one_line_array.json", 1, JSON_ARRAY_REASON),
    ]


def test_a_file_spark_cannot_read_is_quarantined_whole_and_the_others_are_ingested(
    spark, storage, tmp_path, batch_path
):
    import gzip

    from cdc_join.landing.outcome import UNREADABLE_REASON

    config = pipeline(tmp_path)
    folder = Path(config.sources["customers"].landing or "")
    whole = gzip.compress(("\n".join(event("c", {"id": i}, i) for i in range(50)) + "\n").encode())
    (folder / "cut.jsonl.gz").write_bytes(whole[: len(whole) // 2])  # a truncated upload
    land(config, "ok.jsonl", event("c", {"id": 99}, 99) + "\n")

    report = ingest_source(spark, storage, config, "customers")

    assert (report.files, report.events, report.quarantined) == (2, 1, 1)
    assert bronze_keys(spark, storage, config) == [("ok.jsonl", 1)]
    [row] = storage.read(config.quarantine_path).collect()
    assert (row._file, row._line, row.raw) == ("cut.jsonl.gz", 0, None)
    assert row.reason.startswith(UNREADABLE_REASON) and "Exception" in row.reason
    # Logged like any file: the next run does not try it again.
    assert ingest_source(spark, storage, config, "customers").files == 0


def test_a_batch_of_unreadable_files_only_is_quarantined_and_logged_without_bronze(spark, storage, tmp_path):
    import gzip

    from cdc_join.landing.outcome import UNREADABLE_REASON

    config = pipeline(tmp_path)
    folder = Path(config.sources["customers"].landing or "")
    whole = gzip.compress((event("c", {"id": 1}, 1) + "\n").encode() * 50)
    (folder / "cut.jsonl.gz").write_bytes(whole[: len(whole) // 2])

    report = ingest_source(spark, storage, config, "customers")

    assert (report.files, report.events, report.quarantined) == (1, 0, 1)
    assert report.reasons and all(r.startswith(UNREADABLE_REASON) for r in report.reasons)
    assert not storage.exists(config.bronze_path("customers"))
    [row] = storage.read(config.quarantine_path).collect()
    assert (row._file, row._line) == ("cut.jsonl.gz", 0)
    assert ingest_source(spark, storage, config, "customers").files == 0


@pytest.fixture
def small_splits(spark, monkeypatch):
    """Files are read in splits of 1 KiB, so a file of a few KiB is read by several tasks."""
    import cdc_join.landing.listing as landing

    monkeypatch.setattr(landing, "SPLIT_READ_BYTES", 0)  # every batch is read in splits
    keys = ("spark.sql.files.maxPartitionBytes", "spark.sql.files.openCostInBytes")
    saved = {k: spark.conf.get(k) for k in keys}
    for k in keys:
        spark.conf.set(k, "1024")
    yield
    for k, v in saved.items():
        spark.conf.set(k, v)


def test_a_file_read_in_many_splits_numbers_every_line_exactly(spark, tmp_path, small_splits):
    folder = tmp_path / "landing"
    folder.mkdir()
    # Lines of uneven length (some blank, some CRLF) so split boundaries fall mid-line.
    texts = {n: ("" if n % 7 == 0 else json.dumps({"n": n, "pad": "x" * (n % 50)})) for n in range(1, 2001)}
    body = "".join(t + ("\r\n" if n % 5 == 0 else "\n") for n, t in texts.items())
    (folder / "big.jsonl").write_text(body)
    (folder / "small.jsonl").write_text('{"n": 1}\n{"n": 2}')
    lines = read_lines(spark, list_landing(spark, str(folder)))
    # Tasks that produced lines (Spark Connect has no RDDs to count partitions of).
    assert lines.select(F.spark_partition_id()).distinct().count() > 10
    got = sorted((r._file, r._line, r.value) for r in lines.collect())
    assert got == sorted(
        [("big.jsonl", n, t) for n, t in texts.items()]
        + [("small.jsonl", 1, '{"n": 1}'), ("small.jsonl", 2, '{"n": 2}')]
    )


def test_a_batch_read_in_many_splits_ingests_the_same_rows(spark, storage, tmp_path, small_splits):
    config = land_three_files(tmp_path)
    report = ingest_source(spark, storage, config, "customers")
    assert (report.files, report.lines, report.events, report.quarantined) == (3, 14, 11, 2)
    assert bronze_keys(spark, storage, config) == EXPECTED_BRONZE
    assert quarantine_keys(storage, config) == EXPECTED_QUARANTINE


def cached_rdds(spark) -> int:
    """How many RDDs Spark holds cached (skips the test over Spark Connect, which hides the JVM)."""
    if type(spark).__module__.startswith("pyspark.sql.connect"):
        pytest.skip("cached RDDs are counted through the JVM, which Spark Connect does not expose")
    return spark.sparkContext._jsc.getPersistentRDDs().size()


@pytest.mark.storage_path
def test_an_ingest_leaves_nothing_in_spark_s_cache(spark, storage, landed, batch_path):
    # The parsed lines are cached for the length of one batch: a scheduled job ingesting
    # every few minutes must not pin every batch it ever read in executor memory.
    cached_before = cached_rdds(spark)
    ingest_all(spark, storage, landed)
    assert cached_rdds(spark) == cached_before


@pytest.mark.parametrize("gzipped", [False, True], ids=["text", "gzipped"])
def test_a_batch_is_cached_while_it_is_written_when_its_text_is_large_gzipped_files_by_their_text(
    spark, storage, tmp_path, monkeypatch, gzipped
):
    import gzip

    import cdc_join.landing.ingest as ingest

    config = pipeline(tmp_path)
    text = ("\n".join(event("c", {"id": i}, i) for i in range(200)) + "\n").encode()
    stored = gzip.compress(text) if gzipped else text
    (
        Path(config.sources["customers"].landing or "") / ("001.jsonl.gz" if gzipped else "001.jsonl")
    ).write_bytes(stored)
    # Over the file's size, under the text a gzipped file is taken to hold.
    monkeypatch.setattr(ingest, "ONE_TASK_BYTES", 5 * len(stored))
    cached_before = cached_rdds(spark)
    cached_while_written: list[int] = []

    def count(step: str) -> None:
        if step == "bronze":
            cached_while_written.append(cached_rdds(spark) - cached_before)

    report = ingest_source(spark, storage, config, "customers", after_step=count)

    assert report.events == 200
    assert (cached_while_written[0] > 0) is gzipped
    assert cached_rdds(spark) == cached_before


# -- Debezium's placeholder for a value it could not read -------------------------------------

_TOASTED_ROW = [
    {"field": "id", "type": "int32"},
    {"field": "bio", "type": "string", "optional": True},
    {"field": "photo", "type": "bytes", "optional": True},
    {"field": "tags", "type": "array", "items": {"type": "string"}, "optional": True},
]
_TOASTED_SCHEMA = {
    "type": "struct",
    "fields": [
        {"field": "before", "type": "struct", "optional": True, "fields": _TOASTED_ROW},
        {"field": "after", "type": "struct", "optional": True, "fields": _TOASTED_ROW},
        {"field": "op", "type": "string"},
        {"field": "ts_ms", "type": "int64", "optional": True},
    ],
}


def _toasted(op: str, lsn: int, **after) -> str:
    source = {"connector": "postgresql", "lsn": lsn}
    payload = {"op": op, "before": None, "after": after, "source": source, "ts_ms": lsn}
    return json.dumps({"schema": _TOASTED_SCHEMA, "payload": payload})


def test_placeholders_for_values_debezium_could_not_read_are_counted_and_the_run_warns(
    spark, storage, tmp_path, batch_path
):
    """PostgreSQL sends ``__debezium_unavailable_value`` for an unchanged TOASTed column when the
    table's REPLICA IDENTITY is not FULL (as text, base64 bytes, or an array element): silver
    would hold it, so the run report says so, naming the columns, and the events still land."""
    from cdc_join.landing.debezium.unavailable import UNAVAILABLE_VALUE
    from cdc_join.run.pipeline import Pipeline

    config = pipeline(tmp_path)
    placeholder_bytes = base64.b64encode(UNAVAILABLE_VALUE.encode()).decode()
    lines = [
        _toasted("c", 1, id=1, bio="a long text", photo=base64.b64encode(b"png").decode(), tags=["x"]),
        _toasted("u", 2, id=1, bio=UNAVAILABLE_VALUE, photo=placeholder_bytes, tags=[UNAVAILABLE_VALUE]),
        _toasted("c", 3, id=2, bio="short", photo=None, tags=None),
        _toasted("u", 4, id=2, bio=UNAVAILABLE_VALUE, photo=None, tags=["y", None]),
    ]
    land(config, "001.jsonl", "\n".join(lines) + "\n")

    report = Pipeline(config, spark, storage).run()

    counts = report.steps["ingest"]["customers"]
    assert (counts["events"], counts["unavailable_values"]) == (4, {"bio": 2, "photo": 1, "tags": 1})
    [warning] = report.warnings
    assert "'customers'" in warning and "bio (2), photo (1), tags (1)" in warning
    assert UNAVAILABLE_VALUE in warning and "REPLICA IDENTITY FULL" in warning
    assert f"WARNING: {warning}" in report.summary()


def test_unavailable_checks_find_text_bytes_and_text_lists_of_the_after_images(spark):
    from pyspark.sql.types import ArrayType, BinaryType, LongType, StringType, StructField, StructType

    from cdc_join.landing.debezium.unavailable import UNAVAILABLE_VALUE, unavailable_checks

    ph = UNAVAILABLE_VALUE
    kind = StructType(
        [
            StructField("s", StringType()),
            StructField("b", BinaryType()),
            StructField("l", ArrayType(StringType())),
            StructField("n", LongType()),
            StructField("st", StructType([StructField("inner", StringType())])),
        ]
    )
    rows = [
        ({"s": ph, "b": bytearray(ph.encode()), "l": [ph, ph], "n": 1, "st": {"inner": ph}},),
        ({"s": "x", "b": bytearray(b"x"), "l": [None, ph], "n": None, "st": None},),
        (None,),  # an event without an after image (a delete)
        ({"s": ph, "b": None, "l": None, "n": 2, "st": None},),
        # A bytea column of payload-only events is text: the placeholder's bytes in base64.
        ({"s": base64.b64encode(ph.encode()).decode(), "b": None, "l": [], "n": 3, "st": None},),
        ({"s": "y", "b": None, "l": ["z", None], "n": 4, "st": None},),
    ]
    frame = spark.createDataFrame(rows, StructType([StructField("__after", kind)]))

    checks = unavailable_checks(kind, "__after")

    assert sorted(checks) == ["b", "l", "s"]  # nothing else can hold the placeholder
    sums = [f"sum(CASE WHEN {check} THEN 1 ELSE 0 END) AS {name}" for name, check in checks.items()]
    assert frame.selectExpr(*sums).first().asDict() == {"s": 3, "b": 1, "l": 2}


def test_files_a_run_does_not_read_by_their_names_are_named_in_a_warning_every_run_and_by_verify(
    spark, storage, tmp_path
):
    """A file named otherwise than .json/.jsonl(.gz) (``.ndjson``, another compression) is not
    read; the run says so, naming it, rather than ingesting nothing in silence. Files still
    being written (``_``, ``.``, ``+``) are expected there and not named."""
    from cdc_join.run.pipeline import Pipeline

    config = land_three_files(tmp_path)
    folder = Path(config.sources["customers"].landing or "")
    (folder / "sub").mkdir()
    for name in ("a.ndjson", "sub/b.json.zst", "c.jsonl.bz2", "d.txt", "e.csv", "f.avro"):
        (folder / name).write_text(event("c", {"id": 7}, 1) + "\n")

    report = Pipeline(config, spark, storage).run()

    counts = report.steps["ingest"]["customers"]
    assert (counts["files"], counts["unread_files"]) == (3, 7)
    [warning] = report.warnings
    assert "'customers': 7 file(s) in its landing folder are not read" in warning
    assert "a.ndjson, c.jsonl.bz2, d.txt, e.csv, f.avro and 2 more" in warning
    again = ingest_all(spark, storage, config)["customers"]
    assert again.files == 0 and "sub/b.json.zst" in again.unread and "notes.txt" in again.unread
    assert not any("_still_writing" in w or ".hidden" in w for w in again.warnings())
    # verify names them too (a note: silver still matches what was read).
    checked = Pipeline(config, spark, storage).verify()
    assert checked.ok
    assert "'customers': 7 file(s) in its landing folder are not read" in checked.summary()


def test_a_landing_folder_that_does_not_exist_is_named_in_a_warning(spark, storage, tmp_path):
    config = pipeline(tmp_path)
    folder = Path(config.sources["customers"].landing or "")
    folder.rmdir()

    report = ingest_all(spark, storage, config)["customers"]

    assert (report.files, report.missing_folder) == (0, config.sources["customers"].landing)
    [warning] = report.warnings()
    assert f"'customers': its landing folder {folder} does not exist" in warning
    folder.mkdir()
    assert ingest_all(spark, storage, config)["customers"].warnings() == []


def _sqlserver(op: str, id_: int, commit: str, change: str | None = None, serial: int | None = None) -> str:
    source = {"connector": "sqlserver", "commit_lsn": commit}
    if change is not None:
        source |= {"change_lsn": change, "event_serial_no": serial}
    return json.dumps({"op": op, "before": None, "after": {"id": id_}, "source": source, "ts_ms": 1})


@pytest.mark.parametrize("connector", [None, "sqlserver"])
def test_the_recorded_rule_is_whole_when_bronze_s_first_events_lack_some_of_its_fields(
    spark, storage, tmp_path, connector
):
    """SQL Server's snapshot rows carry ``commit_lsn`` only, with no ``change_lsn`` and no
    ``event_serial_no``. A later batch must still use SQL Server's three fields: not a rule made
    of the fields one stored row happens to have, and not a config error for ``connector:``."""
    config = pipeline(tmp_path)
    if connector:
        source = dataclasses.replace(config.sources["customers"], connector=connector)
        config = dataclasses.replace(config, sources={"customers": source})
    land(config, "001.jsonl", "\n".join(_sqlserver("r", i, "00000025:00000d98:00a2") for i in (1, 2)) + "\n")
    ingest_all(spark, storage, config)
    later = [
        _sqlserver("u", 1, "00000026:00000001:0001", "00000026:00000001:0002", 2),
        _sqlserver("u", 1, "00000026:00000001:0001", "00000026:00000001:0001", 3),
    ]
    land(config, "002.jsonl", "\n".join(later) + "\n")

    ingest_all(spark, storage, config)

    rows = (
        storage.read(config.bronze_path("customers"))
        .select("_file", "_line", "_seq", "_seq_values")
        .collect()
    )
    by_line = {(r._file, r._line): r for r in rows}
    assert all(r._seq.count("\u0001") == 2 for r in rows)  # three components, every batch
    newer, older = by_line[("002.jsonl", 1)], by_line[("002.jsonl", 2)]
    assert older._seq < newer._seq  # change_lsn decides within the transaction
    snapshot = json.loads(by_line[("001.jsonl", 1)]._seq_values)
    assert snapshot == {
        "source.commit_lsn": "00000025:00000d98:00a2",
        "source.change_lsn": None,
        "source.event_serial_no": None,
    }


def test_a_bronze_of_older_versions_keeps_the_rule_they_read_from_it(spark, storage, tmp_path):
    """Before 2026-11-27 ``_seq_values`` left out the fields an event lacked, and the rule read
    back from such a row (SQL Server's ``commit_lsn`` alone) ordered every later batch. A lake
    like that goes on with that rule: switching to the whole rule now would order new events
    below those of the batches in between."""
    import pyarrow.compute as pc

    from cdc_join.landing.ingest import recorded_sequence

    config = pipeline(tmp_path)
    land(config, "001.jsonl", "\n".join(_sqlserver("r", i, "00000025:00000d98:00a2") for i in (1, 2)) + "\n")
    ingest_all(spark, storage, config)
    path = config.bronze_path("customers")
    assert recorded_sequence(storage, path) == (
        "source.commit_lsn",
        "source.change_lsn",
        "source.event_serial_no",
    )
    table = storage.read_arrow(path)
    nulls = ',"source.change_lsn":null,"source.event_serial_no":null'
    old = pc.replace_substring(table.column("_seq_values"), nulls, "")
    column = table.schema.get_field_index("_seq_values")
    _rewrite(spark, storage, path, table.set_column(column, "_seq_values", old))

    assert recorded_sequence(storage, path) == ("source.commit_lsn",)


def _rewrite(spark, storage, path: str, table) -> None:
    """Replace a table's rows with ``table`` (as a version that wrote them so would have)."""
    from cdc_join.changeset import from_arrow

    storage.overwrite(path, from_arrow(spark, storage.schema(path), table))


def _postgres(op: str, name: str, sequence: list, snapshot: str = "false") -> str:
    lsn = int(sequence[1])
    source = {"connector": "postgresql", "lsn": lsn, "snapshot": snapshot, "sequence": json.dumps(sequence)}
    after = {"id": 1, "name": name}
    return json.dumps({"op": op, "before": None, "after": after, "source": source, "ts_ms": 1})


def _current_name(spark, storage, config: PipelineConfig) -> str:
    from cdc_join.join.state import current_rows

    [row] = current_rows(storage.read(config.state_path("customers")), ["id"]).select("name").collect()
    return row.name


@pytest.mark.parametrize("connector", [None, "postgresql"])
def test_a_postgres_bronze_of_older_versions_goes_on_with_its_encoding(spark, storage, tmp_path, connector):
    """Bronze ingested before 2026-11-28 recorded PostgreSQL's rule as (source.sequence,
    source.lsn) and encoded a snapshot row's null first element as ''. Its later batches keep
    that encoding, with or without ``connector: postgresql``: encoded the new way, a change
    would compare with the old rows by a different rule. A new lake takes the new encoding."""
    import pyarrow as pa

    from cdc_join.landing.debezium import SEQ_SEPARATOR
    from cdc_join.landing.ingest import legacy_warnings, recorded_sequence
    from cdc_join.run.pipeline import Pipeline

    def sequences(config: PipelineConfig) -> dict[tuple[str, int], str]:
        rows = storage.read(config.bronze_path("customers")).select("_file", "_line", "_seq").collect()
        return {(r._file, r._line): r._seq for r in rows}

    config = pipeline(tmp_path)
    if connector:
        source = dataclasses.replace(config.sources["customers"], connector=connector)
        config = dataclasses.replace(config, sources={"customers": source})
    land(config, "001.jsonl", _postgres("r", "snapshot", [None, "8"], "last") + "\n")
    ingest_all(spark, storage, config)
    path = config.bronze_path("customers")
    new = ("source.sequence", "source.lsn", "source.snapshot")
    assert recorded_sequence(storage, path) == new
    # the row as versions before 2026-11-28 wrote it
    table = storage.read_arrow(path)
    old_values = json.dumps(
        {"source.sequence": json.dumps([None, "8"]), "source.lsn": "8"}, separators=(",", ":")
    )
    old_seq = SEQ_SEPARATOR.join(["", "8".zfill(20)])
    for name, value in (("_seq_values", old_values), ("_seq", old_seq)):
        column = pa.array([value] * table.num_rows, table.schema.field(name).type)
        table = table.set_column(table.schema.get_field_index(name), name, column)
    _rewrite(spark, storage, path, table)
    assert recorded_sequence(storage, path) == ("source.sequence", "source.lsn")
    later = [_postgres("u", "streamed", ["9", "10"]), _postgres("r", "snapshot again", [None, "12"], "true")]
    land(config, "002.jsonl", "\n".join(later) + "\n")

    [warning] = ingest_all(spark, storage, config)["customers"].warnings()

    assert (
        "'customers': its bronze was ingested with the sequence rule 'postgresql_before_2026_11_28'"
        in warning
    )
    assert sequences(config)[("002.jsonl", 1)] == SEQ_SEPARATOR.join(["9".zfill(20), "10".zfill(20)])
    assert sequences(config)[("002.jsonl", 2)] == SEQ_SEPARATOR.join(["", "12".zfill(20)])  # as before
    # A run goes on with it (the change at [9, 10] is the newest there), and verify says so.
    run = Pipeline(config, spark, storage)
    run.run()
    assert _current_name(spark, storage, config) == "streamed"
    checked = run.verify()
    assert checked.ok
    assert "'customers': its bronze was ingested with the sequence rule" in checked.summary()
    fresh = pipeline(tmp_path / "fresh")
    land(fresh, "002.jsonl", "\n".join(later) + "\n")
    assert ingest_all(spark, storage, fresh)["customers"].warnings() == []
    assert legacy_warnings(storage, fresh) == []
    assert sequences(fresh)[("002.jsonl", 2)] == SEQ_SEPARATOR.join(["12".zfill(20), ""])
    Pipeline(fresh, spark, storage).run()
    assert _current_name(spark, storage, fresh) == "snapshot again"


def test_a_configured_rule_with_postgres_s_earlier_fields_gets_no_warning(spark, storage, tmp_path):
    """``sequence_by: [source.sequence, source.lsn]`` records the fields PostgreSQL's rule of
    before 2026-11-28 had; the configured rule orders the events, so no run and no verify says
    the lake keeps an earlier version's rule."""
    from cdc_join.landing.ingest import legacy_warnings

    config = pipeline(tmp_path)
    source = dataclasses.replace(config.sources["customers"], sequence_by=("source.sequence", "source.lsn"))
    config = dataclasses.replace(config, sources={"customers": source})
    land(config, "001.jsonl", _postgres("u", "first", ["9", "10"]) + "\n")
    assert ingest_all(spark, storage, config)["customers"].warnings() == []
    land(config, "002.jsonl", _postgres("u", "second", ["10", "11"]) + "\n")
    assert ingest_all(spark, storage, config)["customers"].warnings() == []
    assert legacy_warnings(storage, config) == []


def test_a_small_batch_reaches_bronze_as_rows_on_the_driver_and_a_large_one_as_spark_s_frame(
    spark, storage, tmp_path, monkeypatch
):
    from cdc_join.changeset import ChangeSet
    from cdc_join.landing import ingest

    config = pipeline(tmp_path)
    appended: list[bool] = []
    real = storage.append

    def spy(path, rows, *args, **kwargs):
        if path == config.bronze_path("customers"):
            appended.append(isinstance(rows, ChangeSet))
        return real(path, rows, *args, **kwargs)

    monkeypatch.setattr(storage, "append", spy)
    land(config, "001.jsonl", event("c", {"id": 1}, 1) + "\n")
    ingest_all(spark, storage, config)  # creates bronze, then appends
    monkeypatch.setattr(ingest, "ONE_TASK_BYTES", 10)
    land(config, "002.jsonl", event("c", {"id": 2}, 2) + "\n")
    ingest_all(spark, storage, config)
    assert appended == [True, False]
    assert sorted(
        r["id"] for r in storage.read(config.bronze_path("customers")).select("_after.id").collect()
    ) == [1, 2]


def test_a_small_batch_costs_two_spark_jobs_one_for_its_schemas_one_counting_and_bringing_its_events(
    spark, storage, tmp_path
):
    # What a scheduled run's batch costs in ingest on either backend: the lines are parsed once
    # more to count them, and that job brings the events to the driver (none is written by Spark).
    from cdc_join.report import SparkJobs

    config = pipeline(tmp_path)
    land(config, "001.jsonl", event("c", {"id": 1}, 1) + "\n")
    ingest_all(spark, storage, config)  # creates bronze and the ingest log
    land(config, "002.jsonl", "\n".join([event("u", {"id": 1}, 2), event("c", {"id": 2}, 3)]) + "\n")
    with SparkJobs(spark).group("ingest") as jobs:
        assert ingest_all(spark, storage, config)["customers"].events == 2
        assert jobs() == 2
    assert bronze_keys(spark, storage, config) == [("001.jsonl", 1), ("002.jsonl", 1), ("002.jsonl", 2)]
