"""The README's examples stay true: its YAML loads, its commands and options exist, and it
links to nothing outside the repository."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from cdc_join import cli
from cdc_join.config import parse_config

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


def test_the_exit_code_table_matches_the_cli():
    table = dict(re.findall(r"^\| (\d) \| (.+?) \|$", README, flags=re.M))
    assert set(table) == {"0", "1", "2", "3", "4", "5"}
    codes = (cli.OK, cli.DIFFERENCES, cli.CONFIG_ERROR, cli.DATA_PROBLEM, cli.BUSY, cli.FAILURE)
    assert [str(c) for c in codes] == sorted(table)
    for code, meaning in table.items():  # the same words as `cdc-join --help`
        word = meaning.split()[0].strip("`").lower()
        assert word in cli.__doc__.lower(), f"exit code {code}: {meaning}"


def test_the_readme_links_only_inside_the_repository():
    for target in re.findall(r"\]\(([^)]+)\)", README) + re.findall(r"`(\.\./[^`]+)`", README):
        if target.startswith(("http://", "https://", "#")):
            continue
        assert not target.startswith(".."), f"README points outside the repository: {target}"
        assert (ROOT / target.split("#")[0]).exists(), f"README links to a missing file: {target}"
