"""The walkthrough notebook runs, cell by cell, in-process: it cannot rot unnoticed.

The notebook is in Databricks source format (``# COMMAND ----------`` between cells, markdown
cells as ``# MAGIC`` lines). Its code cells are executed in order in one namespace holding the
test session's ``spark``, with the demo writing under a temporary folder.
"""

from __future__ import annotations

from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "walkthrough.py"
HEADER = "# Databricks notebook source"
SEPARATOR = "# COMMAND ----------"


def cells(text: str) -> list[tuple[str, str]]:
    """``(kind, source)`` per cell, ``kind`` being ``markdown`` or ``python``."""
    assert text.startswith(HEADER), f"{NOTEBOOK.name} is not a Databricks source notebook"
    out = []
    for chunk in text[len(HEADER) :].split(SEPARATOR):
        lines = [line for line in chunk.strip().splitlines()]
        if not lines:
            continue
        magic = all(line.startswith("# MAGIC") for line in lines)
        out.append(("markdown" if magic else "python", "\n".join(lines)))
    return out


def test_notebook_installs_nothing_and_explains_the_flow():
    notebook = cells(NOTEBOOK.read_text())
    code = "\n".join(src for kind, src in notebook if kind == "python")
    magics = [src for kind, src in notebook if kind == "markdown" and not src.startswith("# MAGIC %md")]
    assert not magics, f"only markdown magics are allowed, found {magics}"
    for forbidden in ("pip install", "%pip", "dbutils.library", "subprocess", "os.system"):
        assert forbidden not in code, f"a code cell must not install anything ({forbidden!r})"
    markdown = "\n".join(src for kind, src in notebook if kind == "markdown")
    assert "KIP-213" in markdown and "subscription/<join>" in markdown  # the diagram


def test_notebook_runs_the_demo_and_shows_silver_runs_and_quality(spark, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CDC_JOIN_DEMO_DIR", str(tmp_path))
    namespace = {"__name__": "__main__", "spark": spark}
    code = [src for kind, src in cells(NOTEBOOK.read_text()) if kind == "python"]
    assert code
    for i, source in enumerate(code):
        try:
            exec(compile(source, f"{NOTEBOOK.name}[code cell {i}]", "exec"), namespace)
        except Exception as e:  # name the cell that broke
            pytest.fail(f"code cell {i} of {NOTEBOOK.name} raised {type(e).__name__}: {e}")
    out = capsys.readouterr().out
    assert "silver matches the join of the current sources" in out
    assert namespace["silver"].count() == 4  # 10001, 10002, 10003, 10005
    assert namespace["runs"].count() == 2
    report = namespace["report"]
    assert report.ok, report.summary()
    assert [r.check for r in report.warnings] == ["freshness"]
    assert namespace["quality"].count() == len(report.results)
