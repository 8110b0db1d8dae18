"""Every pipeline under examples/ runs as shipped and gives the silver rows it promises."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from cdc_join import cli
from cdc_join.config import load_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.iterdir() if (p / "pipeline.yml").is_file()))
def test_example_runs_and_gives_its_expected_silver(name, tmp_path, spark, storage, capsys):
    folder = tmp_path / name
    shutil.copytree(EXAMPLES / name, folder)
    config = str(folder / "pipeline.yml")
    assert cli.main(["--storage", "delta-rs", "-q", "run", config]) == 0, capsys.readouterr().err
    expected = json.loads((folder / "expected.json").read_text())
    columns = list(expected[0])
    silver = storage.read(load_config(config).silver_path).select(*columns).collect()
    assert sorted((r.asDict() for r in silver), key=str) == sorted(expected, key=str)
    assert cli.main(["--storage", "delta-rs", "-q", "verify", config]) == 0
