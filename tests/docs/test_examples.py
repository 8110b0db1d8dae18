"""Every pipeline under examples/ runs as shipped and gives the silver rows it promises."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from cdc_join.cli import main as cli
from cdc_join.config import load_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


# The inventory example is run by tests/docs/test_readme.py, with every command of the README.
@pytest.mark.parametrize(
    "name",
    sorted(p.name for p in EXAMPLES.iterdir() if (p / "pipeline.yml").is_file() and p.name != "inventory"),
)
def test_example_runs_and_gives_its_expected_silver(name, tmp_path, spark, storage, capsys):
    folder = tmp_path / name
    shutil.copytree(EXAMPLES / name, folder)
    config = str(folder / "pipeline.yml")
    assert cli.main(["--storage", "delta-rs", "-q", "run", config]) == 0, capsys.readouterr().err
    assert_expected_silver(folder, storage)
    assert cli.main(["--storage", "delta-rs", "-q", "verify", config]) == 0


def assert_expected_silver(folder: Path, storage) -> None:
    """Silver of the example copied to ``folder`` holds exactly its ``expected.json`` rows."""
    expected = json.loads((folder / "expected.json").read_text())
    columns = list(expected[0])
    silver = storage.read(load_config(folder / "pipeline.yml").silver_path).select(*columns).collect()
    assert sorted((r.asDict() for r in silver), key=str) == sorted(expected, key=str)


# Examples whose changes must reach silver the incremental way too: each landing file is its own
# run (in the order the files were written), so the later files' changes go through lookups.
@pytest.mark.parametrize("name", ["tpch_chain", "nested_orders"])
def test_example_replayed_one_file_per_run_ends_at_its_expected_silver(
    name, tmp_path, spark, storage, capsys
):
    shipped = EXAMPLES / name
    folder = tmp_path / name
    shutil.copytree(shipped, folder, ignore=shutil.ignore_patterns("*.jsonl", "lake"))
    config = str(folder / "pipeline.yml")
    files = sorted((shipped / "landing").rglob("*.jsonl"), key=lambda p: p.stem.rsplit("-", 1)[1])
    for landed in files:
        shutil.copy(landed, folder / landed.relative_to(shipped))
        assert cli.main(["--storage", storage.name, "-q", "run", config]) == 0, capsys.readouterr().err
    assert_expected_silver(folder, storage)
    assert cli.main(["--storage", storage.name, "-q", "verify", config]) == 0
