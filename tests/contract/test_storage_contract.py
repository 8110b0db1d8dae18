"""The storage contract: every backend behaves the same on the operations a run uses.

One suite, parametrized over the backends. The delta-spark run is skipped, with the reason
``delta_jars_available`` gives, where Spark cannot load the Delta jars.
"""

from __future__ import annotations

import itertools
import random
import shutil
import threading
import time
import uuid
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path

import deltalake
import pyarrow as pa
import pytest
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    DateType,
    DecimalType,
    DoubleType,
    IntegerType,
    LongType,
    MapType,
    NullType,
    StringType,
    StructField,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from cdc_join.changeset import arrow_schema, from_arrow, materialize
from cdc_join.errors import ConcurrentRunError, StorageError
from cdc_join.storage import MergeSpec, Storage, delta_rs, get_storage
from cdc_join.storage.base import FileStats
from cdc_join.storage.pruning import read_keyed
from cdc_join.storage.select import ENV_VAR, delta_jars_available

BACKENDS = ["delta-rs", "delta-spark"]

KV = StructType(
    [
        StructField("id", LongType(), False),
        StructField("seq", LongType(), True),
        StructField("v", StringType(), True),
    ]
)
KV_DDL = "id long, seq long, v string"


@pytest.fixture(params=BACKENDS)
def store(request, spark) -> Storage:
    name = request.param
    if name == "delta-spark":
        available, reason = delta_jars_available(spark)
        if not available:
            pytest.skip(f"delta-spark backend: {reason}")
    return get_storage(spark, name)


@pytest.fixture
def spark_store(spark) -> Storage:
    """The delta-spark backend alone, for checks of how it calls Delta (skipped without the jars)."""
    available, reason = delta_jars_available(spark)
    if not available:
        pytest.skip(f"delta-spark backend: {reason}")
    return get_storage(spark, "delta-spark")


def rows(df, *order_by: str) -> list[dict]:
    """Collect ``df`` as dicts, sorted by ``order_by`` (default: all columns)."""
    data = [r.asDict(recursive=True) for r in df.collect()]
    keys = order_by or tuple(df.columns)
    return sorted(data, key=lambda d: tuple((d[k] is None, d[k]) for k in keys))


def kv_table(store: Storage, spark, path: str, data: list[tuple] | None = None) -> None:
    assert store.create(path, KV) is True
    if data:
        store.append(path, spark.createDataFrame(data, KV_DDL))


# --------------------------------------------------------------------------- create / read


def test_create_is_create_if_absent(store, spark, tmp_path):
    path = str(tmp_path / "t")
    assert not store.exists(path)
    assert store.create(path, KV) is True
    assert store.exists(path)
    assert store.version(path) == 0
    assert store.read(path).count() == 0
    store.append(path, spark.createDataFrame([(1, 1, "a")], KV_DDL))

    assert store.create(path, KV) is False
    assert store.version(path) == 1
    assert rows(store.read(path)) == [{"id": 1, "seq": 1, "v": "a"}]
    schema = store.schema(path)
    assert [(f.name, f.dataType, f.nullable) for f in schema.fields] == [
        ("id", LongType(), False),
        ("seq", LongType(), True),
        ("v", StringType(), True),
    ]


def _create_at_once(store: Storage, path: str) -> list[object]:
    """What two writers creating ``path`` at the same moment get: a bool, "lost" or an error."""
    start = threading.Barrier(2, timeout=60)
    outcomes: list[object] = []

    def create() -> None:
        start.wait()
        try:
            outcomes.append(store.create(path, KV))
        except ConcurrentRunError:
            outcomes.append("lost")
        except Exception as exc:
            outcomes.append(exc)

    threads = [threading.Thread(target=create) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes


def test_two_writers_creating_one_table_at_once_never_fail_with_a_storage_error(store, tmp_path, monkeypatch):
    # Two runs creating the same bronze table on their first run: one creates it, the other
    # finds it (False) or stops as a lost race; never a StorageError (CI once saw one on Spark).
    # Each writer's first probe says "no table", as when both probe before either commits.
    probe = store.exists
    probed: set[tuple[int, str]] = set()

    def exists(path: str) -> bool:
        first = (threading.get_ident(), path) not in probed
        probed.add((threading.get_ident(), path))
        return False if first else probe(path)

    monkeypatch.setattr(store, "exists", exists)
    for n in range(4):
        path = str(tmp_path / f"t{n}")
        outcomes = _create_at_once(store, path)
        assert sorted(map(str, outcomes)) in (["False", "True"], ["True", "lost"]), outcomes
        assert store.version(path) == 0


def test_a_create_in_a_folder_of_other_files_fails_at_once_naming_it(store, tmp_path):
    path = tmp_path / "t"
    path.mkdir()
    (path / "notes.csv").write_text("a,b\n")
    began = time.monotonic()
    with pytest.raises(StorageError, match="t"):
        store.create(str(path), KV)
    assert time.monotonic() - began < 20


def test_a_write_expecting_a_version_fails_once_another_writer_moved_the_table(store, spark, tmp_path):
    path = str(tmp_path / "t")
    kv_table(store, spark, path, [(1, 1, "a")])
    seen = store.version(path)
    store.append(path, spark.createDataFrame([(2, 1, "b")], KV_DDL), expected_version=seen)  # the winner
    late = spark.createDataFrame([(3, 1, "c")], KV_DDL)
    for write in (
        lambda: store.append(path, late, expected_version=seen),
        lambda: store.overwrite(path, late, expected_version=seen),
        lambda: store.merge(path, late, MergeSpec(on="t.id = s.id"), expected_version=seen),
    ):
        with pytest.raises(ConcurrentRunError):
            write()
    assert sorted(r["id"] for r in rows(store.read(path))) == [1, 2]
    assert store.version(path) == seen + 1


@pytest.mark.parametrize("kind", ["append", "append of rows on the driver", "overwrite", "merge"])
def test_racing_writes_expecting_one_version_commit_once(store, spark, tmp_path, kind):
    # Both writers pass the version check before either commits (as two runs committing their
    # checkpoint at the same moment, or a full refresh overwriting state a run appends to): the
    # commit itself must refuse the second, whatever the write (rows on the driver, as a run's
    # state, subscriptions and run log are, take a path of their own on delta-spark).
    path = str(tmp_path / "t")
    kv_table(store, spark, path, [(1, 1, "a")])
    seen = store.version(path)
    # Where each backend checks the version before it writes: delta-rs opens the table at it,
    # delta-spark compares it with the latest.
    name = "_load_for_write" if isinstance(store, delta_rs.DeltaRsStorage) else "_check_version"
    check = getattr(type(store), name)
    start = threading.Barrier(2, timeout=60)

    def checked_then_wait(self, *args, **kwargs):
        found = check(self, *args, **kwargs)
        start.wait()
        return found

    outcomes: list[str] = []

    def write(n: int) -> None:
        rows_of_n = spark.createDataFrame([(10 + n, 1, "x")], KV_DDL)
        try:
            if kind == "append of rows on the driver":
                driver = pa.Table.from_pylist([{"id": 10 + n, "seq": 1, "v": "x"}], arrow_schema(KV))
                store.append(path, from_arrow(spark, KV, driver), expected_version=seen)
            elif kind == "merge":
                store.merge(path, rows_of_n, MergeSpec(on="t.id = s.id"), expected_version=seen)
            else:
                getattr(store, kind)(path, rows_of_n, expected_version=seen)
            outcomes.append("committed")
        except ConcurrentRunError:
            outcomes.append("lost")

    threads = [threading.Thread(target=write, args=(n,), name=f"writer{n}") for n in range(2)]
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(type(store), name, checked_then_wait)
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert sorted(outcomes) == ["committed", "lost"]
    assert len(rows(store.read(path))) == (1 if kind == "overwrite" else 2)
    assert store.version(path) == seen + 1


def test_delta_spark_tells_commit_conflicts_from_other_failures():
    from delta.exceptions.base import ConcurrentAppendException, ConcurrentTransactionException

    from cdc_join.storage.delta_spark import _spark_errors, is_conflict

    assert is_conflict(ConcurrentAppendException("Files were added by a concurrent update."))
    assert is_conflict(ConcurrentTransactionException("This error occurs when multiple queries..."))
    # Over Spark Connect the class may not come through; Delta's error class does.
    assert is_conflict(RuntimeError("[DELTA_CONCURRENT_APPEND] Transaction conflict detected."))
    assert not is_conflict(RuntimeError("[DELTA_TABLE_NOT_FOUND] Delta table `t` doesn't exist."))
    with (
        pytest.raises(ConcurrentRunError, match="another writer committed first"),
        _spark_errors("append to", "/lake/t"),
    ):
        raise ConcurrentAppendException("Files were added by a concurrent update.")


def test_create_accepts_file_uri_and_properties(store, spark, tmp_path):
    uri = (tmp_path / "t").as_uri()
    assert store.create(uri, KV, properties={"delta.appendOnly": "false"}) is True
    assert store.exists(str(tmp_path / "t"))
    store.append(uri, spark.createDataFrame([(1, 1, "a")], KV_DDL))
    assert rows(store.read(str(tmp_path / "t"))) == [{"id": 1, "seq": 1, "v": "a"}]


def test_missing_table_raises_storage_error(store, tmp_path):
    path = str(tmp_path / "nothing")
    assert not store.exists(path)
    with pytest.raises(StorageError, match="nothing"):
        store.read(path)
    with pytest.raises(StorageError):
        store.version(path)


def test_append_and_read_old_version(store, spark, tmp_path):
    path = str(tmp_path / "t")
    kv_table(store, spark, path)
    m1 = store.append(path, spark.createDataFrame([(1, 1, "a"), (2, 1, "b")], KV_DDL))
    assert m1.version == 1
    assert m1.rows_inserted == 2
    assert m1.files_added is not None and m1.files_added >= 1
    # Columns are matched by name, not position.
    m2 = store.append(path, spark.createDataFrame([("c", 3, 1)], "v string, id long, seq long"))
    assert m2.version == 2

    assert rows(store.read(path), "id") == [
        {"id": 1, "seq": 1, "v": "a"},
        {"id": 2, "seq": 1, "v": "b"},
        {"id": 3, "seq": 1, "v": "c"},
    ]
    assert [r["id"] for r in rows(store.read(path, version=1), "id")] == [1, 2]
    assert store.read(path, version=0).count() == 0
    assert store.read(path).schema.names == ["id", "seq", "v"]
    with pytest.raises(StorageError):
        store.read(path, version=99)


def test_files_stats_and_read_of_a_subset(store, spark, tmp_path):
    path = str(tmp_path / "t")
    kv_table(store, spark, path)
    for lo in (0, 100, 200):
        batch = spark.createDataFrame([(lo + i, 1, None if i == 0 else "x") for i in range(10)], KV_DDL)
        store.append(path, batch.coalesce(1))

    files = store.files(path)
    assert len(files) == 3
    by_min = sorted(files, key=lambda f: f.min_values["id"])
    assert [(f.min_values["id"], f.max_values["id"]) for f in by_min] == [(0, 9), (100, 109), (200, 209)]
    assert all(f.num_records == 10 for f in files)
    assert all(f.size_bytes > 0 for f in files)
    assert all(f.null_counts["v"] == 1 for f in files)

    middle = by_min[1]
    subset = store.read(path, files=[middle.path])
    assert [r["id"] for r in rows(subset, "id")] == list(range(100, 110))
    assert store.read(path, files=[]).count() == 0
    assert store.read(path, files=[by_min[0].path, by_min[2].path]).count() == 20
    with pytest.raises(StorageError, match="not a data file"):
        store.read(path, files=[str(tmp_path / "t" / "part-00000-nope.parquet")])

    # An older version lists only the files it had.
    assert len(store.files(path, version=1)) == 1


def test_table_root_with_a_space(store, spark, tmp_path):
    path = str(tmp_path / "a b" / "t")
    kv_table(store, spark, path, [(1, 1, "a")])
    (f,) = store.files(path)
    assert rows(store.read(path, files=[f.path])) == [{"id": 1, "seq": 1, "v": "a"}]
    assert store.read_changes(path, 1).count() == 1


def test_not_null_is_enforced(store, spark, tmp_path):
    path = str(tmp_path / "t")
    kv_table(store, spark, path)
    with pytest.raises(StorageError):
        store.append(path, spark.createDataFrame([(None, 1, "a")], KV_DDL))
    assert store.version(path) == 0


# --------------------------------------------------------------------------- merge


def test_merge_upsert_with_sequence_guard(store, spark, tmp_path):
    path = str(tmp_path / "t")
    kv_table(store, spark, path, [(1, 5, "a"), (2, 5, "b")])
    source = spark.createDataFrame([(1, 6, "a2"), (2, 4, "stale"), (3, 1, "c")], KV_DDL)

    m = store.merge(path, source, MergeSpec(on="t.id = s.id", update_condition="s.seq > t.seq"))

    assert rows(store.read(path), "id") == [
        {"id": 1, "seq": 6, "v": "a2"},
        {"id": 2, "seq": 5, "v": "b"},
        {"id": 3, "seq": 1, "v": "c"},
    ]
    assert m.version == 2
    assert (m.rows_inserted, m.rows_updated, m.rows_deleted) == (1, 1, 0)
    assert m.files_added is not None and m.files_added >= 1
    assert m.files_removed == 1


def test_merge_delete_condition(store, spark, tmp_path):
    path = str(tmp_path / "t")
    kv_table(store, spark, path, [(1, 1, "a"), (2, 1, "b"), (3, 1, "c")])
    source = spark.createDataFrame(
        [(1, 2, None, "d"), (2, 2, "b2", "u"), (4, 1, "new", "c"), (5, 1, None, "d")],
        "id long, seq long, v string, op string",
    )
    spec = MergeSpec(
        on="t.id = s.id",
        delete_condition="s.op = 'd' AND s.seq > t.seq",
        update_condition="s.seq > t.seq",
        insert_condition="s.op <> 'd'",
        exclude_columns=("op",),
    )

    m = store.merge(path, source, spec)

    assert rows(store.read(path), "id") == [
        {"id": 2, "seq": 2, "v": "b2"},
        {"id": 3, "seq": 1, "v": "c"},
        {"id": 4, "seq": 1, "v": "new"},
    ]
    assert (m.rows_inserted, m.rows_updated, m.rows_deleted) == (1, 1, 1)
    assert "op" not in store.schema(path).names


def test_insert_only_merge(store, spark, tmp_path):
    path = str(tmp_path / "t")
    kv_table(store, spark, path, [(1, 1, "a")])
    source = spark.createDataFrame([(1, 9, "changed"), (2, 1, "b")], KV_DDL)

    m = store.merge(path, source, MergeSpec(on="t.id = s.id", update=False))

    assert rows(store.read(path), "id") == [{"id": 1, "seq": 1, "v": "a"}, {"id": 2, "seq": 1, "v": "b"}]
    assert (m.rows_inserted, m.rows_updated) == (1, 0)


def test_merge_that_changes_nothing(store, spark, tmp_path):
    path = str(tmp_path / "t")
    kv_table(store, spark, path, [(1, 5, "a")])
    source = spark.createDataFrame([(1, 4, "stale")], KV_DDL)
    m = store.merge(path, source, MergeSpec(on="t.id = s.id", update_condition="s.seq > t.seq", insert=False))
    assert m.rows_updated == 0
    assert rows(store.read(path)) == [{"id": 1, "seq": 5, "v": "a"}]


def test_merge_exclude_columns(store, spark, tmp_path):
    path = str(tmp_path / "t")
    kv_table(store, spark, path, [(1, 1, "a")])
    # "seq" exists in the target but is excluded: updates keep it, inserts leave it null.
    # "src_seq" exists only in the source and is used by the condition only.
    source = spark.createDataFrame(
        [(1, 100, "a2", 2), (2, 100, "b", 1)], "id long, seq long, v string, src_seq long"
    )
    spec = MergeSpec(
        on="t.id = s.id",
        update_condition="s.src_seq > t.seq",
        exclude_columns=("seq", "src_seq"),
        merge_schema=True,
    )

    store.merge(path, source, spec)

    assert store.schema(path).names == ["id", "seq", "v"]
    assert rows(store.read(path), "id") == [{"id": 1, "seq": 1, "v": "a2"}, {"id": 2, "seq": None, "v": "b"}]


def test_merge_schema_adds_a_column(store, spark, tmp_path):
    path = str(tmp_path / "t")
    kv_table(store, spark, path, [(1, 1, "a"), (2, 1, "b")])
    source = spark.createDataFrame(
        [(2, 2, "b2", 2.5), (3, 1, "c", 3.5)], "id long, seq long, v string, w double"
    )

    # Without merge_schema a source-only column is ignored, like Delta's UPDATE SET *.
    store.merge(path, source, MergeSpec(on="t.id = s.id", insert=False))
    assert store.schema(path).names == ["id", "seq", "v"]

    store.merge(path, source, MergeSpec(on="t.id = s.id", merge_schema=True))

    schema = store.schema(path)
    assert schema.names == ["id", "seq", "v", "w"]
    assert schema["w"].dataType == DoubleType()
    assert schema["id"].nullable is False  # merging schemas keeps NOT NULL columns NOT NULL
    assert rows(store.read(path), "id") == [
        {"id": 1, "seq": 1, "v": "a", "w": None},
        {"id": 2, "seq": 2, "v": "b2", "w": 2.5},
        {"id": 3, "seq": 1, "v": "c", "w": 3.5},
    ]
    # Files written before the column existed read it as null.
    assert store.read(path, version=1).columns == ["id", "seq", "v"]
    changes = store.read_changes(path, 1)
    assert changes.columns == ["id", "seq", "v", "w", "_change_type", "_commit_version"]
    inserted = rows(changes.where("_change_type = 'insert'"), "id")
    assert [(r["id"], r["w"]) for r in inserted] == [(1, None), (2, None), (3, 3.5)]


def test_append_merge_schema(store, spark, tmp_path):
    path = str(tmp_path / "t")
    kv_table(store, spark, path, [(1, 1, "a")])
    store.append(
        path, spark.createDataFrame([(2, 1, "b", True)], KV_DDL + ", flag boolean"), merge_schema=True
    )
    assert rows(store.read(path), "id") == [
        {"id": 1, "seq": 1, "v": "a", "flag": None},
        {"id": 2, "seq": 1, "v": "b", "flag": True},
    ]


def test_a_table_deleted_and_created_again_has_its_new_schema(store, spark, tmp_path):
    # The schema a backend keeps for a version of a local table is that table's, not a former
    # one's at the same path and version.
    path = str(tmp_path / "t")
    kv_table(store, spark, path, [(1, 1, "a")])
    assert store.schema(path).names == ["id", "seq", "v"]
    shutil.rmtree(path)
    store.create(path, StructType([StructField("other", StringType())]))
    store.append(path, spark.createDataFrame([("x",)], "other string"))
    assert store.schema(path).names == ["other"]
    assert rows(store.read(path), "other") == [{"other": "x"}]


def test_a_schema_read_from_the_log_is_the_schema_a_read_gives(store, spark, tmp_path):
    # delta-spark reads a local table's schema from its commit files (no Spark job): it must be
    # what Spark's read of the table gives, for every type a run writes, after each commit.
    # (delta-rs's reads go through parquet, which keeps no NOT NULL: types compared alone there.)
    path = str(tmp_path / "t")

    def same(schema: StructType, read: StructType) -> bool:
        return schema == read if store.name == "delta-spark" else schema.simpleString() == read.simpleString()

    rich = StructType(
        [
            StructField("id", LongType(), False),
            StructField("amount", DecimalType(12, 2), True),
            StructField("day", DateType(), True),
            StructField("at", TimestampType(), True),
            StructField("local", TimestampNTZType(), True),
            StructField("raw", BinaryType(), True),
            StructField("tags", ArrayType(StringType()), True),
            StructField("untyped", ArrayType(NullType()), True),
            StructField("attrs", MapType(StringType(), LongType()), True),
            StructField("s", StructType([StructField("x", IntegerType()), StructField("ok", BooleanType())])),
        ]
    )
    assert store.create(path, rich)
    assert same(store.schema(path), store.read(path).schema)
    row = (
        1,
        Decimal("1.50"),
        date(2024, 1, 2),
        datetime(2024, 1, 2, tzinfo=timezone.utc),
        None,
        b"x",
        ["a"],
        [],
        {"k": 1},
        (2, True),
    )
    store.append(path, spark.createDataFrame([row], rich))
    assert same(store.schema(path), store.read(path).schema)
    wider = StructType([*rich.fields, StructField("added", StringType(), True)])
    store.evolve(path, wider)
    assert same(store.schema(path), store.read(path).schema)
    assert store.schema(path).names[-1] == "added"


def test_evolve_adds_columns_and_widens_types_keeping_rows(store, spark, tmp_path):
    path = str(tmp_path / "t")
    nested = StructType(
        [
            StructField("id", LongType(), False),
            StructField("n", IntegerType(), True),
            StructField("s", StructType([StructField("x", IntegerType()), StructField("d", DateType())])),
        ]
    )
    assert store.create(path, nested)
    store.append(path, spark.createDataFrame([(1, 7, (2, date(2024, 1, 2)))], nested))
    assert store.evolve(path, nested) is False  # nothing new: no commit
    version = store.version(path)

    wider = StructType(
        [
            StructField("id", LongType(), True),
            StructField("n", LongType(), True),
            StructField(
                "s",
                StructType(
                    [
                        StructField("x", LongType()),
                        StructField("d", TimestampNTZType()),
                        StructField("y", StringType()),
                    ]
                ),
            ),
            StructField("w", DoubleType(), True),
        ]
    )
    assert store.evolve(path, wider) is True
    schema = store.schema(path)
    assert [f.dataType for f in schema.fields[1:]] == [f.dataType for f in wider.fields[1:]]
    assert schema["id"].nullable is False  # known columns keep NOT NULL
    assert rows(store.read(path)) == [
        {"id": 1, "n": 7, "s": {"x": 2, "d": datetime(2024, 1, 2), "y": None}, "w": None}
    ]
    store.append(path, spark.createDataFrame([(2, 3_000_000_000, (5_000_000_000, None, "y"), 1.5)], wider))
    assert sorted(r["n"] for r in rows(store.read(path))) == [7, 3_000_000_000]
    assert store.read(path, version=version).count() == 1

    # A change that is no widening (bigint -> string) leaves the column as it is.
    assert store.evolve(path, StructType([StructField("n", StringType())])) is False
    assert store.schema(path)["n"].dataType == LongType()


def test_columns_without_a_type_yet_are_written_read_and_typed_later(store, spark, tmp_path):
    # A source array that has held only [] or [null] is array<void> (a map of nulls, a struct
    # field inside an array likewise). Delta on Spark refuses to write a void under an array or
    # a map; the table must still hold the rows, report the void, and take the type later.
    path = str(tmp_path / "t")
    untyped = StructType(
        [
            StructField("id", LongType(), False),
            StructField("ar", ArrayType(NullType())),
            StructField("m", MapType(StringType(), NullType())),
            StructField(
                "s", StructType([StructField("in", ArrayType(NullType())), StructField("n", IntegerType())])
            ),
            StructField(
                "xs", ArrayType(StructType([StructField("x", NullType()), StructField("y", IntegerType())]))
            ),
        ]
    )
    assert store.create(path, untyped, cdf=True)
    assert store.schema(path) == untyped
    store.append(path, spark.createDataFrame([(1, [], {"k": None}, ([None], 1), [(None, 2)])], untyped))
    store.merge(
        path,
        spark.createDataFrame([(1, [None, None], None, None, []), (2, None, {}, ([], None), None)], untyped),
        MergeSpec(on="t.id = s.id"),
    )
    expected = [
        {"id": 1, "ar": [None, None], "m": None, "s": None, "xs": []},
        {"id": 2, "ar": None, "m": {}, "s": {"in": [], "n": None}, "xs": None},
    ]
    assert store.schema(path) == untyped
    assert store.read(path).schema.simpleString() == untyped.simpleString()
    assert rows(store.read(path), "id") == expected
    arrow = store.read_arrow(path, columns=["id", "ar"]).sort_by("id")
    assert arrow.schema.field("ar").type.value_type == pa.null()
    assert arrow.column("ar").to_pylist() == [[None, None], None]
    changes = store.read_changes(path, 1)
    inserted = changes.where("_change_type IN ('insert', 'update_postimage')")
    assert inserted.drop("_change_type", "_commit_version").schema.simpleString() == untyped.simpleString()
    assert sorted(
        (r["id"], r["_change_type"], r["ar"] is None, len(r["ar"] or [])) for r in rows(inserted)
    ) == [
        (1, "insert", False, 0),
        (1, "update_postimage", False, 2),
        (2, "insert", True, 0),
    ]

    # The first typed values: the columns take their types, the rows stay as they were.
    typed = StructType(
        [
            StructField("id", LongType(), False),
            StructField("ar", ArrayType(IntegerType())),
            StructField("m", MapType(StringType(), NullType())),
            StructField(
                "s", StructType([StructField("in", ArrayType(StringType())), StructField("n", IntegerType())])
            ),
            StructField(
                "xs", ArrayType(StructType([StructField("x", DateType()), StructField("y", IntegerType())]))
            ),
        ]
    )
    assert store.evolve(path, typed) is True
    assert [f.dataType for f in store.schema(path).fields] == [f.dataType for f in typed.fields]
    assert rows(store.read(path), "id") == expected
    store.merge(
        path,
        spark.createDataFrame([(3, [7], {"k": None}, (["a"], 3), [(date(2024, 1, 2), 4)])], typed),
        MergeSpec(on="t.id = s.id"),
    )
    assert rows(store.read(path), "id")[2] == {
        "id": 3,
        "ar": [7],
        "m": {"k": None},
        "s": {"in": ["a"], "n": 3},
        "xs": [{"x": date(2024, 1, 2), "y": 4}],
    }
    assert store.schema(path)["m"].dataType == MapType(StringType(), NullType())


def test_a_struct_whose_fields_have_no_type_yet_is_written_read_and_typed_later(store, spark, tmp_path):
    # A source struct whose fields have held only nulls is struct<a: void, ...>; Parquet has no
    # empty group, so Delta on Spark refuses to write it (found by the property test over
    # Connect). The table must hold the rows, report the voids, and take the types later.
    path = str(tmp_path / "t")
    voids = StructType(
        [StructField("a", NullType()), StructField("b", StructType([StructField("c", NullType())]))]
    )
    untyped = StructType(
        [
            StructField("id", LongType(), False),
            StructField("image", StructType([StructField("k", StringType()), StructField("st", voids)])),
        ]
    )
    assert store.create(path, untyped, cdf=True)
    store.append(path, spark.createDataFrame([(1, ("x", (None, (None,))))], untyped))
    store.merge(
        path,
        spark.createDataFrame([(1, ("y", None)), (2, ("z", (None, None)))], untyped),
        MergeSpec(on="t.id = s.id"),
    )
    expected = [
        {"id": 1, "image": {"k": "y", "st": None}},
        {"id": 2, "image": {"k": "z", "st": {"a": None, "b": None}}},
    ]
    assert store.schema(path) == untyped
    assert store.read(path).schema.simpleString() == untyped.simpleString()
    assert rows(store.read(path), "id") == expected

    typed = StructType(
        [
            StructField("id", LongType(), False),
            StructField(
                "image",
                StructType(
                    [
                        StructField("k", StringType()),
                        StructField(
                            "st",
                            StructType(
                                [
                                    StructField("a", IntegerType()),
                                    StructField("b", StructType([StructField("c", NullType())])),
                                ]
                            ),
                        ),
                    ]
                ),
            ),
        ]
    )
    assert store.evolve(path, typed) is True
    assert [f.dataType for f in store.schema(path).fields] == [f.dataType for f in typed.fields]
    store.merge(path, spark.createDataFrame([(3, ("w", (7, (None,))))], typed), MergeSpec(on="t.id = s.id"))
    assert rows(store.read(path), "id") == [
        *expected,
        {"id": 3, "image": {"k": "w", "st": {"a": 7, "b": {"c": None}}}},
    ]


def test_a_merge_that_would_type_a_column_stored_untyped_asks_for_evolve_first(spark_store, spark, tmp_path):
    # Delta's MERGE would cast the values to the string an untyped column is stored as, and
    # they would read back as null.
    path = str(tmp_path / "t")
    untyped = StructType([StructField("id", LongType()), StructField("ar", ArrayType(NullType()))])
    spark_store.create(path, untyped)
    typed = spark.createDataFrame([(1, [7])], "id long, ar array<int>")
    with pytest.raises(StorageError, match=r"'ar' .* has no type yet .* evolve"):
        spark_store.merge(path, typed, MergeSpec(on="t.id = s.id"))
    assert spark_store.read(path).count() == 0


@pytest.mark.parametrize("write", ["append", "overwrite"])
def test_an_append_or_overwrite_that_would_type_a_column_stored_untyped_asks_for_evolve_first(
    spark_store, spark, tmp_path, write
):
    # As a MERGE: the values would be cast to the string the column is stored as, and read as null.
    path = str(tmp_path / "t")
    untyped = StructType([StructField("id", LongType()), StructField("ar", ArrayType(NullType()))])
    spark_store.create(path, untyped)
    typed = spark.createDataFrame([(1, [7])], "id long, ar array<int>")
    with pytest.raises(StorageError, match=r"'ar' .* has no type yet .* evolve"):
        getattr(spark_store, write)(path, typed)
    assert spark_store.read(path).count() == 0
    spark_store.evolve(path, typed.schema)
    getattr(spark_store, write)(path, typed)
    assert [tuple(r) for r in spark_store.read(path).collect()] == [(1, [7])]


def test_merge_without_any_clause_is_rejected(store, spark, tmp_path):
    path = str(tmp_path / "t")
    kv_table(store, spark, path)
    with pytest.raises(ValueError, match="no clause"):
        store.merge(
            path, spark.createDataFrame([], KV_DDL), MergeSpec(on="t.id = s.id", update=False, insert=False)
        )


def test_merge_of_an_empty_source(store, spark, tmp_path):
    path = str(tmp_path / "t")
    kv_table(store, spark, path, [(1, 1, "a")])
    m = store.merge(path, spark.createDataFrame([], KV_DDL), MergeSpec(on="t.id = s.id"))
    assert (m.rows_inserted, m.rows_updated, m.rows_deleted) in ((0, 0, 0), (None, None, None))
    assert rows(store.read(path)) == [{"id": 1, "seq": 1, "v": "a"}]


# --------------------------------------------------------------------------- change data feed


def test_read_changes(store, spark, tmp_path):
    path = str(tmp_path / "t")
    kv_table(store, spark, path, [(1, 1, "a"), (2, 1, "b")])  # v1
    store.merge(
        path, spark.createDataFrame([(1, 2, "a2"), (3, 1, "c")], KV_DDL), MergeSpec(on="t.id = s.id")
    )  # v2
    store.delete(path, "id = 2")  # v3

    changes = store.read_changes(path, 1)

    assert changes.columns == ["id", "seq", "v", "_change_type", "_commit_version"]
    assert changes.schema["_commit_version"].dataType == LongType()
    assert changes.schema["_change_type"].dataType == StringType()
    got = rows(changes, "_commit_version", "id", "_change_type")
    assert [(r["_commit_version"], r["_change_type"], r["id"], r["v"]) for r in got] == [
        (1, "insert", 1, "a"),
        (1, "insert", 2, "b"),
        (2, "update_postimage", 1, "a2"),
        (2, "update_preimage", 1, "a"),
        (2, "insert", 3, "c"),
        (3, "delete", 2, "b"),
    ]
    only_v2 = rows(store.read_changes(path, 2, 2), "id", "_change_type")
    assert {r["_commit_version"] for r in only_v2} == {2}
    assert len(only_v2) == 3
    # An end past the latest version is clamped.
    assert store.read_changes(path, 3, 99).count() == 1


def test_the_feed_of_versions_that_only_appended_holds_their_rows_of_every_type(
    store, spark, tmp_path, monkeypatch
):
    # Bronze's case: appends of Spark's frames and of rows on the driver, an insert-only MERGE,
    # a column added, a compaction between. delta-spark reads such a feed on the driver (no
    # Spark job); with the driver path off, Delta's own reader must give the same rows.
    from cdc_join.changeset import arrow_of
    from cdc_join.storage import delta_spark

    ddl = (
        "id long, at timestamp, amount decimal(12,2), tags array<string>, attrs map<string,long>, "
        "s struct<a: int>"
    )
    path = str(tmp_path / "t")
    at = datetime(2026, 12, 7, 1, 2, 3, 456789, tzinfo=timezone.utc)
    first = (1, at, Decimal("1.25"), ["x", None], {"k": 1}, (7,))
    store.create(path, spark.createDataFrame([], ddl).schema, cdf=True)  # v0
    store.append(path, spark.createDataFrame([first], ddl))  # v1: Spark's frame
    store.append(path, materialize(spark.createDataFrame([(2, None, None, None, None, None)], ddl)))  # v2
    store.optimize(path)  # v3: no change
    later = spark.createDataFrame([(3, at, Decimal("-2.50"), [], {}, None, "new")], ddl + ", extra string")
    store.append(path, later, merge_schema=True)  # v4
    store.merge(
        path,
        spark.createDataFrame([(4, None, None, None, None, None, "m")], ddl + ", extra string"),
        MergeSpec(on="t.id = s.id", update=False),
    )  # v5: inserts only

    changes = store.read_changes(path, 1)

    got = rows(changes, "id")
    assert [(r["id"], r["_change_type"], r["_commit_version"]) for r in got] == [
        (1, "insert", 1),
        (2, "insert", 2),
        (3, "insert", 4),
        (4, "insert", 5),
    ]
    assert got[0]["at"].astimezone(timezone.utc) == at and got[0]["amount"] == Decimal("1.25")
    assert (got[0]["tags"], got[0]["attrs"], got[0]["s"], got[0]["extra"]) == (
        ["x", None],
        {"k": 1},
        {"a": 7},
        None,
    )
    assert (got[2]["tags"], got[2]["attrs"], got[2]["extra"]) == ([], {}, "new")
    assert changes.schema["_commit_version"].dataType == LongType()
    if store.name == "delta-spark":
        assert arrow_of(changes) is not None  # read on the driver
        with monkeypatch.context() as patched:
            patched.setattr(delta_spark, "SMALL_FEED_BYTES", -1)
            by_spark = store.read_changes(path, 1)
            assert arrow_of(by_spark) is None
            assert (rows(by_spark, "id"), by_spark.schema) == (got, changes.schema)
        # v6: a version that removes rows (here without deletion vectors) is read by Spark.
        store.overwrite(path, later)
        assert arrow_of(store.read_changes(path, 1)) is None
        assert sorted({r["_change_type"] for r in rows(store.read_changes(path, 6))}) == ["delete", "insert"]


def test_a_small_snapshot_is_read_on_the_driver_as_the_table_s_reader_reads_it(
    store, spark, tmp_path, monkeypatch
):
    # A small local table (bronze, state and subscription tables of a run's first read, a
    # rebuild's input, verify's reads) is read on the driver with its Arrow rows attached; with
    # that path off, the backend's Spark reader must give the same rows and schema, for every
    # version, types that Arrow and Spark hold differently, and files written before a column
    # was added.
    from cdc_join.changeset import arrow_of
    from cdc_join.storage import delta_spark

    ddl = "id long not null, at timestamp, amount decimal(12,2), tags array<string>, s struct<a: int>"
    path = str(tmp_path / "t")
    at = datetime(2026, 12, 7, 1, 2, 3, 456789, tzinfo=timezone.utc)
    schema = spark.createDataFrame([], ddl).schema
    store.create(path, schema, cdf=True)  # v0
    store.append(path, spark.createDataFrame([(1, at, Decimal("1.25"), ["x", None], (7,))], schema))  # v1
    later = spark.createDataFrame([(2, None, None, [], None, "new")], ddl + ", extra string")
    store.append(path, later, merge_schema=True)  # v2
    module = delta_spark if store.name == "delta-spark" else delta_rs

    for version in (None, 1, 2, 0):
        small = store.read(path, version)
        assert arrow_of(small) is not None, version  # read on the driver
        with monkeypatch.context() as patched:
            patched.setattr(module, "SMALL_READ_BYTES", -1)
            by_spark = store.read(path, version)
            assert arrow_of(by_spark) is None
            assert (rows(small, "id"), small.schema) == (rows(by_spark, "id"), by_spark.schema), version
    got = rows(store.read(path), "id")
    assert got[0]["at"].astimezone(timezone.utc) == at and got[0]["extra"] is None
    assert (got[1]["tags"], got[1]["extra"]) == ([], "new")
    if store.name == "delta-spark":
        # Rows hidden by a deletion vector (silver's case): Delta's reader reads the table.
        hidden = str(tmp_path / "dv")
        kv_table(store, spark, hidden, [(1, 1, "a"), (2, 1, "b"), (3, 1, "c")])
        spark.sql(f"ALTER TABLE delta.`{hidden}` SET TBLPROPERTIES ('delta.enableDeletionVectors' = 'true')")
        store.delete(hidden, "id = 2")
        assert any(f.deleted_rows for f in store.files(hidden))
        assert arrow_of(store.read(hidden)) is None
        assert [r["id"] for r in rows(store.read(hidden), "id")] == [1, 3]


def test_set_properties_turns_the_change_feed_off_and_on_again(store, spark, tmp_path):
    path = str(tmp_path / "t")
    kv_table(store, spark, path, [(1, 1, "a"), (2, 1, "b")])  # v1, with a change feed
    feed = "delta.enableChangeDataFeed"

    assert store.set_properties(path, {feed: "false"}) is True  # v2
    assert store.set_properties(path, {feed: "false"}) is False  # nothing to change: no commit
    assert store.version(path) == 2
    store.merge(path, spark.createDataFrame([(1, 2, "a2")], KV_DDL), MergeSpec(on="t.id = s.id"))  # v3
    # Off, the update wrote no change data (its pre-image was not read to be kept).
    assert not (tmp_path / "t" / "_change_data").exists()
    assert deltalake.DeltaTable(path).metadata().configuration[feed] == "false"

    assert store.set_properties(path, {feed: "true"}) is True  # v4
    store.merge(path, spark.createDataFrame([(2, 2, "b2")], KV_DDL), MergeSpec(on="t.id = s.id"))  # v5
    got = rows(store.read_changes(path, 5), "id", "_change_type")
    assert [(r["_change_type"], r["v"]) for r in got] == [
        ("update_postimage", "b2"),
        ("update_preimage", "b"),
    ]
    assert rows(store.read(path), "id") == [{"id": 1, "seq": 2, "v": "a2"}, {"id": 2, "seq": 2, "v": "b2"}]


def test_read_changes_empty_range(store, spark, tmp_path):
    path = str(tmp_path / "t")
    kv_table(store, spark, path, [(1, 1, "a")])
    latest = store.version(path)
    for start, end in ((latest + 1, None), (latest + 5, latest + 9), (1, 0)):
        empty = store.read_changes(path, start, end)
        assert empty.count() == 0
        assert empty.columns == ["id", "seq", "v", "_change_type", "_commit_version"]
        assert empty.schema["_commit_version"].dataType == LongType()
    # The same schema as a non-empty feed.
    assert empty.schema == store.read_changes(path, 1).schema


def test_read_changes_ignores_optimize_and_sees_overwrite(store, spark, tmp_path):
    path = str(tmp_path / "t")
    kv_table(store, spark, path, [(1, 1, "a")])
    store.append(path, spark.createDataFrame([(2, 1, "b")], KV_DDL))
    m = store.optimize(path)
    assert m.version == 3
    assert store.read_changes(path, 3, 3).count() == 0

    store.overwrite(path, spark.createDataFrame([(9, 1, "z")], KV_DDL))
    got = rows(store.read_changes(path, 4), "_change_type", "id")
    assert [(r["_change_type"], r["id"]) for r in got] == [("delete", 1), ("delete", 2), ("insert", 9)]


@pytest.mark.parametrize(
    ("later", "row"),
    [
        ("id long, n long", (2, 2**40)),  # widened in place (type widening)
        ("id long, n int, w double", (2, 5, 0.5)),  # a column added
    ],
    ids=["widened", "added"],
)
def test_read_changes_across_a_schema_change(store, spark, tmp_path, later, row):
    # Bronze's schema changes between runs (a wider type in new events); the next run reads
    # the change feed across that commit. A backend gives every row in the latest schema, or
    # refuses at the call (then bronze reads the added files): never once rows are read, as
    # Delta (Spark) does on its own across a widened type.
    path = str(tmp_path / "t")
    first = StructType([StructField("id", LongType(), False), StructField("n", IntegerType(), True)])
    assert store.create(path, first)
    store.append(path, spark.createDataFrame([(1, 7)], first))
    start = store.version(path)
    wider = spark.createDataFrame([row], later).schema
    store.evolve(path, wider)
    store.append(path, spark.createDataFrame([row], wider), merge_schema=True)
    try:
        changes = store.read_changes(path, start)
    except StorageError as refused:
        assert "schema change" in str(refused)
        return
    got = sorted((r["id"], r["_change_type"]) for r in changes.collect())
    assert (1, "insert") in got and (2, "insert") in got
    assert [f.name for f in changes.schema.fields][: len(wider.fields)] == wider.names
    assert changes.schema["n"].dataType == wider["n"].dataType


def test_read_changes_before_a_later_schema_change(store, spark, tmp_path):
    # An ingest that overlaps a run widens a type after the version the run pinned: the run
    # still reads its range, in that range's rows (or is refused at the call, as above).
    path = str(tmp_path / "t")
    first = StructType([StructField("id", LongType(), False), StructField("n", IntegerType(), True)])
    assert store.create(path, first)
    start = store.version(path) + 1
    store.append(path, spark.createDataFrame([(1, 7)], first))
    pinned = store.version(path)
    wider = spark.createDataFrame([(2, 2**40)], "id long, n long").schema
    store.evolve(path, wider)
    store.append(path, spark.createDataFrame([(2, 2**40)], wider))
    try:
        changes = store.read_changes(path, start, pinned)
    except StorageError as refused:
        assert "schema change" in str(refused)
        return
    assert [(r["id"], r["n"], r["_change_type"]) for r in changes.collect()] == [(1, 7, "insert")]


def test_read_changes_needs_cdf(store, spark, tmp_path):
    path = str(tmp_path / "t")
    assert store.create(path, KV, cdf=False)
    store.append(path, spark.createDataFrame([(1, 1, "a")], KV_DDL))
    with pytest.raises(StorageError):
        store.read_changes(path, 0).collect()


# --------------------------------------------------------------------------- maintenance


def test_optimize_zorder_narrows_file_ranges(store, spark, tmp_path):
    path = str(tmp_path / "t")
    schema = StructType(
        [StructField("x", LongType()), StructField("y", LongType()), StructField("pad", StringType())]
    )
    assert store.create(path, schema)
    rng = random.Random(7)
    for _ in range(4):
        data = [(rng.randrange(10_000), rng.randrange(10_000), "p" * 20) for _ in range(2_000)]
        store.append(path, spark.createDataFrame(data, "x long, y long, pad string").coalesce(1))
    before = store.files(path)
    width_before = sum(f.max_values["x"] - f.min_values["x"] for f in before)

    m = store.optimize(path, zorder_by=["x"], target_size=20_000)

    after = store.files(path)
    assert m.version == 5
    assert m.files_removed == 4
    assert m.files_added == len(after) > 1
    assert store.read(path).count() == 8_000
    width_after = sum(f.max_values["x"] - f.min_values["x"] for f in after)
    assert width_after < width_before / 2
    # Ordered by x, the files' ranges barely overlap.
    spans = sorted((f.min_values["x"], f.max_values["x"]) for f in after)
    assert all(prev[1] <= nxt[0] + 50 for prev, nxt in itertools.pairwise(spans))


def test_optimize_compacts(store, spark, tmp_path):
    path = str(tmp_path / "t")
    kv_table(store, spark, path, [(1, 1, "a")])
    store.append(path, spark.createDataFrame([(2, 1, "b")], KV_DDL))
    assert len(store.files(path)) == 2
    m = store.optimize(path)
    assert len(store.files(path)) == 1
    assert (m.files_added, m.files_removed) == (1, 2)
    assert rows(store.read(path), "id") == [{"id": 1, "seq": 1, "v": "a"}, {"id": 2, "seq": 1, "v": "b"}]


def test_optimize_purge_rewrites_the_rows_deletion_vectors_hide(store, spark, tmp_path):
    path = str(tmp_path / "t")
    kv_table(store, spark, path, [(1, 1, "a"), (2, 1, "b"), (3, 1, "c")])
    store.append(path, spark.createDataFrame([(4, 1, "d")], KV_DDL))
    store.delete(path, "id IN (1, 2)")
    before = store.files(path)
    assert sum(f.num_records or 0 for f in before) == 2
    # delta-spark marks deleted rows in a deletion vector (a file whose rows all go is removed);
    # delta-rs rewrites the file.
    assert (sum(f.deleted_rows for f in before) > 0) == (store.name == "delta-spark")
    m = store.optimize(path, purge=True)
    after = store.files(path)
    assert sum(f.deleted_rows for f in after) == 0
    assert sum(f.num_records or 0 for f in after) == 2
    assert rows(store.read(path), "id") == [{"id": 3, "seq": 1, "v": "c"}, {"id": 4, "seq": 1, "v": "d"}]
    if store.name == "delta-spark":
        assert m.extra["operation"] == "REORG"
        assert store.history(path, 1)[0]["operation"] == "REORG"


def test_rows_read_on_the_driver_are_the_live_rows_of_a_table_whose_rows_were_deleted(store, spark, tmp_path):
    # delta-spark hides deleted rows in deletion vectors, which pyarrow datasets cannot apply:
    # its driver-side read is delta-rs's QueryBuilder (silver's hashes of the changed keys).
    path = str(tmp_path / "t")
    kv_table(store, spark, path, [(1, 1, "a"), (2, 1, "it's"), (3, 1, "c"), (4, 1, "d")])
    store.delete(path, "id IN (1, 3)")
    assert (sum(f.deleted_rows for f in store.files(path)) > 0) == (store.name == "delta-spark")
    found = store.read_rows(path, "id", [4, 1, 2, 2, None], columns=["v", "id"])
    assert found is not None
    assert found.schema.names == ["v", "id"]
    assert sorted(found.to_pylist(), key=lambda r: r["id"]) == [{"v": "it's", "id": 2}, {"v": "d", "id": 4}]
    assert store.read_rows(path, "v", ["it's", "a"]).to_pylist() == [{"id": 2, "seq": 1, "v": "it's"}]
    assert store.read_rows(path, "id", [], columns=["id"]).num_rows == 0
    assert store.read_rows(path, "id", [1], version=1).to_pylist() == [{"id": 1, "seq": 1, "v": "a"}]


def test_overwrite(store, spark, tmp_path):
    path = str(tmp_path / "t")
    kv_table(store, spark, path, [(1, 1, "a"), (2, 1, "b")])
    m = store.overwrite(path, spark.createDataFrame([(3, 1, "c")], KV_DDL))
    assert m.version == 2
    assert m.rows_inserted == 1
    assert rows(store.read(path)) == [{"id": 3, "seq": 1, "v": "c"}]
    assert store.read(path, version=1).count() == 2


def test_an_overwrite_of_rows_on_the_driver_keeps_the_feed_and_the_guard(store, spark, tmp_path):
    """Rows on the driver (a small table's rebuilt state): on delta-spark the table is rewritten
    here in one transaction, which must give the feed exactly the rows it held as deletes (not
    those a deletion vector hid) and the new ones as inserts, and commit guarded only at the
    version it expects, unguarded on top of whatever the table holds."""
    path = str(tmp_path / "t")
    kv_table(store, spark, path, [(1, 1, "a"), (2, 1, "b")])  # v1
    store.append(path, spark.createDataFrame([(3, 1, "c")], KV_DDL))  # v2: a second file
    store.delete(path, "id = 2")  # v3
    new = materialize(spark.createDataFrame([(9, 1, "z"), (1, 2, "a2")], KV_DDL))
    with pytest.raises(ConcurrentRunError):  # the table moved past the version expected
        store.overwrite(path, new, expected_version=2)
    assert store.version(path) == 3

    m = store.overwrite(path, new, expected_version=3)

    assert (m.version, m.rows_inserted) == (4, 2)
    assert rows(store.read(path), "id") == [{"id": 1, "seq": 2, "v": "a2"}, {"id": 9, "seq": 1, "v": "z"}]
    got = rows(store.read_changes(path, 4, 4), "_change_type", "id")
    assert [(r["_change_type"], r["id"], r["v"]) for r in got] == [
        ("delete", 1, "a"),
        ("delete", 3, "c"),
        ("insert", 1, "a2"),
        ("insert", 9, "z"),
    ]
    m = store.overwrite(path, materialize(spark.createDataFrame([(5, 1, "e")], KV_DDL)))
    assert m.version == 5 and rows(store.read(path)) == [{"id": 5, "seq": 1, "v": "e"}]
    assert rows(store.read(path, version=3), "id") == [
        {"id": 1, "seq": 1, "v": "a"},
        {"id": 3, "seq": 1, "v": "c"},
    ]


@pytest.fixture(params=["collected", "streamed"])
def write_path(request, monkeypatch):
    """delta-rs collects a small frame for a write and streams a large one through a parquet
    spill; "streamed" makes every frame large enough (no effect on delta-spark)."""
    if request.param == "streamed":
        monkeypatch.setattr(delta_rs, "SPILL_BYTES", 0)
    return request.param


def test_overwrite_with_a_whole_table_keeps_its_rows_and_their_order(store, spark, tmp_path, write_path):
    # A rebuild sorted by key must come out in key order, which is what keeps it clustered,
    # whether its rows are collected or streamed.
    path = str(tmp_path / "t")
    assert store.create(path, KV, properties={"delta.targetFileSize": "32768"})  # several files
    rebuilt = spark.range(0, 20_000, numPartitions=4).selectExpr(
        "19999 - id AS id", "CAST(1 AS BIGINT) AS seq", "CAST(id AS STRING) AS v"
    )
    m = store.overwrite(path, rebuilt.repartitionByRange(4, "id").sortWithinPartitions("id"))
    assert m.rows_inserted == 20_000
    assert sorted(r.id for r in store.read(path).select("id").collect()) == list(range(20_000))
    ranges = sorted((f.min_values["id"], f.max_values["id"]) for f in store.files(path))
    assert all(hi < lo for (_, hi), (lo, _) in itertools.pairwise(ranges)), ranges  # no overlap


def test_replace_keys_deletes_the_named_keys_and_appends_rows_in_one_commit(store, spark, tmp_path):
    path = str(tmp_path / "t")
    kv_table(store, spark, path, [(1, 1, "a"), (2, 1, "b"), (3, 1, "c"), (4, 1, "d")])
    keys = pa.table({"id": pa.array([2, 3, 9], pa.int64())})  # 3 goes, 9 is in no row
    m = store.replace_keys(
        path, spark.createDataFrame([(2, 2, "b2")], KV_DDL), ["id"], keys, expected_version=1
    )
    assert m.version == 2
    assert rows(store.read(path), "id") == [
        {"id": 1, "seq": 1, "v": "a"},
        {"id": 2, "seq": 2, "v": "b2"},
        {"id": 4, "seq": 1, "v": "d"},
    ]
    with pytest.raises(ConcurrentRunError):  # guarded like every write
        store.replace_keys(
            path, spark.createDataFrame([(2, 3, "b3")], KV_DDL), ["id"], keys[:1], expected_version=1
        )
    assert store.version(path) == 2


def test_replace_keys_of_rows_on_the_driver_keeps_the_untouched_rows_the_feed_and_the_guard(
    store, spark, tmp_path
):
    """Rows on the driver (a run's silver changes): on delta-spark a small table is rewritten
    here in one transaction, which must leave the other rows, give the feed exactly the
    replaced and new rows, and commit only at the version it expects."""
    path = str(tmp_path / "t")
    kv_table(store, spark, path, [(1, 1, "a"), (2, 1, "b"), (3, 1, "c"), (4, 1, "d")])  # v1
    key = pa.table({"id": pa.array([1], pa.int64())})
    store.replace_keys(path, spark.createDataFrame([(1, 2, "a2")], KV_DDL), ["id"], key)  # v2
    keys = pa.table({"id": pa.array([2, 3, 9], pa.int64())})  # 3 goes, 9 is in no row
    new = materialize(spark.createDataFrame([(2, 2, "b2"), (9, 1, "i")], KV_DDL))
    with pytest.raises(ConcurrentRunError):  # the table moved past the version expected
        store.replace_keys(path, new, ["id"], keys, expected_version=1)
    assert store.version(path) == 2

    m = store.replace_keys(path, new, ["id"], keys, expected_version=2)

    assert m.version == 3
    assert rows(store.read(path), "id") == [
        {"id": 1, "seq": 2, "v": "a2"},
        {"id": 2, "seq": 2, "v": "b2"},
        {"id": 4, "seq": 1, "v": "d"},
        {"id": 9, "seq": 1, "v": "i"},
    ]
    got = rows(store.read_changes(path, 3, 3), "_change_type", "id")
    assert [(r["_change_type"], r["id"], r["v"]) for r in got] == [
        ("delete", 2, "b"),
        ("delete", 3, "c"),
        ("insert", 2, "b2"),
        ("insert", 9, "i"),
    ]


@pytest.mark.parametrize("given", ["frame", "change set"])
def test_replace_keys_refuses_a_row_whose_key_it_does_not_name(store, spark, tmp_path, given):
    path = str(tmp_path / "t")
    kv_table(store, spark, path, [(1, 1, "a"), (2, 1, "b")])
    frame = spark.createDataFrame([(2, 2, "b2"), (5, 1, "e")], KV_DDL)
    written = frame if given == "frame" else materialize(frame)
    with pytest.raises(StorageError):
        store.replace_keys(path, written, ["id"], pa.table({"id": pa.array([2], pa.int64())}))
    assert store.version(path) == 1
    # No rows at all: the keys' rows are deleted (a run whose changes are all deletes).
    none = frame.limit(0) if given == "frame" else materialize(frame.limit(0))
    store.replace_keys(path, none, ["id"], pa.table({"id": pa.array([2], pa.int64())}))
    assert rows(store.read(path)) == [{"id": 1, "seq": 1, "v": "a"}]


def test_replace_keys_names_quoted_text(store, spark, tmp_path):
    path = str(tmp_path / "t")
    odd = "it's a \\ back'slash"
    assert store.create(path, StructType([StructField("k", StringType()), StructField("seq", LongType())]))
    store.append(path, spark.createDataFrame([(odd, 1), (odd, 2), ("x", 1)], "k string, seq long"))
    keys = pa.table({"k": [odd]})
    store.replace_keys(path, spark.createDataFrame([(odd, 9)], "k string, seq long"), ["k"], keys)
    assert rows(store.read(path), "k", "seq") == [{"k": odd, "seq": 9}, {"k": "x", "seq": 1}]


def test_delete_with_predicate(store, spark, tmp_path):
    path = str(tmp_path / "t")
    kv_table(store, spark, path, [(1, 1, "a"), (2, 1, "b"), (3, 2, "c")])
    m = store.delete(path, "seq = 1 AND id > 1")
    assert m.version == 2
    assert m.rows_deleted == 1
    assert [r["id"] for r in rows(store.read(path), "id")] == [1, 3]

    m = store.delete(path)
    assert m.rows_deleted == 2
    assert store.read(path).count() == 0


def test_history_and_version(store, spark, tmp_path):
    path = str(tmp_path / "t")
    kv_table(store, spark, path, [(1, 1, "a")])
    store.delete(path, "id = 1")
    assert store.version(path) == 2

    history = store.history(path)
    assert [h["version"] for h in history] == [2, 1, 0]
    assert history[0]["operation"] == "DELETE"
    assert history[1]["operation"] == "WRITE"
    assert "CREATE" in history[2]["operation"]
    assert all(isinstance(h["timestamp"], datetime) and h["timestamp"].tzinfo for h in history)
    assert isinstance(history[0]["operationMetrics"], dict)
    assert [h["version"] for h in store.history(path, limit=1)] == [2]


# --------------------------------------------------------------------------- types

TYPES = StructType(
    [
        StructField("id", LongType(), False),
        StructField("dec", DecimalType(38, 10)),
        StructField("ts", TimestampType()),
        StructField("ts_ntz", TimestampNTZType()),
        StructField("d", DateType()),
        StructField(
            "st",
            StructType(
                [StructField("a", LongType()), StructField("b", StringType()), StructField("c", DateType())]
            ),
        ),
        StructField("arr", ArrayType(StringType())),
        StructField("arr_st", ArrayType(StructType([StructField("k", StringType())]))),
        StructField("m", MapType(StringType(), LongType())),
        StructField("dbl", DoubleType()),
        StructField("s", StringType()),
        StructField("flag", BooleanType()),
        StructField("bin", BinaryType()),
    ]
)


def test_types_round_trip(store, spark, tmp_path, write_path):
    path = str(tmp_path / "t")
    assert store.create(path, TYPES)
    big = Decimal("1234567890123456789012345678.0123456789")
    ts = datetime(2024, 3, 1, 12, 30, 45, 123456)
    full = (
        1,
        big,
        ts,
        datetime(2024, 3, 1, 23, 59, 59, 999999),
        date(2024, 2, 29),
        {"a": 7, "b": "x", "c": date(2000, 1, 1)},
        ["p", None, "q"],
        [{"k": "v"}],
        {"one": 1},
        1.5,
        "héllo",
        True,
        b"\x00\x01",
    )
    nulls = (2, *([None] * (len(TYPES.fields) - 1)))
    store.append(path, spark.createDataFrame([full, nulls], TYPES).coalesce(1))

    read_schema = store.read(path).schema
    assert [(f.name, f.dataType) for f in read_schema.fields] == [(f.name, f.dataType) for f in TYPES.fields]
    assert store.schema(path) == TYPES
    got = rows(store.read(path), "id")
    assert got[0] == dict(zip(TYPES.names, full, strict=True)) | {"bin": bytearray(b"\x00\x01")}
    assert got[1] == dict(zip(TYPES.names, nulls, strict=True))
    # The session time zone is UTC: the instant is unchanged.
    assert spark.conf.get("spark.sql.session.timeZone") == "UTC"

    changes = store.read_changes(path, 1)
    assert [(f.name, f.dataType) for f in changes.schema.fields][: len(TYPES.fields)] == [
        (f.name, f.dataType) for f in TYPES.fields
    ]
    change_rows = rows(changes.drop("_change_type", "_commit_version"), "id")
    assert change_rows == got

    (stats,) = store.files(path)
    assert stats.min_values["id"] == 1 and stats.max_values["id"] == 2
    # Statistics are bounds or absent, never wrong: delta-rs logs wide decimals as doubles.
    assert stats.min_values["dec"] is None or stats.min_values["dec"] <= big <= stats.max_values["dec"]
    assert stats.min_values["d"] == date(2024, 2, 29)
    # Timestamp statistics are logged to the millisecond; the maximum is widened to stay a bound.
    ts_utc = ts.replace(tzinfo=timezone.utc)
    assert stats.min_values["ts"] <= ts_utc <= stats.max_values["ts"]
    assert stats.max_values["ts"] - ts_utc < timedelta(milliseconds=1)
    assert stats.min_values["ts_ntz"] <= full[3] <= stats.max_values["ts_ntz"]
    assert stats.null_counts["s"] == 1


# --------------------------------------------------------------------------- backend selection


def test_get_storage_env_var_and_caching(spark, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "delta-rs")
    rs = get_storage(spark)
    assert rs.name == "delta-rs"
    assert isinstance(rs, Storage)
    assert get_storage(spark) is rs
    assert get_storage(spark, "delta-rs") is rs

    monkeypatch.setenv(ENV_VAR, "auto")
    available, _ = delta_jars_available(spark)
    assert get_storage(spark).name == ("delta-spark" if available else "delta-rs")
    monkeypatch.delenv(ENV_VAR)
    assert get_storage(spark).name == ("delta-spark" if available else "delta-rs")


def test_forcing_delta_spark_without_jars_raises(spark, monkeypatch):
    from cdc_join.storage import select

    # A session without the jars (this one has them): the class lookup fails.
    reason = "Delta jars are not on the Spark classpath (java.lang.ClassNotFoundException: io.delta)"
    monkeypatch.setattr(select, "delta_jars_available", lambda _spark: (False, reason))
    monkeypatch.setattr(select, "_cache", type(select._cache)())
    monkeypatch.setenv(ENV_VAR, "delta-spark")
    with pytest.raises(StorageError, match="delta-spark") as info:
        get_storage(spark)
    assert reason in str(info.value)
    with pytest.raises(StorageError):
        get_storage(spark, "delta-spark")


def test_unknown_backend_name_raises(spark, monkeypatch):
    with pytest.raises(StorageError, match="Unknown storage backend"):
        get_storage(spark, "parquet")
    monkeypatch.setenv(ENV_VAR, "nope")
    with pytest.raises(StorageError, match=ENV_VAR):
        get_storage(spark)


# --------------------------------------------------------------------------- delta-rs specifics


def test_a_table_feature_delta_rs_cannot_write_is_a_storage_error_naming_it_not_a_lost_race():
    # delta-rs reports it as a failed commit; taken for a concurrent writer it would exit 4
    # ("run again") forever.
    from deltalake.exceptions import CommitFailedError

    refused = pytest.raises(StorageError, match=r"TypeWidening.*--storage delta-spark")
    with refused, delta_rs._delta_errors("append to", "/lake/t"):
        raise CommitFailedError("Unsupported table features required: [TypeWidening]")
    with pytest.raises(ConcurrentRunError), delta_rs._delta_errors("append to", "/lake/t"):
        raise CommitFailedError("Transaction failed: version already exists")


def test_delta_rs_refuses_partitioned_tables(spark, tmp_path):
    import pyarrow as pa
    from deltalake import write_deltalake

    path = str(tmp_path / "t")
    write_deltalake(path, pa.table({"id": [1, 2], "p": ["a", "b"]}), partition_by=["p"])
    store = get_storage(spark, "delta-rs")
    with pytest.raises(StorageError, match="partitioned"):
        store.read(path)


def test_delta_rs_deletion_vectors(spark, tmp_path, monkeypatch):
    from deltalake import DeltaTable, TableFeatures

    store = get_storage(spark, "delta-rs")
    path = str(tmp_path / "t")
    kv_table(store, spark, path, [(1, 1, "a")])
    DeltaTable(path).alter.add_feature(TableFeatures.DeletionVectors, allow_protocol_versions_increase=True)
    # The feature alone is fine: no file has a deletion vector.
    assert store.read(path).count() == 1

    import pyarrow as pa

    with_dv = pa.table({"filepath": ["x"], "selection_vector": [[True, False]]})
    monkeypatch.setattr(DeltaTable, "deletion_vectors", lambda self: with_dv)
    with pytest.raises(StorageError, match="deletion vectors"):
        store.read(path)
    with pytest.raises(StorageError, match="deletion vectors"):
        store.files(path)


# --------------------------------------------------------------------------- delta-spark helpers
# The delta-spark backend cannot run without the jars; its pure parts and its transaction-log
# reader (plain Spark reads of _delta_log) are checked here against tables delta-rs writes.


def test_delta_spark_merge_plan():
    from cdc_join.storage.delta_spark import plan_merge

    same = plan_merge(["id", "v"], ["id", "v"], MergeSpec(on="t.id = s.id"))
    assert same.star and not same.evolve and not same.add_columns

    evolve = plan_merge(["id", "v", "w"], ["id", "v"], MergeSpec(on="t.id = s.id", merge_schema=True))
    assert evolve.star and evolve.evolve

    ignore_new = plan_merge(["id", "v", "w"], ["id", "v"], MergeSpec(on="t.id = s.id"))
    assert not ignore_new.star and ignore_new.assignments == {"`id`": "s.`id`", "`v`": "s.`v`"}

    excluded = plan_merge(
        ["id", "v", "w", "op"],
        ["id", "v"],
        MergeSpec(on="t.id = s.id", exclude_columns=("op",), merge_schema=True),
    )
    assert not excluded.star
    assert excluded.add_columns == ("w",)
    assert list(excluded.assignments) == ["`id`", "`v`", "`w`"]

    partial = plan_merge(["id", "v"], ["id", "seq", "v"], MergeSpec(on="t.id = s.id"))
    assert not partial.star and list(partial.assignments) == ["`id`", "`v`"]


def test_delta_spark_stats_parsing():
    from cdc_join.storage.stats import file_stats_from_add

    schema = StructType(
        [
            StructField("id", LongType()),
            StructField("dec", DecimalType(38, 10)),
            StructField("small", DecimalType(10, 2)),
            StructField("ts", TimestampType()),
            StructField("ntz", TimestampNTZType()),
            StructField("d", DateType()),
            StructField("st", StructType([StructField("a", LongType())])),
        ]
    )
    # As delta-spark logs them: exact decimals, millisecond timestamps with zone, ISO ntz.
    stats = (
        '{"numRecords":10,"minValues":{"id":1,"dec":1234567890123456789012345678.0123456789,'
        '"small":1.25,"ts":"2024-03-01T12:30:45.123Z","ntz":"2024-03-01T01:02:03.004","d":"2024-02-29",'
        '"st":{"a":1}},"maxValues":{"id":9,"ts":"2024-03-01T13:00:00.000+01:00"},'
        '"nullCount":{"id":0,"dec":2,"st":{"a":0}}}'
    )
    fs = file_stats_from_add("file:/t/part-0.parquet", 123, stats, 3, schema)
    assert fs.num_records == 7  # 10 physical rows, 3 deleted by a deletion vector
    assert fs.size_bytes == 123
    assert fs.min_values["id"] == 1 and fs.max_values["id"] == 9
    exact = Decimal("1234567890123456789012345678.0123456789")
    assert fs.min_values["dec"] <= exact
    assert exact - fs.min_values["dec"] < Decimal("1e12")  # widened by a double's rounding only
    assert fs.min_values["small"] == Decimal("1.25")
    assert fs.min_values["ts"] == datetime(2024, 3, 1, 12, 30, 45, 123000, tzinfo=timezone.utc)
    assert fs.max_values["ts"] == datetime(2024, 3, 1, 12, 0, 0, 999, tzinfo=timezone.utc)
    assert fs.min_values["ntz"] == datetime(2024, 3, 1, 1, 2, 3, 4000)
    assert fs.min_values["d"] == date(2024, 2, 29)
    assert fs.min_values["st"] is None
    assert fs.null_counts == {
        "id": 0,
        "dec": 2,
        "small": None,
        "ts": None,
        "ntz": None,
        "d": None,
        "st": None,
    }
    empty = file_stats_from_add("p", None, None, None, schema)
    assert empty.num_records is None and empty.min_values["id"] is None


def test_delta_spark_log_reader_matches_delta_rs(spark, tmp_path):
    from deltalake import DeltaTable

    from cdc_join.storage.delta_spark import DeltaSparkStorage
    from cdc_join.storage.stats import basename as _basename
    from cdc_join.storage.stats import file_stats_from_add

    rs = get_storage(spark, "delta-rs")
    path = str(tmp_path / "t")
    kv_table(rs, spark, path, [(1, 1, "a"), (2, 1, None)])
    rs.append(path, spark.createDataFrame([(5, 2, "e")], KV_DDL))
    rs.merge(path, spark.createDataFrame([(1, 3, "a2")], KV_DDL), MergeSpec(on="t.id = s.id"))
    reader = DeltaSparkStorage(spark)

    def from_log(version: int) -> dict:
        expected = {_basename(f.path): f for f in rs.files(path, version=version)}
        adds = reader._log_adds(path, version, set(expected))
        assert set(adds) == set(expected)
        got = {
            name: file_stats_from_add(expected[name].path, a["size"], a["stats"], a["dv_cardinality"], KV)
            for name, a in adds.items()
        }
        for name, want in expected.items():
            assert got[name] == want
        return got

    assert len(from_log(3)) == 2
    assert len(from_log(1)) == 1
    # After a checkpoint and log cleanup the add actions come from the checkpoint parquet.
    DeltaTable(path).create_checkpoint()
    for commit in (tmp_path / "t" / "_delta_log").glob("*.json"):
        commit.unlink()
    assert len(from_log(3)) == 2


# --------------------------------------------------------------------------- how delta-spark calls Delta
# Contracts both backends keep, then checks of the delta-spark calls themselves (skipped where the
# Delta jars do not load), then its pure parts (run everywhere).

OPTIMIZE_MAX_FILE_SIZE = "spark.databricks.delta.optimize.maxFileSize"


def table_properties(spark, path: str) -> dict[str, str]:
    return {r["key"]: r["value"] for r in spark.sql(f"SHOW TBLPROPERTIES delta.`{path}`").collect()}


def data_file(root: Path, file: str) -> Path:
    """The local file of a data file named as ``files()`` names it."""
    (found,) = root.rglob(file.rstrip("/").rsplit("/", 1)[-1])
    return found


def test_create_with_a_databricks_only_property(store, spark, tmp_path, monkeypatch):
    # Tables are created with delta.targetFileSize (cdc_join.columns); open-source Delta does not
    # know it and must still create them.
    monkeypatch.delenv("DATABRICKS_RUNTIME_VERSION", raising=False)
    path = str(tmp_path / "t")
    assert store.create(path, KV, properties={"delta.targetFileSize": "16384"}) is True
    store.append(path, spark.createDataFrame([(1, 1, "a")], KV_DDL))
    assert rows(store.read(path)) == [{"id": 1, "seq": 1, "v": "a"}]


def test_keyed_read_opens_only_the_files_it_needs(store, spark, tmp_path):
    path = str(tmp_path / "t")
    kv_table(store, spark, path)
    for lo in (0, 100, 200):
        store.append(path, spark.createDataFrame([(lo + i, 1, "x") for i in range(10)], KV_DDL).coalesce(1))
    files = sorted(store.files(path), key=lambda f: f.min_values["id"])
    assert len(files) == 3
    # Without the first and the last file's data, a read that opens either of them fails.
    for f in (files[0], files[2]):
        data_file(tmp_path / "t", f.path).unlink()

    assert sorted(r["id"] for r in store.read(path, files=[files[1].path]).collect()) == list(range(100, 110))
    keys = spark.createDataFrame([(101,), (105,), (999,)], "k long")
    # Without values on the driver read_keyed semi-joins: only the file list can skip files.
    found, stats = read_keyed(store, path, keys, [("id", "k")])
    assert sorted(r["id"] for r in found.collect()) == [101, 105]
    assert (stats.files_scanned, stats.files_total) == (1, 3)
    found, stats = read_keyed(store, path, keys, [("id", "k")], values=[101, 105, 999])
    assert sorted(r["id"] for r in found.collect()) == [101, 105]
    assert stats.files_scanned == 1


@pytest.mark.parametrize(
    ("key_type", "keys"),
    [
        ("string", ["a", "b'", "ü", "", "z"]),
        ("date", [date(2020, 1, d) for d in (1, 2, 3, 4, 5)]),
        ("timestamp", [datetime(2020, 1, 1, 0, 0, s, tzinfo=timezone.utc) for s in (1, 2, 3, 4, 5)]),
        ("decimal(12,2)", [Decimal(f"{d}.25") for d in (1, 2, 3, 4, 5)]),
        ("long", [-5, 0, 2**40, 7, 2**63 - 1]),
    ],
)
def test_a_keyed_read_returns_the_rows_a_spark_filter_does(store, spark, tmp_path, key_type, keys):
    # Keyed reads of wanted values on the driver (delta-rs reads them without Spark): the same
    # rows, types and nulls as Spark's own read and filter, a column added later included.
    path = str(tmp_path / "t")
    schema = StructType([StructField("k", spark.createDataFrame([], f"k {key_type}").schema["k"].dataType)])
    schema = StructType([*schema.fields, StructField("n", LongType(), False), StructField("v", StringType())])
    assert store.create(path, schema, cdf=False) is True
    first = [(keys[0], 1, "a"), (keys[1], 2, None), (keys[2], 3, "c"), (None, 4, "null key")]
    # One file per append (a Spark frame of a few rows is written as a file per partition).
    store.append(path, spark.createDataFrame(first, schema).coalesce(1))
    store.evolve(path, StructType([*schema.fields, StructField("added", StringType())]))
    later = [(keys[1], 5, "b2", "x"), (keys[3], 6, "d", None), (keys[4], 7, "e", "y")]
    store.append(path, spark.createDataFrame(later, store.schema(path)).coalesce(1))

    wanted = [keys[1], keys[3], keys[4], None, keys[0]]
    key_df = spark.createDataFrame(
        [(w,) for w in wanted], StructType([StructField("w", schema["k"].dataType)])
    )
    found, stats = read_keyed(store, path, key_df, [("k", "w")], values=[w for w in wanted if w is not None])
    expected = store.read(path).filter(F.col("k").isin([w for w in wanted if w is not None]))
    assert [(f.name, f.dataType) for f in found.schema] == [(f.name, f.dataType) for f in expected.schema]
    assert rows(found, "n") == rows(expected, "n")
    assert [r["n"] for r in rows(found, "n")] == [1, 2, 5, 6, 7]
    assert stats.files_total == 2
    # No wanted value: no rows.
    none, _ = read_keyed(store, path, key_df, [("k", "w")], values=[])
    assert none.collect() == []
    if store.name == "delta-rs":
        # Read on the driver: the frame is built over the Arrow rows, no Spark read of the table.
        assert getattr(found, "_cdc_join_arrow", None) is not None


def test_a_keyed_read_by_spark_keeps_keys_that_look_like_sql_variables(store, spark, tmp_path, monkeypatch):
    # Spark replaces ${name} in SQL text, inside quotes too, before it parses it: a key holding
    # one must still find its row when Spark filters (here: a version older than the latest,
    # which no backend reads on the driver).
    monkeypatch.setenv("CDC_JOIN_TEST_VARIABLE", "replaced")
    path = str(tmp_path / "t")
    odd = ["a${spark.app.name}", "b${env:CDC_JOIN_TEST_VARIABLE}", "c${nothing.set}"]
    store.create(path, StructType([StructField("k", StringType()), StructField("n", LongType())]), cdf=False)
    store.append(
        path, spark.createDataFrame([(k, i) for i, k in enumerate([*odd, "plain"])], "k string, n long")
    )
    version = store.version(path)
    store.append(path, spark.createDataFrame([("later", 9)], "k string, n long"))
    keys = spark.createDataFrame([(k,) for k in [*odd, "plain"]], "w string")
    found, _ = read_keyed(store, path, keys, [("k", "w")], version=version, values=[*odd, "plain"])
    assert sorted(r["k"] for r in found.collect()) == sorted([*odd, "plain"])


def test_a_keyed_read_of_keys_of_another_type_matches_as_spark_compares_them(store, spark, tmp_path):
    # An int foreign key naming a long primary key, a string one naming a long key: Spark
    # coerces one side; the read on the driver must not turn that into an error or a miss.
    path = str(tmp_path / "t")
    kv_table(store, spark, path, [(1, 1, "a"), (2, 1, "b"), (3, 1, "c")])
    for ddl, wanted in (("w int", [2, 3]), ("w string", ["2", "3"])):
        keys = spark.createDataFrame([(w,) for w in wanted], ddl)
        found, _ = read_keyed(store, path, keys, [("id", "w")], values=wanted)
        assert sorted(r["id"] for r in found.collect()) == [2, 3], ddl


def test_delta_rs_reads_keys_of_a_table_pyarrow_cannot_open_with_its_query_builder(spark, tmp_path):
    # A table whose protocol names deletion vectors (none left after a purge) is refused by
    # pyarrow datasets: delta-rs's QueryBuilder reads its keys, and a keyed read of some of
    # its files (which the query cannot name) goes through Spark.
    from deltalake import DeltaTable, TableFeatures

    store = get_storage(spark, "delta-rs")
    path = str(tmp_path / "t")
    kv_table(store, spark, path, [(1, 1, "a"), (2, 1, "b")])
    DeltaTable(path).alter.add_feature(TableFeatures.DeletionVectors, allow_protocol_versions_increase=True)
    assert store.read_rows(path, "id", [1, None]).to_pylist() == [{"id": 1, "seq": 1, "v": "a"}]
    assert store.read_rows(path, "id", [1], files=[f.path for f in store.files(path)]) is None
    keys = spark.createDataFrame([(1,)], "k long")
    found, _ = read_keyed(store, path, keys, [("id", "k")], values=[1])
    assert rows(found) == [{"id": 1, "seq": 1, "v": "a"}]


def test_delta_rs_keyed_read_of_files_the_table_no_longer_has_fails(spark, tmp_path):
    # Files listed before another writer replaced them: an error, as Spark's read gives, never
    # an empty result.
    store = get_storage(spark, "delta-rs")
    path = str(tmp_path / "t")
    kv_table(store, spark, path, [(1, 1, "a")])
    listed = [f.path for f in store.files(path)]
    store.overwrite(path, spark.createDataFrame([(1, 2, "b")], KV_DDL))
    with pytest.raises(StorageError, match="not a data file"):
        store.read_rows(path, "id", [1], files=listed)
    assert store.read_rows(path, "id", [1]).to_pylist() == [{"id": 1, "seq": 2, "v": "b"}]


def test_merge_metrics_are_the_rows_it_changed(store, spark, tmp_path):
    path = str(tmp_path / "t")
    kv_table(store, spark, path, [(i, 1, "a") for i in range(1, 7)])
    source = spark.createDataFrame(
        [
            (1, 2, "u", "u"),
            (2, 2, "u", "u"),
            (3, 2, None, "d"),
            (4, 0, "stale", "u"),
            (7, 1, "n", "u"),
            (8, 1, "n", "u"),
            (9, 1, "n", "u"),
        ],
        "id long, seq long, v string, op string",
    )
    spec = MergeSpec(
        on="t.id = s.id",
        delete_condition="s.op = 'd'",
        update_condition="s.seq > t.seq",
        insert_condition="s.op <> 'd'",
        exclude_columns=("op",),
    )

    m = store.merge(path, source, spec)

    assert m.version == store.version(path) == 2
    changes = store.read_changes(path, m.version, m.version)
    counted = {
        kind: changes.where(F.col("_change_type") == kind).count()
        for kind in ("insert", "update_postimage", "delete")
    }
    assert (m.rows_inserted, m.rows_updated, m.rows_deleted) == (3, 2, 1)
    assert (counted["insert"], counted["update_postimage"], counted["delete"]) == (3, 2, 1)
    # Live row counts of the files (deletion vectors subtracted) add up to the table's rows.
    assert sum(f.num_records for f in store.files(path)) == store.read(path).count() == 8


def test_merge_does_not_checkpoint_its_source(store, spark, tmp_path, monkeypatch):
    path = str(tmp_path / "t")
    kv_table(store, spark, path, [(1, 1, "a")])
    source = spark.createDataFrame([(1, 2, "a2"), (2, 1, "b")], KV_DDL)

    def refuse(*_args, **_kwargs):
        raise AssertionError("the merge source was checkpointed")

    # Checkpoints lose their blocks when executors go and do not exist on Spark Connect.
    monkeypatch.setattr(type(source), "localCheckpoint", refuse)
    monkeypatch.setattr(type(source), "checkpoint", refuse)

    m = store.merge(path, source, MergeSpec(on="t.id = s.id"))

    assert (m.rows_inserted, m.rows_updated) == (1, 1)
    assert rows(store.read(path), "id") == [{"id": 1, "seq": 2, "v": "a2"}, {"id": 2, "seq": 1, "v": "b"}]


def test_merge_of_a_source_that_reads_the_target(store, spark, tmp_path):
    # The source is evaluated against the target it changes: each row still merges once.
    path = str(tmp_path / "t")
    kv_table(store, spark, path, [(1, 1, "a"), (2, 1, "b"), (3, 1, "c")])
    source = store.read(path).where("id <= 2").withColumn("seq", F.col("seq") + 1)

    m = store.merge(path, source, MergeSpec(on="t.id = s.id", update_condition="s.seq > t.seq"))

    assert (m.rows_inserted, m.rows_updated, m.rows_deleted) == (0, 2, 0)
    assert rows(store.read(path), "id") == [
        {"id": 1, "seq": 2, "v": "a"},
        {"id": 2, "seq": 2, "v": "b"},
        {"id": 3, "seq": 1, "v": "c"},
    ]


def test_optimize_leaves_the_session_conf_unchanged(store, spark, tmp_path):
    path = str(tmp_path / "t")
    kv_table(store, spark, path, [(1, 1, "a")])
    previous = spark.conf.get(OPTIMIZE_MAX_FILE_SIZE, None)
    try:
        spark.conf.unset(OPTIMIZE_MAX_FILE_SIZE)
        store.append(path, spark.createDataFrame([(2, 1, "b")], KV_DDL))
        store.optimize(path, target_size=20_000)
        assert spark.conf.get(OPTIMIZE_MAX_FILE_SIZE, None) is None

        spark.conf.set(OPTIMIZE_MAX_FILE_SIZE, "123456789")
        store.append(path, spark.createDataFrame([(3, 1, "c")], KV_DDL))
        store.optimize(path, zorder_by=["id"], target_size=20_000)
        assert spark.conf.get(OPTIMIZE_MAX_FILE_SIZE, None) == "123456789"
        assert store.read(path).count() == 3
    finally:
        if previous is None:
            spark.conf.unset(OPTIMIZE_MAX_FILE_SIZE)
        else:
            spark.conf.set(OPTIMIZE_MAX_FILE_SIZE, previous)


def test_delta_spark_create_sets_only_known_properties(spark_store, spark, tmp_path, monkeypatch):
    monkeypatch.delenv("DATABRICKS_RUNTIME_VERSION", raising=False)
    path = str(tmp_path / "t")
    properties = {"delta.targetFileSize": "16384", "delta.appendOnly": "false"}
    assert spark_store.create(path, KV, properties=properties) is True

    props = table_properties(spark, path)
    assert "delta.targetFileSize" not in props
    assert props["delta.appendOnly"] == "false"
    assert props["delta.enableDeletionVectors"] == "true"
    assert props["delta.enableChangeDataFeed"] == "true"

    # The caller's properties win over the defaults.
    other = str(tmp_path / "u")
    assert spark_store.create(other, KV, cdf=False, properties={"delta.enableDeletionVectors": "false"})
    props = table_properties(spark, other)
    assert props["delta.enableDeletionVectors"] == "false"
    assert props.get("delta.enableChangeDataFeed", "false") == "false"


def test_delta_spark_merge_metrics_come_from_execute(spark_store, spark, tmp_path, monkeypatch):
    path = str(tmp_path / "t")
    kv_table(spark_store, spark, path, [(1, 1, "a"), (2, 1, "b"), (3, 1, "c")])
    source = spark.createDataFrame([(1, 2, "a2"), (4, 1, "d")], KV_DDL)
    # Metrics come from the commit, not from listing the files before and after.
    from pyspark.sql import DataFrame

    monkeypatch.setattr(DataFrame, "inputFiles", lambda *_: pytest.fail("listed the files"))

    m = spark_store.merge(path, source, MergeSpec(on="t.id = s.id"))

    (commit,) = spark_store.history(path, 1)
    metrics = commit["operationMetrics"]
    assert commit["operation"] == "MERGE" and commit["version"] == m.version == 2
    assert (m.rows_inserted, m.rows_updated, m.rows_deleted) == (1, 1, 0)
    assert m.rows_updated == metrics["numTargetRowsUpdated"]
    assert m.files_added == metrics["numTargetFilesAdded"]
    # The file that held id 1 is rewritten or given a deletion vector: either way it counts.
    assert m.files_removed == metrics["numTargetFilesRemoved"] + metrics.get(
        "numTargetDeletionVectorsAdded", 0
    )
    assert m.files_removed >= 1
    assert m.extra["metrics"]["numTargetRowsCopied"] == metrics["numTargetRowsCopied"]

    # A merge that changes nothing may commit nothing; the version then stays.
    same = spark_store.merge(
        path,
        spark.createDataFrame([(1, 0, "old")], KV_DDL),
        MergeSpec(on="t.id = s.id", update_condition="s.seq > t.seq", insert=False),
    )
    assert (same.rows_inserted, same.rows_updated, same.rows_deleted) == (0, 0, 0)
    assert same.version == spark_store.version(path)


def test_delta_spark_merge_adds_columns_with_odd_names(spark_store, spark, tmp_path):
    path = str(tmp_path / "t")
    kv_table(spark_store, spark, path, [(1, 1, "a")])
    nested = StructType([StructField("x-y", IntegerType()), StructField("from", StringType())])
    source = spark.createDataFrame(
        [(1, 2, "a2", 7, (1, "p"), "u"), (2, 1, "b", 8, (2, "q"), "u")],
        StructType(
            [
                *KV.fields,
                StructField("odd-name", LongType()),
                StructField("nested", nested),
                StructField("op", StringType()),
            ]
        ),
    )
    # An excluded column makes the merge add the new columns with ALTER TABLE first.
    spec = MergeSpec(on="t.id = s.id", exclude_columns=("op",), merge_schema=True)

    spark_store.merge(path, source, spec)

    schema = spark_store.schema(path)
    assert schema.names == ["id", "seq", "v", "odd-name", "nested"]
    assert schema["nested"].dataType.names == ["x-y", "from"]
    got = rows(spark_store.read(path), "id")
    assert [(r["id"], r["odd-name"], r["nested"]) for r in got] == [
        (1, 7, {"x-y": 1, "from": "p"}),
        (2, 8, {"x-y": 2, "from": "q"}),
    ]


def test_delta_spark_exists_is_false_for_views(spark_store, spark, tmp_path):
    path = str(tmp_path / "t")
    kv_table(spark_store, spark, path, [(1, 1, "a")])
    db = f"cdc_join_contract_{uuid.uuid4().hex[:12]}"
    spark.sql(f"CREATE DATABASE {db} LOCATION '{tmp_path / 'db'}'")
    try:
        spark.sql(f"CREATE TABLE {db}.t USING delta LOCATION '{path}'")
        spark.sql(f"CREATE VIEW {db}.v AS SELECT * FROM {db}.t")
        spark.read.format("delta").load(path).createOrReplaceGlobalTempView(f"{db}_g")
        assert spark_store.exists(f"{db}.t")
        assert not spark_store.exists(f"{db}.v")
        assert not spark_store.exists(f"global_temp.{db}_g")
        assert not spark_store.exists(f"{db}.missing")
    finally:
        spark.catalog.dropGlobalTempView(f"{db}_g")
        spark.sql(f"DROP DATABASE IF EXISTS {db} CASCADE")


def test_delta_spark_optimize_restores_the_session_conf_when_it_fails(spark_store, spark, tmp_path):
    path = str(tmp_path / "t")
    kv_table(spark_store, spark, path, [(1, 1, "a")])
    previous = spark.conf.get(OPTIMIZE_MAX_FILE_SIZE, None)
    try:
        spark.conf.set(OPTIMIZE_MAX_FILE_SIZE, "123456789")
        with pytest.raises(StorageError):
            spark_store.optimize(path, zorder_by=["no_such_column"], target_size=20_000)
        assert spark.conf.get(OPTIMIZE_MAX_FILE_SIZE, None) == "123456789"
    finally:
        if previous is None:
            spark.conf.unset(OPTIMIZE_MAX_FILE_SIZE)
        else:
            spark.conf.set(OPTIMIZE_MAX_FILE_SIZE, previous)


def test_delta_spark_files_agree_with_delta_rs_and_the_log(spark_store, spark, tmp_path):
    # delta-rs reads the add actions where it can; the log reader is the fallback: same answer.
    path = str(tmp_path / "t")
    kv_table(spark_store, spark, path, [(1, 1, "a"), (2, 1, None), (3, 1, "c")])
    spark_store.merge(path, spark.createDataFrame([(1, 2, "a2")], KV_DDL), MergeSpec(on="t.id = s.id"))
    version = spark_store.version(path)
    listed = spark_store.files(path)
    location, _ = spark_store._detail(path)
    from_log = spark_store._files_from_log(path, location, version)
    assert sorted(listed, key=lambda f: f.path) == sorted(from_log, key=lambda f: f.path)
    assert sum(f.num_records for f in listed) == 3


# --------------------------------------------------------------------------- delta-spark pure parts


def test_delta_spark_create_properties(monkeypatch):
    from cdc_join.storage.delta_spark import create_properties, on_databricks

    oss = create_properties(
        {"delta.targetFileSize": "16384", "delta.appendOnly": "false"}, cdf=True, databricks=False
    )
    assert oss == {
        "delta.enableDeletionVectors": "true",
        "delta.appendOnly": "false",
        "delta.enableChangeDataFeed": "true",
    }
    dbr = create_properties({"delta.targetFileSize": "16384"}, cdf=False, databricks=True)
    assert dbr == {"delta.enableDeletionVectors": "true", "delta.targetFileSize": "16384"}
    off = create_properties({"delta.EnableDeletionVectors": "false"}, cdf=False, databricks=False)
    assert off == {"delta.EnableDeletionVectors": "false"}

    monkeypatch.setenv("DATABRICKS_RUNTIME_VERSION", "15.4")
    assert on_databricks()
    monkeypatch.delenv("DATABRICKS_RUNTIME_VERSION")
    assert not on_databricks()


def test_delta_spark_ddl_type_quotes_nested_names(spark):
    from cdc_join.storage.delta_spark import _ddl_type

    odd = StructType(
        [
            StructField("x-y", IntegerType()),
            StructField("a`b", ArrayType(StructType([StructField("from", StringType())]))),
            StructField("m", MapType(StringType(), DecimalType(10, 2))),
        ]
    )
    ddl = _ddl_type(odd)
    assert ddl == "STRUCT<`x-y`: int, `a``b`: ARRAY<STRUCT<`from`: string>>, `m`: MAP<string, decimal(10,2)>>"
    parsed = spark.range(1).select(F.lit(None).cast(ddl).alias("c")).schema["c"].dataType
    assert parsed == odd


def stats(path: str, low, high, nulls=0) -> FileStats:
    return FileStats(
        path,
        1,
        10,
        {"id": low, "v": "a", "d": 0.0},
        {"id": high, "v": "z", "d": 1.0},
        {"id": nulls, "v": 0, "d": 0},
    )


def test_delta_spark_skipping_ranges():
    from cdc_join.storage.stats import SkipRanges, skipping_ranges

    schema = StructType(
        [StructField("id", LongType()), StructField("v", StringType()), StructField("d", DoubleType())]
    )
    a, b, c = stats("a", 0, 9), stats("b", 100, 109), stats("c", 200, 209, nulls=1)

    # Only "id" tells the files apart ("v" overlaps, doubles are never used).
    assert skipping_ranges(schema, [b], [a, c]) == [SkipRanges("id", ((100, 109),), False)]
    # A chosen file with nulls admits nulls; an unknown null count does too.
    assert skipping_ranges(schema, [c], [a, b]) == [SkipRanges("id", ((200, 209),), True)]
    unknown = FileStats("u", 1, 10, {"id": 300}, {"id": 309}, {})
    assert skipping_ranges(schema, [unknown], [a]) == [SkipRanges("id", ((300, 309),), True)]
    # Overlapping ranges are joined; a chosen file without bounds leaves the column unusable.
    assert skipping_ranges(schema, [a, stats("a2", 5, 20)], [b]) == [SkipRanges("id", ((0, 20),), False)]
    assert skipping_ranges(schema, [b, FileStats("n", 1, 10, {}, {}, {})], [a]) == []
    # Nothing to skip: no predicate.
    assert skipping_ranges(schema, [a, b, c], []) == []
    # Many ranges are coarsened into at most max_ranges spans that still cover them.
    many = [stats(f"f{i}", 10 * i, 10 * i + 1) for i in range(10)]
    (coarse,) = skipping_ranges(schema, many[::2], many[1::2], max_ranges=2)
    assert coarse.intervals == ((0, 41), (60, 81))


def test_delta_spark_ranges_predicate_keeps_every_row_of_the_chosen_files(spark):
    from cdc_join.storage.stats import SkipRanges
    from cdc_join.storage.stats import ranges_predicate as _ranges_predicate

    schema = StructType(
        [
            StructField("id", LongType()),
            StructField("ts", TimestampType()),
            StructField("dec", DecimalType(12, 2)),
            StructField("s", StringType()),
        ]
    )
    ts = datetime(2024, 3, 1, 12, 30, 45, 123456, tzinfo=timezone.utc)
    ranges = [
        SkipRanges("id", ((100, 109), (200, 200)), True),
        SkipRanges("ts", ((ts, ts + timedelta(microseconds=999)),), False),
        SkipRanges("dec", ((Decimal("1.005"), Decimal("2.504")),), False),
        SkipRanges("s", (("b", "c\U0010ffff"),), False),
    ]
    inside = [
        (100, ts, Decimal("1.01"), "b"),
        (109, ts + timedelta(microseconds=999), Decimal("2.51"), "czzz"),
        (None, ts, Decimal("2.00"), "c"),
        (200, ts, Decimal("1.50"), "bb"),
    ]
    outside = [
        (110, ts, Decimal("1.50"), "b"),
        (150, ts, Decimal("1.50"), "b"),
        (100, ts, Decimal("3.00"), "b"),
    ]
    df = spark.createDataFrame(inside + outside, schema)
    predicate = _ranges_predicate(schema, ranges)
    kept = [(r["id"], r["s"]) for r in df.where(predicate).collect()]
    assert sorted(kept, key=str) == sorted([(r[0], r[3]) for r in inside], key=str)


def test_delta_spark_log_reader_escapes_glob_characters(spark, tmp_path):
    from deltalake import DeltaTable

    from cdc_join.storage.delta_spark import DeltaSparkStorage
    from cdc_join.storage.stats import basename as _basename

    rs = get_storage(spark, "delta-rs")
    plain = tmp_path / "plain"
    kv_table(rs, spark, str(plain), [(1, 1, "a")])  # versions 0 and 1
    rs.append(str(plain), spark.createDataFrame([(2, 1, "b")], KV_DDL))  # 2
    DeltaTable(str(plain)).create_checkpoint()  # at 2
    rs.append(str(plain), spark.createDataFrame([(3, 1, "c")], KV_DDL))  # 3
    at = {v: {_basename(f.path) for f in rs.files(str(plain), version=v)} for v in (1, 2, 3)}
    # Glob characters in the table's folder name must be matched literally.
    odd = tmp_path / "we[ir]d {x}*"
    plain.rename(odd)
    reader = DeltaSparkStorage(spark)

    adds = reader._log_adds(str(odd), 3, at[3])

    assert set(adds) == at[3]
    # Read from the checkpoint and the one commit after it, not from every commit.
    for name, add in adds.items():
        assert add["log_file"].startswith(
            "00000000000000000002." if name in at[2] else "00000000000000000003."
        )
    # A version older than every checkpoint is read from its commits.
    older = reader._log_adds(str(odd), 1, at[3])
    assert set(older) == at[1]
    assert all(a["log_file"] == "00000000000000000001.json" for a in older.values())


def test_delta_spark_files_from_delta_rs(spark, tmp_path):
    from deltalake import DeltaTable

    from cdc_join.storage.delta_spark import DeltaSparkStorage
    from cdc_join.storage.stats import basename as _basename

    rs = get_storage(spark, "delta-rs")
    path = str(tmp_path / "t")
    kv_table(rs, spark, path, [(1, 1, "a"), (2, 1, None)])
    rs.append(path, spark.createDataFrame([(5, 2, "e")], KV_DDL))
    reader = DeltaSparkStorage(spark)
    table_id = DeltaTable(path).metadata().id
    location = "file:" + path

    got = reader._files_from_delta_rs(path, location, table_id, 2)

    want = {_basename(f.path): f for f in rs.files(path)}
    assert {_basename(f.path): f for f in got} == {
        name: FileStats(
            location + f.path.removeprefix("file://" + path),  # files may sit in subfolders
            f.size_bytes,
            f.num_records,
            f.min_values,
            f.max_values,
            f.null_counts,
        )
        for name, f in want.items()
    }
    # Another table at that location (a different id) is not taken for this one.
    assert reader._files_from_delta_rs(path, location, "another-table", 2) is None
    assert reader._files_from_delta_rs(path, "file:" + str(tmp_path / "none"), None, 2) is None


def test_delta_spark_deleted_rows_from_deletion_vectors():
    import pyarrow as pa

    from cdc_join.storage.stats import deleted_rows as _deleted_rows

    class Protocol:
        reader_features = ("deletionVectors",)

    class Table:
        def protocol(self):
            return Protocol()

        def deletion_vectors(self):
            return pa.table(
                {
                    "filepath": ["file:///t/part%20a.parquet", "file:///t/part-b.parquet"],
                    "selection_vector": [[True, False, False, True], [True]],
                }
            )

    assert _deleted_rows(Table()) == {"part a.parquet": 2, "part-b.parquet": 0}


def test_delta_rs_reads_spark_s_size_estimates_whatever_their_magnitude():
    # A join's estimate is printed in scientific notation past 2048 EiB: read as 1 byte, a
    # whole table was collected on the driver instead of streamed.
    plan = "== Optimized Logical Plan ==\nProject [a#1], Statistics(sizeInBytes={})\n== Physical Plan ==\n"
    assert delta_rs.plan_size(plan.format("1.32E+22 B")) == 13_200_000_000_000_000_000_000
    assert delta_rs.plan_size(plan.format("75.7 PiB")) == int(75.7 * 2**50)
    assert delta_rs.plan_size(plan.format("589.6 KiB")) == int(589.6 * 2**10)
    rows_on_the_driver = (
        "== Optimized Logical Plan ==\nLogicalRDD [a#1], false, Statistics(sizeInBytes=8.0 EiB)\n"
    )
    assert delta_rs.plan_size(rows_on_the_driver) == 0
