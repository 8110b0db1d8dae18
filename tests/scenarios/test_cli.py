"""Every command's exit codes, as a scheduler sees them, and what a person sees on a failure:
one line saying what failed and what to do next, no stack trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from pyspark.sql import functions as F

from cdc_join.cli import main as cli
from cdc_join.run.runlog import run_lock
from tests.support import make_pipeline


@pytest.fixture
def landed(tmp_path, spark, storage):
    pipeline, w = make_pipeline(tmp_path, spark, storage, join_type="left")
    w.write("rhs", [w.upsert("rhs", {"id": 1, "value": "r1"}, 1)])
    w.write("lhs", [w.upsert("lhs", {"id": "a", "fk": 1, "v": 0}, 2)])
    return pipeline, w, str(pipeline.config.config_path)


def _cli(*args: str) -> int:
    return cli.main(["--storage", "delta-rs", *args])


def _edit(config: str, change) -> None:
    path = Path(config)
    spec = yaml.safe_load(path.read_text())
    change(spec)
    path.write_text(yaml.safe_dump(spec))


def _one_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("cdc-join: error: ") and lines[1].startswith("  next: ")
    return lines[0]


def test_run_succeeds_with_0_and_json_is_one_document(landed, capsys):
    # Every command of the README succeeding with 0 is tests/docs/test_readme.py's.
    _, _, config = landed
    assert _cli("run", config, "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["steps"]["silver"]["inserted"] == 1
    assert _cli("verify", config, "--json") == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True


def test_json_is_one_document_with_its_command_and_schema_version_for_every_command(landed, capsys):
    _, w, config = landed
    assert _cli("-q", "run", config) == 0
    capsys.readouterr()
    w.write("lhs", [w.upsert("lhs", {"id": "b", "fk": 1, "v": 1}, 3)])
    for command in ("plan", "status", "run", "verify", "check", "optimize", "quarantine", "full-refresh"):
        assert _cli(command, config, "--json") == 0, command
        document = json.loads(capsys.readouterr().out)
        assert document["command"] == command and document["schema_version"] == cli.JSON_SCHEMA_VERSION


def test_plan_says_what_the_next_run_would_do_without_writing_anything(landed, storage, capsys):
    pipeline, w, config = landed
    assert _cli("-q", "run", config) == 0
    w.write("lhs", [w.upsert("lhs", {"id": "b", "fk": 1, "v": 1}, 3)])
    tables = {p: storage.version(p) for p in (pipeline.config.silver_path, pipeline.config.runs_path)}
    capsys.readouterr()
    assert _cli("plan", config, "--json") == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["pending"] == {"lhs": {"files": 1, "bytes": plan["pending"]["lhs"]["bytes"]}}
    assert plan["path"] == "incremental" and pipeline.config.bronze_path("lhs") in plan["writes"]
    assert {p: storage.version(p) for p in tables} == tables  # nothing written
    assert _cli("-q", "run", "--no-ingest", config) == 0  # nothing new in bronze: ...
    assert _cli("plan", config) == 0
    assert "to ingest: lhs: 1 file(s)" in capsys.readouterr().out


def test_plan_on_a_new_lake_says_what_the_first_run_will_do(tmp_path, spark, storage, capsys):
    pipeline, w = make_pipeline(tmp_path, spark, storage, join_type="left")
    config = str(pipeline.config.config_path)
    w.write("rhs", [w.upsert("rhs", {"id": 1, "value": "r1"}, 1)])
    assert _cli("plan", config) == 0  # only the right side has events
    assert "has no events yet: nothing to join" in capsys.readouterr().out
    w.write("lhs", [w.upsert("lhs", {"id": "a", "fk": 1, "v": 0}, 2)])
    assert _cli("plan", config, "--json") == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["path"] is None and plan["reason"].startswith("the first run: it ingests 2 landing file(s)")
    assert {pipeline.config.state_path("lhs"), pipeline.config.silver_path} <= set(plan["writes"])
    assert _cli("plan", config) == 0
    out = capsys.readouterr().out
    assert "path: chosen after the ingest (the first run" in out and "nothing event" not in out
    assert not Path(pipeline.config.silver_path).exists()  # plan wrote nothing


def test_status_shows_the_last_runs_each_source_and_the_tables(landed, capsys):
    pipeline, w, config = landed
    assert _cli("-q", "run", config) == 0
    w.write("lhs", ["not json"])
    assert _cli("-q", "run", config) == 3  # a quarantined line
    capsys.readouterr()
    assert _cli("status", config, "--json") == 0
    found = json.loads(capsys.readouterr().out)
    assert [r["run_id"] for r in found["runs"]] == [2, 1]
    assert found["sources"]["lhs"]["quarantined"] == 1 and found["sources"]["rhs"]["pending_files"] == 0
    assert found["tables"][pipeline.config.silver_path]["rows"] == 1
    assert found["unfinished"] == []
    assert _cli("status", config) == 0
    assert "run 2" in capsys.readouterr().out
    # Counted from file statistics where a file holds one source's lines, else read: compacted,
    # the quarantine is one file with both sources' lines.
    w.write("rhs", ["not json either", "{"])
    assert _cli("-q", "run", config) == 3
    assert _cli("-q", "optimize", "--force", config) == 0
    capsys.readouterr()
    assert _cli("status", config, "--json") == 0
    found = json.loads(capsys.readouterr().out)
    assert {name: s["quarantined"] for name, s in found["sources"].items()} == {"lhs": 1, "rhs": 2}


def test_demo_refuses_options_it_would_ignore(capsys):
    for option in (["--json"], ["--lake", "/tmp/x"]):
        assert cli.main(["demo", *option]) == 2
        assert "does not apply" in _one_error(capsys)


def test_verify_finding_a_difference_exits_1(landed, storage, capsys):
    pipeline, _, config = landed
    assert _cli("-q", "run", config) == 0
    silver = pipeline.config.silver_path
    storage.overwrite(silver, storage.read(silver).withColumn("v", F.lit(99).cast("long")))
    assert _cli("verify", config) == 1
    assert "differ" in capsys.readouterr().out.lower()


def test_a_config_error_exits_2_naming_the_key_before_spark_work(landed, capsys):
    _, _, config = landed
    _edit(config, lambda spec: spec["joins"][0].update(type="outer"))
    for command in ("run", "full-refresh", "verify", "check", "optimize", "quarantine"):
        assert _cli(command, config) == 2, command
        assert "joins[0].type" in _one_error(capsys)


def test_tables_by_name_on_delta_rs_exit_2_and_a_lake_override_runs_by_path(landed, capsys):
    _, _, config = landed
    _edit(config, lambda spec: spec.update(tables="main.cdc"))
    assert _cli("run", config) == 2
    error = _one_error(capsys)
    assert "tables: 'main.cdc' addresses tables by name" in error and "delta-rs" in error
    elsewhere = str(Path(config).parent / "elsewhere")
    assert _cli("-q", "--lake", elsewhere, "run", config) == 0  # --lake replaces tables too
    assert (Path(elsewhere) / "silver").is_dir()


def test_a_broken_quality_section_stops_a_run_too_naming_every_mistake(landed, capsys):
    _, _, config = landed
    quality = {"orphan_rate_max": 2, "expectations": [{"expectation": "expect_unicorns"}]}
    _edit(config, lambda spec: spec.update(quality=quality))
    for command in ("run", "check"):
        assert _cli(command, config) == 2, command
        err = capsys.readouterr().err
        assert "quality.orphan_rate_max: must be a number from 0 to 1" in err, err
        assert "quality.expectations[0].expectation: unknown expectation 'expect_unicorns'" in err, err


def test_an_invalid_storage_choice_exits_2(landed, monkeypatch, capsys):
    _, _, config = landed
    monkeypatch.setenv("CDC_JOIN_STORAGE", "sqlite")
    assert cli.main(["run", config]) == 2
    assert "CDC_JOIN_STORAGE" in _one_error(capsys)


def test_quarantined_events_exit_3_unless_the_pipeline_says_warn(landed, capsys):
    _, w, config = landed
    w.write("lhs", ["{not json"])
    assert _cli("run", config) == 3
    out = capsys.readouterr().out
    assert "WARNING: 1 line(s) of lhs quarantined (1 × not valid JSON); see 'cdc-join quarantine'" in out
    assert _cli("quarantine", config, "--source", "lhs") == 0
    assert "not valid JSON" in capsys.readouterr().out
    _edit(config, lambda spec: spec.update(on_quarantine="warn"))
    w.write("lhs", ["{still not json"])
    assert _cli("-q", "run", config) == 0


def test_another_run_holding_the_pipeline_exits_4(landed, capsys):
    pipeline, _, config = landed
    with run_lock(pipeline.config):
        assert _cli("run", config) == 4
    assert "next: run again when the other run is done" in capsys.readouterr().err


def test_a_storage_error_exits_5_without_a_stack_trace(landed, tmp_path, capsys):
    _, _, config = landed
    blocked = tmp_path / "not_a_folder"
    blocked.write_text("a file where the lake should be")
    assert _cli("--lake", str(blocked), "run", config) == 5
    _one_error(capsys)


def test_a_changed_landing_file_exits_3_and_says_to_move_it_out(landed, capsys):
    config = landed[2]
    assert _cli("-q", "run", config) == 0
    capsys.readouterr()
    changed = Path(config).parent / "landing" / "lhs" / "lhs-000002.jsonl"
    changed.write_text(changed.read_text() + changed.read_text())  # a line appended after ingest
    assert _cli("-q", "run", config) == 3
    line = _one_error(capsys)
    assert "lhs-000002.jsonl" in line
    assert _cli("-q", "run", config) == 3
    assert "move the changed file out of the landing folder" in capsys.readouterr().err
    assert _cli("check", config, "--run-id", "99") == 2  # an option naming no run
    assert "--run-id: run 99 is not in the run log" in _one_error(capsys)


def test_what_each_verbosity_prints(landed, capsys):
    _, w, config = landed
    with pytest.raises(SystemExit) as done:
        _cli("--version")
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"cdc-join {cli.__version__}"

    # Default: progress lines, then the report in users' words, KIP-213 counts left out.
    assert _cli("run", config) == 0
    out = capsys.readouterr().out.splitlines()
    assert any(line.startswith("  ingest lhs: 1 new file(s)") for line in out)
    report = out[out.index(next(line for line in out if line.startswith("cdc_join run 1: "))) :]
    assert report[1] == "  silver     1 inserted, 0 updated, 0 deleted"
    assert report[2].startswith("  events     ")
    assert report[3].startswith("  seconds    ")
    assert not any("instructions" in line for line in out)

    # -q: the report only, no progress; -v: every count of every step as well.
    w.write("lhs", [w.upsert("lhs", {"id": "b", "fk": 1, "v": 1}, 3)])
    assert _cli("-q", "run", config) == 0
    quiet = capsys.readouterr().out.splitlines()
    assert quiet[0].startswith("cdc_join run 2: incremental (")
    assert not any("ingest lhs:" in line for line in quiet)
    w.write("lhs", [w.upsert("lhs", {"id": "c", "fk": 1, "v": 2}, 4)])
    assert _cli("-v", "-q", "run", config) == 0
    verbose = capsys.readouterr().out
    assert "instructions=" in verbose and "subscription:rhs" in verbose

    # --debug: the stack trace of a failure as well as the one line.
    blocked = Path(config).parent / "not_a_folder"
    blocked.write_text("a file where the lake should be")
    assert _cli("--debug", "--lake", str(blocked), "run", config) == 5
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "cdc-join: error: " in err


def test_quarantine_lists_file_line_reason_and_raw_text_up_to_the_limit(landed, capsys):
    _, w, config = landed
    _edit(config, lambda spec: spec.update(on_quarantine="warn"))
    w.write("lhs", ["not json", '{"op": "c"}', "also not json"], name="bad.jsonl")
    assert _cli("-q", "run", config) == 0
    capsys.readouterr()
    assert _cli("quarantine", config, "--source", "lhs", "--limit", "2") == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 4  # two lines, each with its raw text below
    assert out[0].startswith("lhs bad.jsonl:") and out[1].startswith("    ")
    assert {out[1].strip(), out[3].strip()} <= {"not json", '{"op": "c"}', "also not json"}
    assert _cli("quarantine", config, "--source", "rhs") == 0
    assert capsys.readouterr().out.strip() == "no quarantined lines"
