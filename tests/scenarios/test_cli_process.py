"""The CLI as a separate process, as a user or a scheduler starts it: what it checks before Spark
starts, and that Spark's and the JVM's start-up output stays off the terminal."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from cdc_join.landing.event_writer import EventWriter

_NO_SPARK = textwrap.dedent(
    """
    import sys
    from cdc_join.cli import main as cli
    code = cli.main(sys.argv[1:])
    from pyspark import SparkContext
    from pyspark.sql import SparkSession
    started = SparkContext._gateway is not None or SparkSession.getActiveSession() is not None
    print("spark started" if started else "no spark", code)
    """
)


def _python(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )


def _tiny(tmp_path) -> str:
    tables = {"lhs": {"id": "string", "fk": "int64"}, "rhs": {"id": "int64", "value": "string"}}
    w = EventWriter(tmp_path / "landing", tables)
    w.write("rhs", [w.upsert("rhs", {"id": 1, "value": "one"}, 1)])
    w.write("lhs", [w.upsert("lhs", {"id": "a", "fk": 1}, 2)])
    spec = {
        "name": "tiny",
        "lake": "lake",
        "sources": {t: {"landing": f"landing/{t}", "primary_key": ["id"]} for t in tables},
        "left": "lhs",
        "joins": [{"right": "rhs", "foreign_key": ["fk"]}],
        "select": {"key": "lhs.id", "value": "rhs.value"},
        "output": "out",
    }
    path = tmp_path / "pipeline.yml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


@pytest.mark.core  # no Spark: a second
def test_config_and_storage_errors_exit_2_before_spark_starts(tmp_path):
    config = _tiny(tmp_path)
    bad = tmp_path / "bad.yml"
    bad.write_text(Path(config).read_text().replace("output: out", "output: no such"))
    found = _python("-c", _NO_SPARK, "run", str(bad))
    assert found.stdout.split() == ["no", "spark", "2"], found.stderr
    assert "output: 'no such' is not a valid name" in found.stderr
    found = _python("-c", _NO_SPARK, "run", config, env={"CDC_JOIN_STORAGE": "delta-lake"})
    assert found.stdout.split() == ["no", "spark", "2"], found.stderr
    assert "CDC_JOIN_STORAGE" in found.stderr


@pytest.mark.deep  # starts a JVM of its own (about 15 s); CI runs it
def test_a_run_prints_its_report_and_nothing_of_spark_s_start_up(tmp_path):
    config = _tiny(tmp_path)
    done = _python(
        "-m",
        "cdc_join.cli",
        "-q",
        "--storage",
        "delta-rs",
        "run",
        config,
        env={"PYTHONWARNINGS": "ignore"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("cdc_join run 1: ")
    assert done.stderr == ""  # no log4j, NativeCodeLoader, SPARK_LOCAL_IP or JDK lines


def test_an_unreachable_spark_connect_server_fails_within_seconds_naming_it(tmp_path):
    # Nothing answers there: the Connect client alone would retry for about ten minutes.
    config = _tiny(tmp_path)
    env = {"CDC_JOIN_SPARK_REMOTE": "sc://127.0.0.1:9/;token=secret", "CDC_JOIN_STORAGE": "delta-rs"}
    began = time.monotonic()
    # (A command that needs no Spark, such as status on delta-rs, starts no session: run does.)
    found = _python("-m", "cdc_join.cli", "run", config, env=env)
    # One try of 10 s: not one more for every landing file, each then named unreadable (41 s).
    assert time.monotonic() - began < 30
    assert found.returncode == 5, found.stderr
    assert "Spark Connect server at 127.0.0.1:9 (from CDC_JOIN_SPARK_REMOTE) did not answer" in found.stderr
    assert "cannot read" not in found.stderr, found.stderr
    assert "secret" not in found.stderr


_ARCHIVED_SESSION = textwrap.dedent(
    """
    from cdc_join.session import get_spark
    spark = get_spark(quiet=True, storage="delta-rs", class_archive=True)
    assert spark.range(3).count() == 3
    found = spark._jvm.java.lang.management.ManagementFactory.getRuntimeMXBean().getInputArguments()
    print(" ".join(str(a) for a in found))
    """
)


@pytest.mark.deep  # four JVMs of their own and an archive written (about 50 s); CI runs it
def test_a_command_s_jvm_writes_its_class_archive_as_it_ends_and_the_next_starts_from_it(tmp_path):
    folder = tmp_path / "archive"
    env, work = {"CDC_JOIN_CLASS_ARCHIVE": str(folder)}, tmp_path / "work"
    work.mkdir()
    marks = _python("-c", _ARCHIVED_SESSION, env=env, cwd=work)  # the machine's first: a mark
    assert marks.returncode == 0, marks.stderr
    assert "-XX:+RecordDynamicDumpInfo" not in marks.stdout.split()
    (mark,) = folder.iterdir()
    assert mark.name.endswith(".jsa.seen")
    first = _python("-c", _ARCHIVED_SESSION, env=env, cwd=work)
    assert first.returncode == 0, first.stderr
    assert "-XX:+RecordDynamicDumpInfo" in first.stdout.split()
    (archive,) = [p for p in folder.iterdir() if p != mark]  # no lock, no unfinished part
    assert archive.suffix == ".jsa" and archive.stat().st_size > 10_000_000
    written = archive.stat().st_mtime_ns

    second = _python("-c", _ARCHIVED_SESSION, env=env, cwd=work)
    assert second.returncode == 0, second.stderr
    assert f"-XX:SharedArchiveFile={archive}" in second.stdout.split()
    assert archive.stat().st_mtime_ns == written  # used, not written again

    # Damaged since (a disk that filled up): HotSpot crashes as it maps it. The session starts
    # without it, and the archive is removed for the next process to write anew.
    archive.chmod(0o644)
    with open(archive, "r+b") as f:
        f.truncate(archive.stat().st_size // 2)
    third = _python("-c", _ARCHIVED_SESSION, env=env, cwd=work)
    assert third.returncode == 0, third.stderr
    assert "SharedArchiveFile" not in third.stdout and not archive.exists()
    assert list(work.iterdir()) == []  # no crash report in the working folder
