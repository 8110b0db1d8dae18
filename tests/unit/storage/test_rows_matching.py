"""storage.base.rows_matching: the keyed read on the driver, streamed file by file."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from cdc_join.storage import base
from cdc_join.storage.base import rows_matching

SCHEMA = pa.schema([("id", pa.int64()), ("v", pa.string()), ("added", pa.int64())])


def _file(tmp_path, name, table):
    path = str(tmp_path / name)
    pq.write_table(table, path, row_group_size=3)
    return path


@pytest.fixture
def streamed(monkeypatch):
    """Fail the test if a file is scanned by Arrow's dataset scanner instead of streamed."""

    def refuse(*args):
        raise AssertionError("scanned, not streamed")

    monkeypatch.setattr(base, "_scanned", refuse)


def _dataset(paths, schema=SCHEMA):
    return ds.dataset(sorted(paths), schema=schema, format="parquet")


def test_it_returns_the_rows_of_the_wanted_keys_from_every_file_and_batch(tmp_path, monkeypatch, streamed):
    monkeypatch.setattr(base, "KEYED_BATCH_ROWS", 2)  # many batches per file
    first = _file(
        tmp_path, "a.parquet", pa.table({"id": [1, 2, 3, 4, 5], "v": list("abcde"), "added": [None] * 5})
    )
    second = _file(
        tmp_path, "b.parquet", pa.table({"id": [5, 6, None, 8], "v": list("fghi"), "added": [1, 2, 3, 4]})
    )

    found = rows_matching(_dataset([first, second]), "id", [2, 5, 8, None, 99])

    assert found.schema == SCHEMA
    assert sorted(found.to_pylist(), key=lambda r: (r["id"], r["v"])) == [
        {"id": 2, "v": "b", "added": None},
        {"id": 5, "v": "e", "added": None},
        {"id": 5, "v": "f", "added": 1},
        {"id": 8, "v": "i", "added": 4},
    ]


def test_a_null_key_matches_nothing_and_no_wanted_key_gives_an_empty_table(tmp_path, streamed):
    path = _file(tmp_path, "a.parquet", pa.table({"id": [None, 1], "v": ["x", "y"], "added": [1, 2]}))

    assert rows_matching(_dataset([path]), "id", [None]).num_rows == 0
    assert rows_matching(_dataset([path]), "id", []).schema == SCHEMA


def test_columns_a_file_lacks_read_as_null_and_narrower_types_are_widened(tmp_path, streamed):
    # A file written before a column was added, and one written while `id` was an int.
    old = _file(tmp_path, "old.parquet", pa.table({"id": [1, 2], "v": ["a", "b"]}))
    narrow = _file(
        tmp_path,
        "narrow.parquet",
        pa.table({"id": pa.array([2, 3], pa.int32()), "v": ["c", "d"], "added": [7, 8]}),
    )

    found = rows_matching(_dataset([old, narrow]), "id", [2])

    found.validate(full=True)
    assert found.schema == SCHEMA
    assert [b.schema == SCHEMA for b in found.to_batches()] == [True, True]

    assert sorted(found.to_pylist(), key=lambda r: r["v"]) == [
        {"id": 2, "v": "b", "added": None},
        {"id": 2, "v": "c", "added": 7},
    ]


def test_a_file_the_stream_cannot_cast_is_scanned_by_the_dataset(tmp_path):
    # A struct that gained a field: Arrow's cast refuses it, the dataset scanner reads it
    # (or fails the same way the scanner always did).
    schema = pa.schema([("id", pa.int64()), ("s", pa.struct([("a", pa.int64()), ("b", pa.int64())]))])
    path = _file(tmp_path, "a.parquet", pa.table({"id": [1, 2], "s": [{"a": 1}, {"a": 2}]}))
    dataset = _dataset([path], schema)
    try:
        expected = dataset.to_table(filter=ds.field("id").isin(pa.array([2]))).to_pylist()
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
        with pytest.raises(type(exc)):
            rows_matching(dataset, "id", [2])
        return
    assert rows_matching(dataset, "id", [2]).to_pylist() == expected


def test_a_partition_s_rows_carry_its_partition_value(tmp_path):
    (tmp_path / "p=1").mkdir()
    pq.write_table(pa.table({"id": [1, 2]}), str(tmp_path / "p=1" / "f.parquet"))
    dataset = ds.dataset(str(tmp_path), format="parquet", partitioning="hive")

    found = rows_matching(dataset, "id", [2])

    assert found.to_pylist() == [{"id": 2, "p": 1}]
