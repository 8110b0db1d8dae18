"""The silver hop: which rows a recompute hands to the MERGE, and what the MERGE does with them."""

from __future__ import annotations

from datetime import datetime

from pyspark.sql import functions as F

from cdc_join.columns import VALUES_HASH
from cdc_join.join.hashing import values_hash
from cdc_join.silver import table as silver
from tests.support import make_pipeline

SCHEMA = (
    "_pk_id string, key string, fk long, v long, value string, "
    "_seq_lhs string, _seq_rhs string, _run_id long, _action string"
)


def _rows(spark, *rows):
    return spark.createDataFrame(list(rows), SCHEMA)


def merge_into_silver(storage, cfg, rows):
    version = storage.version(cfg.silver_path) if storage.exists(cfg.silver_path) else None
    silver.merge(storage, cfg, rows, expected_version=silver.prepare(storage, cfg, rows, version))


def only_changes(storage, cfg, rows):
    return silver.differences(storage, cfg, rows)


def test_only_changes_keeps_what_the_merge_would_act_on(tmp_path, spark, storage):
    pipeline, _ = make_pipeline(tmp_path, spark, storage)
    cfg = pipeline.config
    merge_into_silver(
        storage,
        cfg,
        _rows(
            spark,
            ("a", "a", 1, 10, "x", "1", "1", 1, "upsert"),
            ("b", "b", 1, 20, "x", "1", "1", 1, "upsert"),
            ("c", "c", 2, None, "y", "1", "1", 1, "upsert"),
            ("d", "d", 2, 40, "y", "1", "1", 1, "upsert"),
        ),
    )
    candidates = _rows(
        spark,
        ("a", "a", 1, 10, "x", "9", "9", 2, "upsert"),  # same data, new lineage: unchanged
        ("b", "b", 1, 21, "x", "1", "1", 2, "upsert"),  # v differs
        ("c", "c", 2, 30, "y", "1", "1", 2, "upsert"),  # null -> value
        ("d", "d", 2, 40, "y", "1", "1", 2, "delete"),  # delete of a present key
        ("e", "e", 3, 50, "z", "1", "1", 2, "upsert"),  # new key
        ("f", "f", 3, 60, "z", "1", "1", 2, "delete"),  # delete of an absent key: nothing to do
    )
    kept = {(r["_pk_id"], r["_action"]) for r in only_changes(storage, cfg, candidates).collect()}
    assert kept == {("b", "upsert"), ("c", "upsert"), ("d", "delete"), ("e", "upsert")}

    # MERGEing only the kept rows leaves silver as MERGEing every candidate would.
    merge_into_silver(storage, cfg, only_changes(storage, cfg, candidates))
    silver = {tuple(r) for r in storage.read(cfg.silver_path).select("key", "v").collect()}
    assert silver == {("a", 10), ("b", 21), ("c", 30), ("e", 50)}


def test_only_changes_sees_values_that_swap_places_with_a_null(tmp_path, spark, storage):
    """Silver's side of the comparison is a fingerprint (hashes, which skip NULLs): a value
    moving to the neighbouring column of the same type, the NULL moving the other way, is
    still a change."""
    pipeline, _ = make_pipeline(tmp_path, spark, storage)
    cfg = pipeline.config
    merge_into_silver(
        storage,
        cfg,
        _rows(
            spark,
            ("a", "a", None, 5, "x", "1", "1", 1, "upsert"),
            ("b", "b", 7, None, None, "1", "1", 1, "upsert"),
            ("c", "c", 1, 2, "x", "1", "1", 1, "upsert"),
        ),
    )
    candidates = _rows(
        spark,
        ("a", "a", 5, None, "x", "1", "1", 2, "upsert"),  # fk NULL, v 5 -> fk 5, v NULL
        ("b", "b", None, 7, None, "1", "1", 2, "upsert"),  # fk 7, v NULL -> fk NULL, v 7
        ("c", "c", 1, 2, "x", "1", "1", 2, "upsert"),  # unchanged
    )
    kept = {(r["_pk_id"], r["_action"]) for r in only_changes(storage, cfg, candidates).collect()}
    assert kept == {("a", "upsert"), ("b", "upsert")}


def test_only_changes_sees_a_timestamp_inside_a_struct_or_map_move_by_a_microsecond(tmp_path, spark, storage):
    """Nested values are compared as JSON text, which Spark writes to the millisecond unless
    told otherwise: a child row's timestamp that moved by a microsecond is still a change."""
    pipeline, _ = make_pipeline(
        tmp_path,
        spark,
        storage,
        select={"key": "lhs.id", "ev": "named_struct('t', lhs.v)", "tags": "map('k', lhs.v)"},
    )
    cfg = pipeline.config
    schema = (
        "_pk_id string, key string, ev struct<t: timestamp>, tags map<string, timestamp>, "
        "_seq_lhs string, _seq_rhs string, _run_id long, _action string"
    )
    t0, t1 = datetime(2026, 1, 2, 3, 4, 5, 123456), datetime(2026, 1, 2, 3, 4, 5, 123457)

    def rows(*values):
        built = spark.createDataFrame(
            [(k, k, {"t": ev}, {"k": tag}, "1", "1", run, "upsert") for k, ev, tag, run in values], schema
        )
        return _hashed(built, ["key", "ev", "tags"])

    merge_into_silver(storage, cfg, rows(("a", t0, t0, 1), ("b", t0, t0, 1), ("c", t0, t0, 1)))
    candidates = rows(("a", t0, t0, 2), ("b", t1, t0, 2), ("c", t0, t1, 2))
    kept = {(r["_pk_id"], r["_action"]) for r in only_changes(storage, cfg, candidates).collect()}
    assert kept == {("b", "upsert"), ("c", "upsert")}


def test_only_changes_passes_every_upsert_before_silver_exists(tmp_path, spark, storage):
    pipeline, _ = make_pipeline(tmp_path, spark, storage)
    rows = _rows(
        spark, ("a", "a", 1, 10, "x", "1", "1", 1, "upsert"), ("b", "b", 1, 10, "x", "1", "1", 1, "delete")
    )
    kept = {(r["_pk_id"], r["_action"]) for r in only_changes(storage, pipeline.config, rows).collect()}
    assert kept == {("a", "upsert")}


def test_a_recompute_deletes_silver_rows_whose_key_it_does_not_have(tmp_path, spark, storage):
    """A silver row written by hand (or by an old bug) has no source row: the differences of a
    recompute delete it, so a full refresh repairs extra rows too."""
    pipeline, _ = make_pipeline(tmp_path, spark, storage)
    cfg = pipeline.config
    merge_into_silver(
        storage,
        cfg,
        _rows(
            spark,
            ("a", "a", 1, 10, "x", "1", "1", 1, "upsert"),
            ("zz", "zz", 9, 9, "?", "1", "1", 1, "upsert"),
        ),
    )
    whole_join = _rows(spark, ("a", "a", 1, 10, "x", "1", "1", 2, "upsert"))
    kept = {(r["_pk_id"], r["_action"]) for r in only_changes(storage, cfg, whole_join).collect()}
    assert kept == {("zz", "delete")}


def test_full_refresh_of_unchanged_sources_writes_no_silver_rows(tmp_path, spark, storage):
    pipeline, writer = make_pipeline(tmp_path, spark, storage)
    writer.write("rhs", [writer.upsert("rhs", {"id": 1, "value": "x"}, lsn=1, op="c")])
    writer.write("lhs", [writer.upsert("lhs", {"id": "a", "fk": 1, "v": 10}, lsn=2, op="c")])
    pipeline.run()
    version = storage.version(pipeline.config.silver_path)
    report = pipeline.full_refresh()
    assert report.steps["silver"]["inserted"] == report.steps["silver"]["updated"] == 0
    assert storage.version(pipeline.config.silver_path) == version


def test_a_checkpoint_without_keys_is_no_redefinition_and_one_with_keys_is_compared(tmp_path, spark, storage):
    # Checkpoints written before the definition recorded primary keys: the upgrade alone
    # recomputes nothing; from the next checkpoint on a key change is a restatement.
    pipeline, _ = make_pipeline(tmp_path, spark, storage)
    cfg = pipeline.config
    now = silver.definition(cfg)
    assert now["keys"] == [["lhs", ["id"]], ["rhs", ["id"]]]
    older = {k: v for k, v in now.items() if k != "keys"}
    assert silver.redefined(older, cfg) is None and silver.restated(older, cfg) is None
    assert not silver.joins_redefined(older, cfg)
    rekeyed = {**now, "keys": [["lhs", ["id", "v"]], ["rhs", ["id"]]]}
    assert silver.restated(rekeyed, cfg) == "the primary key of lhs changed since the last run"
    assert silver.redefined(rekeyed, cfg) == "silver's definition changed since the last run (keys changed)"
    moved = {**now, "left": "other"}
    assert silver.restated(moved, cfg) == "the left source changed since the last run (other → lhs)"
    assert silver.restated(now, cfg) is None and silver.restated(None, cfg) is None


def _hashed(rows, columns=("key", "fk", "v", "value")):
    """Rows as resolve builds them: with ``_values_hash`` of the select columns."""
    types = {f.name: f.dataType for f in rows.schema.fields}
    hashed = values_hash(list(columns), types).alias(VALUES_HASH)
    return rows.select(*[c for c in rows.columns if c != "_action"], hashed, "_action")


def _merged(storage, cfg, rows, **options):
    version = storage.version(cfg.silver_path) if storage.exists(cfg.silver_path) else None
    expected = silver.prepare(storage, cfg, rows, version)
    return silver.merge(storage, cfg, rows, expected_version=expected, **options)


def test_the_merge_compares_values_by_their_hash_and_a_full_refresh_by_the_values(tmp_path, spark, storage):
    """An incremental MERGE updates a row when its ``_values_hash`` differs: a row sent again
    changes nothing, a changed one is updated. A silver row edited by hand (its values no
    longer those its hash was made of) escapes that comparison; a full refresh compares the
    values themselves, and repairs it."""
    pipeline, _ = make_pipeline(tmp_path, spark, storage)
    cfg = pipeline.config
    a1, b1 = ("a", "a", 1, 10, "x", "1", "1", 1, "upsert"), ("b", "b", 1, 20, "x", "1", "1", 1, "upsert")
    a2, b2 = ("a", "a", 1, 10, "x", "2", "2", 2, "upsert"), ("b", "b", 1, 21, "x", "2", "2", 2, "upsert")
    _merged(storage, cfg, _hashed(_rows(spark, a1, b1)))
    report = _merged(storage, cfg, _hashed(_rows(spark, a2, b2)))
    assert (report.inserted, report.updated, report.deleted) == (0, 1, 0)

    # By hand: row a's v set to 99, its hash left as it was (that of v=10).
    edited = _hashed(_rows(spark, a2)).withColumn("v", F.lit(99).cast("long"))
    assert _merged(storage, cfg, edited, compared=True).updated == 1
    assert _merged(storage, cfg, _hashed(_rows(spark, a2))).updated == 0
    assert silver_values(storage, cfg) == {("a", 99), ("b", 21)}

    whole_join = _hashed(_rows(spark, a2, b2))
    counts = silver.write_all(storage, cfg, whole_join, storage.version(cfg.silver_path))
    assert counts["updated"] == 1
    assert silver_values(storage, cfg) == {("a", 10), ("b", 21)}


def test_a_silver_row_from_before_the_values_hash_is_updated_once(tmp_path, spark, storage):
    """Silver written before rows carried ``_values_hash`` (rows without it are compared column
    by column): the first MERGE of rows with it adds the column, and a row it matches counts as
    changed once (its hash is NULL); from then on the hashes are compared."""
    pipeline, _ = make_pipeline(tmp_path, spark, storage)
    cfg = pipeline.config
    a1, a2 = ("a", "a", 1, 10, "x", "1", "1", 1, "upsert"), ("a", "a", 1, 10, "x", "2", "2", 2, "upsert")
    merge_into_silver(storage, cfg, _rows(spark, a1))  # compared column by column
    assert _merged(storage, cfg, _rows(spark, a2)).updated == 0
    assert _merged(storage, cfg, _hashed(_rows(spark, a2))).updated == 1
    assert _merged(storage, cfg, _hashed(_rows(spark, a2))).updated == 0
    assert silver_values(storage, cfg) == {("a", 10)}


def silver_values(storage, cfg):
    return {tuple(r) for r in storage.read(cfg.silver_path).select("key", "v").collect()}
