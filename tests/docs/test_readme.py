"""The README's examples stay true: its YAML loads, its commands and options exist, and it
links to nothing outside the repository."""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import pytest
import yaml

from cdc_join import cli
from cdc_join.config import parse_config
from tests.docs.test_examples import assert_expected_silver

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def test_every_pipeline_yaml_in_the_readme_loads(tmp_path):
    pipelines = [yaml.safe_load(b) for b in _blocks("yaml")]
    pipelines = [p for p in pipelines if isinstance(p, dict) and "sources" in p]
    assert pipelines, "the README shows a pipeline YAML"
    for raw in pipelines:
        config = parse_config(raw, base_dir=tmp_path, check_paths=False)
        assert config.select and config.output


def test_the_readme_s_commands_run_as_written_on_the_inventory_example(tmp_path, spark, storage, capsys):
    # As chispa runs its README: every `cdc-join … pipeline.yml` line of the README, in its order,
    # against a copy of examples/inventory; each must succeed.
    folder = tmp_path / "inventory"
    shutil.copytree(ROOT / "examples" / "inventory", folder)
    commands = [
        shlex.split(line.split("#")[0])[1:]
        for block in _blocks("bash")
        for line in block.splitlines()
        if line.strip().startswith("cdc-join ") and "pipeline.yml" in line
    ]
    assert [c[0] for c in commands][:3] == ["run", "full-refresh", "verify"]
    for args in commands:
        args = [str(folder / "pipeline.yml") if a == "pipeline.yml" else a for a in args]
        code = cli.main(["--storage", "delta-rs", "-q", *args])
        assert code == 0, f"cdc-join {' '.join(args)} exited {code}: {capsys.readouterr().err}"
    assert_expected_silver(folder, storage)  # the example's promise, as for the other examples


def test_every_cdc_join_command_in_the_readme_parses():
    parser = cli.build_parser()
    commands = [
        line.split("#")[0].strip()
        for block in _blocks("bash")
        for line in block.splitlines()
        if line.strip().startswith("cdc-join ")
    ]
    assert len(commands) >= 8
    for command in commands:
        args = shlex.split(command)[1:]
        try:
            parser.parse_args(args)
        except SystemExit:
            pytest.fail(f"README command does not parse: {command}")


def _anchors() -> set[str]:
    """The anchors of the README's headings, as GitHub makes them."""
    headings = re.findall(r"^#+ (.+)$", README, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_the_exit_code_table_matches_the_cli():
    table = dict(re.findall(r"^\| (\d) \| (.+?) \|$", README, flags=re.M))
    codes = (cli.OK, cli.DIFFERENCES, cli.CONFIG_ERROR, cli.DATA_PROBLEM, cli.BUSY, cli.FAILURE)
    assert sorted(table) == [str(c) for c in codes] == ["0", "1", "2", "3", "4", "5"]
    # `cdc-join --help` prints the module docstring: each code's line there starts the README's.
    helped = dict(re.findall(r"^  (\d)  (.+)$", cli.__doc__, flags=re.M))
    assert sorted(helped) == sorted(table)
    for code, meaning in table.items():
        head = re.split(r"[(:]", helped[code])[0].strip().lower()
        assert meaning.replace("`", "").lower().startswith(head), f"exit code {code}: {meaning!r} vs {head!r}"


def test_the_readme_links_only_inside_the_repository():
    # A clone has nothing but the repository: no design documents beside it, and pages on the
    # web move. Anchors inside the README are fine.
    assert not re.findall(r"https?://", README), "README links to the web"
    for target in re.findall(r"\]\(([^)]+)\)", README) + re.findall(r"`(\.\./[^`]+)`", README):
        if target.startswith("#"):
            assert target[1:] in _anchors(), f"README links to a missing heading: {target}"
            continue
        assert not target.startswith(".."), f"README points outside the repository: {target}"
        assert (ROOT / target.split("#")[0]).exists(), f"README links to a missing file: {target}"
