"""Changing ``select`` (or a join) between runs, and select lists that name what isn't there."""

from __future__ import annotations

import base64
import json
import logging
import re

import pytest
import yaml
from pyspark.logger import PySparkLogger

from cdc_join.cli import main as cli
from cdc_join.config import load_config
from cdc_join.errors import ConfigError, ConfigErrors, StorageError
from cdc_join.landing.event_writer import EventWriter
from cdc_join.run.pipeline import Pipeline
from tests.support import LHS_RHS_TABLES, make_pipeline, silver_rows

pytestmark = [pytest.mark.redefinition]

LHS = LHS_RHS_TABLES["lhs"]


def _started(tmp_path, spark, storage):
    pipeline, w = make_pipeline(tmp_path, spark, storage, join_type="left")
    w.write("rhs", [w.upsert("rhs", {"id": i, "value": f"r{i}"}, i) for i in (1, 2)])
    w.write("lhs", [w.upsert("lhs", {"id": k, "fk": 1 + n % 2, "v": n}, 10 + n) for n, k in enumerate("abc")])
    pipeline.run()
    return pipeline, w


def _with_select(pipeline: Pipeline, select: dict[str, str]) -> Pipeline:
    path = pipeline.config.config_path
    spec = yaml.safe_load(path.read_text())
    spec["select"] = select
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return Pipeline(load_config(path), pipeline.spark, pipeline.storage)


def test_a_select_naming_a_missing_column_fails_before_anything_is_written(tmp_path, spark, storage, capsys):
    pipeline, w = _started(tmp_path, spark, storage)
    cfg = pipeline.config
    bad = _with_select(pipeline, {"key": "lhs.id", "value": "rhs.phone"})
    w.write("lhs", [w.upsert("lhs", {"id": "d", "fk": 1, "v": 9}, 30)])
    versions = {p: storage.version(p) for p in (cfg.silver_path, cfg.state_path("lhs"), cfg.runs_path)}
    with pytest.raises(ConfigError, match=r"select\.value: 'rhs.phone' cannot be computed") as info:
        bad.run()
    assert "rhs: id, value" in str(info.value)  # the columns the source does have
    assert {p: storage.version(p) for p in versions} == versions
    assert cli.main(["--storage", "delta-rs", "-q", "run", str(cfg.config_path)]) == 2
    err = capsys.readouterr().err
    assert "pipeline.yml: select.value" in err and "Traceback" not in err
    # Every expression the sources cannot compute is reported in one go.
    worse = _with_select(pipeline, {"key": "lhs.id", "value": "rhs.phone", "total": "lhs.amount + 1"})
    with pytest.raises(ConfigErrors) as many:
        worse.run()
    assert [p.key for p in many.value.problems] == ["select.value", "select.total"]
    assert str(many.value).startswith(f"{cfg.config_path}: 2 problems:")
    assert {p: storage.version(p) for p in versions} == versions
    # PySpark logs the caught analysis error as JSON with its Java stack trace, on a handler of
    # its own that capsys may not see: the CLI turns that logger off unless --debug is given.
    assert not PySparkLogger.getLogger("SQLQueryContextLogger").isEnabledFor(logging.ERROR)
    assert cli.main(["--storage", "delta-rs", "-q", "--debug", "run", str(cfg.config_path)]) == 2
    assert PySparkLogger.getLogger("SQLQueryContextLogger").isEnabledFor(logging.ERROR)
    capsys.readouterr()


def test_an_added_column_is_filled_for_every_row_with_silver_history_kept(tmp_path, spark, storage):
    pipeline, _ = _started(tmp_path, spark, storage)
    before = storage.version(pipeline.config.silver_path)
    wider = _with_select(
        pipeline,
        {"key": "lhs.id", "fk": "lhs.fk", "v": "lhs.v", "value": "rhs.value", "up": "upper(rhs.value)"},
    )
    report = wider.run()  # no new events: the definition alone calls for the recompute
    assert report.steps["plan"]["decision"] == "recompute"
    assert "added up" in report.steps["plan"]["reason"]
    assert silver_rows(wider, ["key", "value", "up"]) == {
        ("a", "r1", "R1"),
        ("b", "r2", "R2"),
        ("c", "r1", "R1"),
    }
    assert storage.version(wider.config.silver_path) > before  # the same table, one more commit
    assert wider.verify().ok
    assert wider.run().idle is not None  # once applied, the definition stands: nothing to do


@pytest.mark.storage_path  # schema replacement and widening differ by backend
def test_a_dropped_or_retyped_column_replaces_silver_s_schema_in_one_commit(tmp_path, spark, storage):
    pipeline, w = _started(tmp_path, spark, storage)
    path = pipeline.config.silver_path
    before = storage.version(path)
    changed = _with_select(pipeline, {"key": "lhs.id", "v": "concat('#', lhs.v)", "value": "rhs.value"})
    report = changed.run()
    assert "dropped fk" in report.steps["plan"]["reason"] and "changed v" in report.steps["plan"]["reason"]
    assert report.steps["silver"]["replaced"]
    columns = {f.name: f.dataType.simpleString() for f in storage.schema(path).fields}
    assert "fk" not in columns and columns["v"] == "string"
    assert silver_rows(changed, ["key", "v", "value"]) == {
        ("a", "#0", "r1"),
        ("b", "#1", "r2"),
        ("c", "#2", "r1"),
    }
    assert storage.version(path) == before + 1
    w.write("rhs", [w.upsert("rhs", {"id": 1, "value": "r1*"}, 40)])
    changed.run()
    assert silver_rows(changed, ["key", "v", "value"]) == {
        ("a", "#0", "r1*"),
        ("b", "#1", "r2"),
        ("c", "#2", "r1*"),
    }
    assert changed.verify().ok


def _with_spec(pipeline: Pipeline, change) -> Pipeline:
    path = pipeline.config.config_path
    spec = yaml.safe_load(path.read_text())
    change(spec)
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return Pipeline(load_config(path), pipeline.spark, pipeline.storage)


GROUPS = {
    "lhs": {"id": "string", "fk": "int64", "g": "int64", "v": "int64"},
    "rhs": {"id": "int64", "value": "string"},
    "grp": {"id": "int64", "name": "string"},
}


def test_an_added_join_subscribes_every_left_row_so_later_right_changes_reach_them(tmp_path, spark, storage):
    pipeline, w = make_pipeline(
        tmp_path,
        spark,
        storage,
        tables={"lhs": GROUPS["lhs"], "rhs": GROUPS["rhs"]},
        join_type="left",
        select={"key": "lhs.id", "value": "rhs.value"},
    )
    w = EventWriter(tmp_path / "landing", GROUPS)  # grp's events land before it is joined
    w.write("rhs", [w.upsert("rhs", {"id": 1, "value": "r1"}, 1)])
    w.write("grp", [w.upsert("grp", {"id": 7, "name": "g7"}, 2)])
    w.write("lhs", [w.upsert("lhs", {"id": k, "fk": 1, "g": 7, "v": 1}, 10 + n) for n, k in enumerate("abc")])
    pipeline.run()

    def add_join(spec):
        spec["sources"]["grp"] = {**spec["sources"]["rhs"], "landing": "landing/grp"}
        spec["joins"].append({"right": "grp", "foreign_key": ["g"], "type": "left"})
        spec["select"]["gname"] = "grp.name"

    joined = _with_spec(pipeline, add_join)
    assert "joins changed" in joined.run().steps["plan"]["reason"]  # no new left event
    assert silver_rows(joined, ["key", "gname"]) == {("a", "g7"), ("b", "g7"), ("c", "g7")}
    w.write("grp", [w.upsert("grp", {"id": 7, "name": "g7*"}, 30)])
    assert joined.run().steps["plan"]["decision"] == "incremental"
    assert silver_rows(joined, ["key", "gname"]) == {("a", "g7*"), ("b", "g7*"), ("c", "g7*")}
    assert joined.verify().ok


def test_a_join_whose_foreign_key_changes_subscribes_the_new_key_not_the_old(tmp_path, spark, storage):
    tables = {"lhs": GROUPS["lhs"], "grp": GROUPS["grp"]}
    joins = [{"right": "grp", "foreign_key": ["fk"], "type": "left"}]
    pipeline, w = make_pipeline(
        tmp_path, spark, storage, tables=tables, joins=joins, select={"key": "lhs.id", "gname": "grp.name"}
    )
    w.write("grp", [w.upsert("grp", {"id": i, "name": f"g{i}"}, i) for i in (1, 7)])
    w.write("lhs", [w.upsert("lhs", {"id": k, "fk": 1, "g": 7, "v": 1}, 10 + n) for n, k in enumerate("abc")])
    pipeline.run()

    def on_g(spec):
        spec["joins"][0]["foreign_key"] = ["g"]

    moved = _with_spec(pipeline, on_g)
    moved.run()
    assert silver_rows(moved, ["key", "gname"]) == {("a", "g7"), ("b", "g7"), ("c", "g7")}
    w.write(
        "grp", [w.upsert("grp", {"id": 1, "name": "g1*"}, 30), w.upsert("grp", {"id": 7, "name": "g7*"}, 31)]
    )
    moved.run()
    assert silver_rows(moved, ["key", "gname"]) == {("a", "g7*"), ("b", "g7*"), ("c", "g7*")}
    assert moved.verify().ok


def test_a_foreign_key_naming_a_column_the_left_source_lacks_fails_before_anything_is_written(
    tmp_path, spark, storage
):
    pipeline, w = _started(tmp_path, spark, storage)
    cfg = pipeline.config
    bad = _with_spec(pipeline, lambda spec: spec["joins"][0].update(foreign_key=["fkk"]))
    w.write("lhs", [w.upsert("lhs", {"id": "d", "fk": 1, "v": 9}, 30)])
    versions = {p: storage.version(p) for p in (cfg.silver_path, cfg.state_path("lhs"), cfg.runs_path)}
    with pytest.raises(ConfigError, match=r"joins\[0\]\.foreign_key: 'lhs' has no column 'fkk'"):
        bad.run()
    assert {p: storage.version(p) for p in versions} == versions


def test_full_refresh_and_verify_repair_apply_a_changed_select(tmp_path, spark, storage, backend):
    pipeline, _ = _started(tmp_path, spark, storage)
    history = len(storage.history(pipeline.config.silver_path))
    first = storage.version(pipeline.config.silver_path)
    # A retyped column: verify reports silver as different (it was written for the old
    # definition) instead of failing to compare, and --repair applies the new one.
    retyped = _with_select(
        pipeline, {"key": "lhs.id", "fk": "lhs.fk", "v": "cast(lhs.v AS string)", "value": "rhs.value"}
    )
    found = retyped.verify()
    assert not found.ok
    repaired = retyped.verify(repair=True)
    assert repaired.ok and repaired.repaired
    assert silver_rows(retyped, ["key", "v"]) == {("a", "0"), ("b", "1"), ("c", "2")}
    # An added column, applied by a full refresh.
    wider = _with_select(
        retyped,
        {
            "key": "lhs.id",
            "fk": "lhs.fk",
            "v": "cast(lhs.v AS string)",
            "value": "rhs.value",
            "up": "upper(rhs.value)",
        },
    )
    wider.full_refresh()
    assert silver_rows(wider, ["key", "up"]) == {("a", "R1"), ("b", "R2"), ("c", "R1")}
    assert len(storage.history(wider.config.silver_path)) > history  # the same table, history kept
    path = wider.config.silver_path
    if backend == "delta-spark":
        # Delta reads no change feed across a retyped column: the read is refused, naming the
        # commit, and a reader goes on from there.
        with pytest.raises(StorageError, match=r"across its schema change at version (\d+)") as refused:
            storage.read_changes(path, first)
        first = int(re.search(r"at version (\d+)", str(refused.value)).group(1))
    # The change feed reads across the added column: the inserts of `first` are still there.
    feed = storage.read_changes(path, first).filter("_change_type = 'insert'")
    assert {r.key for r in feed.filter(f"_commit_version = {first}").collect()} == {"a", "b", "c"}


def _left(name: str):
    """A spec change: ``name`` becomes the left source (``lhs`` or ``lhs2``), the other goes."""

    def change(spec):
        other = "lhs2" if name == "lhs" else "lhs"
        spec["sources"][name] = {**spec["sources"].pop(other), "landing": f"landing/{name}"}
        spec["left"] = name
        spec["select"] = {"key": f"{name}.id", "fk": f"{name}.fk", "v": f"{name}.v", "value": "rhs.value"}

    return change


def test_a_new_left_source_replaces_silver_s_rows_and_an_earlier_one_comes_back_current(
    tmp_path, spark, storage
):
    # A left source other than the last run's, even one a still earlier config used: its state
    # may be out of date and silver holds another source's rows, so the run rebuilds every
    # state table from bronze and replaces silver's rows (an incremental run would MERGE the
    # new source's changed keys into the old source's rows).
    tables = {"lhs": LHS, "lhs2": LHS, "rhs": GROUPS["rhs"]}
    pipeline, _ = make_pipeline(tmp_path, spark, storage, tables={"lhs": LHS, "rhs": GROUPS["rhs"]})
    w = EventWriter(tmp_path / "landing", tables)
    w.write("rhs", [w.upsert("rhs", {"id": i, "value": f"r{i}"}, i) for i in (1, 2)])
    w.write("lhs", [w.upsert("lhs", {"id": k, "fk": 1, "v": n}, 10 + n) for n, k in enumerate("ab")])
    pipeline.run()
    w.write("lhs2", [w.upsert("lhs2", {"id": "x", "fk": 2, "v": 7}, 20)])

    second = _with_spec(pipeline, _left("lhs2"))
    report = second.run()
    assert "the left source changed since the last run (lhs → lhs2)" in report.steps["plan"]["reason"]
    assert report.steps["silver"]["replaced"]
    assert silver_rows(second, ["key", "fk", "v", "value"]) == {("x", 2, 7, "r2")}
    assert second.verify().ok

    # lhs changes while it is not joined; its state still has the first config's rows.
    w.write("lhs", [w.upsert("lhs", {"id": "a", "fk": 2, "v": 5}, 30), w.delete("lhs", {"id": "b"}, 31)])
    third = _with_spec(second, _left("lhs"))
    assert "(lhs2 → lhs)" in third.run().steps["plan"]["reason"]
    assert silver_rows(third, ["key", "fk", "v", "value"]) == {("a", 2, 5, "r2")}
    w.write("rhs", [w.upsert("rhs", {"id": 2, "value": "r2*"}, 40)])
    assert third.run().steps["plan"]["decision"] == "incremental"
    assert silver_rows(third, ["key", "fk", "v", "value"]) == {("a", 2, 5, "r2*")}
    assert third.verify().ok


def test_a_changed_left_primary_key_replaces_silver_s_rows(tmp_path, spark, storage):
    # Silver's rows are keyed by the left key: a MERGE on (id, v) would match none of the rows
    # written for (id), so each changed row would be there twice.
    pipeline, w = _started(tmp_path, spark, storage)
    rekeyed = _with_spec(pipeline, lambda spec: spec["sources"]["lhs"].update(primary_key=["id", "v"]))
    w.write("lhs", [w.upsert("lhs", {"id": "a", "fk": 2, "v": 9}, 30)])
    report = rekeyed.run()
    assert "the primary key of lhs changed since the last run" in report.steps["plan"]["reason"]
    assert silver_rows(rekeyed, ["key", "fk", "v", "value"]) == {
        ("a", 1, 0, "r1"),  # (a, 0) and (a, 9) are two rows now
        ("a", 2, 9, "r2"),
        ("b", 2, 1, "r2"),
        ("c", 1, 2, "r1"),
    }
    assert rekeyed.verify().ok
    w.write("rhs", [w.upsert("rhs", {"id": 1, "value": "r1*"}, 40)])
    assert rekeyed.run().steps["plan"]["decision"] == "incremental"
    assert silver_rows(rekeyed, ["key", "v", "value"]) == {
        ("a", 0, "r1*"),
        ("a", 9, "r2"),
        ("b", 1, "r2"),
        ("c", 2, "r1*"),
    }
    assert rekeyed.verify().ok


def _decimal_event(key: str, fk: int, unscaled: int, scale: int, precision: int, lsn: int) -> str:
    """An enveloped event of ``lhs`` whose ``amount`` is a Connect Decimal(precision, scale)."""
    amount = {
        "field": "amount",
        "type": "bytes",
        "optional": True,
        "name": "org.apache.kafka.connect.data.Decimal",
        "parameters": {"scale": str(scale), "connect.decimal.precision": str(precision)},
    }
    row = {
        "type": "struct",
        "optional": True,
        "fields": [{"field": "id", "type": "string"}, {"field": "fk", "type": "int64"}, amount],
    }
    schema = {
        "type": "struct",
        "fields": [{**row, "field": "before"}, {**row, "field": "after"}, {"type": "string", "field": "op"}],
    }
    size = max(1, (unscaled.bit_length() + 8) // 8)
    value = base64.b64encode(unscaled.to_bytes(size, "big", signed=True)).decode()
    after = {"id": key, "fk": fk, "amount": value}
    payload = {"op": "c", "before": None, "after": after, "source": {"connector": "postgresql", "lsn": lsn}}
    return json.dumps({"schema": schema, "payload": payload})


@pytest.mark.storage_path  # schema replacement and widening differ by backend
def test_a_source_column_whose_type_changes_recomputes_every_row(tmp_path, spark, storage):
    # A value of `select` may depend on a type, not only on a value: the text of a decimal
    # whose scale grew. The rows that did not change must get the new text too.
    tables = {"lhs": {"id": "string", "fk": "int64", "amount": "string"}, "rhs": GROUPS["rhs"]}
    select = {"key": "lhs.id", "label": "concat(lhs.id, ':', lhs.amount)", "value": "rhs.value"}
    pipeline, w = make_pipeline(tmp_path, spark, storage, tables=tables, select=select)
    w.write("rhs", [w.upsert("rhs", {"id": 1, "value": "r1"}, 1)])
    w.write("lhs", [_decimal_event("a", 1, 150, 2, 10, 2), _decimal_event("b", 1, 225, 2, 10, 3)])
    pipeline.run()
    assert silver_rows(pipeline, ["key", "label"]) == {("a", "a:1.50"), ("b", "b:2.25")}
    w.write("lhs", [_decimal_event("c", 1, 31234, 4, 12, 4)])  # the column is decimal(12,4) now
    report = pipeline.run()
    assert "column types of lhs changed" in report.steps["plan"]["reason"]
    labels = {("a", "a:1.5000"), ("b", "b:2.2500"), ("c", "c:3.1234")}
    assert silver_rows(pipeline, ["key", "label"]) == labels
    assert pipeline.verify().ok
    w.write("rhs", [w.upsert("rhs", {"id": 1, "value": "r1*"}, 5)])
    assert pipeline.run().steps["plan"]["decision"] == "incremental"  # recorded: no recompute again
    assert pipeline.verify().ok
