"""The README's and the reference's examples stay true: their YAML loads, their commands and
options exist and run, and they link to nothing outside the repository."""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import pytest
import yaml

from cdc_join.cli import main as cli
from cdc_join.config import parse_config
from tests.docs.test_examples import assert_expected_silver

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
#: The README and the reference in docs/, in the order a reader meets them.
DOCS = {"README.md": README} | {f"docs/{p.name}": p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))}


def _blocks(language: str, text: str | None = None) -> list[str]:
    """Fenced blocks of ``language`` in ``text`` (default: the README and every doc), dedented
    (a block inside a list item is indented)."""
    import textwrap

    texts = [text] if text is not None else list(DOCS.values())
    return [
        textwrap.dedent(b)
        for t in texts
        for b in re.findall(rf"^[ ]*```{language}\n(.*?)^[ ]*```", t, flags=re.S | re.M)
    ]


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
    assert {"status", "plan", "check", "optimize", "quarantine"} <= {c[0] for c in commands}
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
    assert len(commands) >= 12
    for command in commands:
        args = shlex.split(command)[1:]
        try:
            parser.parse_args(args)
        except SystemExit:
            pytest.fail(f"README command does not parse: {command}")


def _anchors(text: str = README) -> set[str]:
    """The anchors of a page's headings, as the forges make them."""
    headings = re.findall(r"^#+ (.+)$", text, flags=re.M)
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


def test_the_docs_link_only_inside_the_repository():
    # A clone has nothing but the repository: no design documents beside it, and pages on the
    # web move. Anchors inside a page are fine.
    for name, text in DOCS.items():
        assert not re.findall(r"https?://", text), f"{name} links to the web"
        folder = (ROOT / name).parent
        for target in re.findall(r"\]\(([^)]+)\)", text):
            if target.startswith("#"):
                assert target[1:] in _anchors(text), f"{name} links to a missing heading: {target}"
                continue
            resolved = (folder / target.split("#")[0]).resolve()
            assert ROOT in resolved.parents or resolved == ROOT, f"{name} points outside: {target}"
            assert resolved.exists(), f"{name} links to a missing file: {target}"


def test_the_readme_stays_short():
    assert len(README.splitlines()) < 200


def test_a_landing_example_writes_under_a_temporary_name_then_renames():
    # A run that lists a file while it is written would quarantine its partial last line, and
    # the next run stop at a file that changed after it was ingested.
    for block in _blocks("bash"):
        for target in re.findall(r">\s*(landing/\S+)", block):
            name = target.rsplit("/", 1)[-1]
            assert name.startswith("_"), f"{target} is written under its final name"
            assert re.search(rf"mv {re.escape(target)} \S+/{re.escape(name[1:])}", block), target


def test_the_readme_s_python_line_imports_what_it_names():
    import cdc_join

    line = re.search(r"From Python: `(from cdc_join import [^`]+)`", README)
    assert line, "the README says how to run a pipeline from Python"
    namespace: dict = {}
    exec(line.group(1), namespace)
    assert namespace["Pipeline"].run and namespace["load_config"] is cdc_join.load_config
