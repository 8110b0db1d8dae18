"""A session's SQL parser settings do not change what a run reads or writes.

The engine builds its Spark work as SQL text. Two settings change how Spark reads such text:
with ``spark.sql.parser.escapedStringLiterals`` on (a legacy setting some clusters keep) a
backslash escape in a string literal stays a backslash, and ``spark.sql.variable.substitute``
(on by default) replaces ``${name}`` in the text, inside quotes too. Keys, column names, paths
and the parser's own patterns must read the same either way (``cdc_join.schemas.sql_string``).
"""

from __future__ import annotations

import json

import pytest

from cdc_join.schemas import sql_string
from tests.support import make_pipeline, silver_rows

ESCAPED = "spark.sql.parser.escapedStringLiterals"


@pytest.fixture(params=[False, True], ids=["default", "escapedStringLiterals"])
def escaped(request, spark):
    before = spark.conf.get(ESCAPED)
    spark.conf.set(ESCAPED, str(request.param).lower())
    yield request.param
    spark.conf.set(ESCAPED, before)


TEXTS = [
    "plain",
    "it's",
    "back\\slash",
    "\\'",
    "${env:HOME}",
    "${spark.app.name}",
    "$ and {",
    "line\nbreak\r",
    "\ufeffbom",
    "é漢字😀",
    "",
]


def test_a_sql_string_reads_back_as_its_text(spark, escaped):
    row = spark.sql("SELECT " + ", ".join(f"{sql_string(t)} AS c{i}" for i, t in enumerate(TEXTS))).first()
    assert list(row) == TEXTS


def test_a_run_reads_tricky_keys_and_a_bom_crlf_file_the_same_under_either_setting(
    tmp_path, spark, storage, escaped
):
    pipeline, w = make_pipeline(tmp_path, spark, storage, join_type="left")
    keys = ["a\\b", "it's", "${env:HOME}", "${spark.app.name}", "plain"]
    w.write("rhs", [w.upsert("rhs", {"id": 1, "value": "r\\1 ${env:HOME}"}, 1)])
    # One file as Windows tools write it: a byte-order mark, CRLF endings, a blank line.
    lines = [json.dumps(w.upsert("lhs", {"id": k, "fk": 1, "v": i}, 10 + i)) for i, k in enumerate(keys)]
    body = "\ufeff" + "\r\n".join([lines[0], " \t", *lines[1:]]) + "\r\n"
    (w.root / "lhs" / "windows.jsonl").write_bytes(body.encode("utf-8"))
    report = pipeline.run()
    assert report.steps["ingest"]["lhs"] == {"files": 1, "events": len(keys), "quarantined": 0}
    assert silver_rows(pipeline) == {(k, 1, i, "r\\1 ${env:HOME}") for i, k in enumerate(keys)}
    # The next run changes rows by those keys: state, lookups and silver's MERGE match them.
    w.write("lhs", [w.upsert("lhs", {"id": k, "fk": 1, "v": 100 + i}, 100 + i) for i, k in enumerate(keys)])
    w.write("rhs", [w.upsert("rhs", {"id": 1, "value": "it's \\new"}, 200)])
    pipeline.run()
    assert silver_rows(pipeline) == {(k, 1, 100 + i, "it's \\new") for i, k in enumerate(keys)}
    assert pipeline.verify().ok
