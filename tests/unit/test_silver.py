"""The silver hop: which rows a recompute hands to the MERGE, and what the MERGE does with them."""

from __future__ import annotations

from cdc_join import silver
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
