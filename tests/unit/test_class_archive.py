"""The class archive of a command's JVM (cdc_join/class_archive.py): where it is kept, what
tells one JVM's from another's, and one writer at a time. The JVM's side (an archive written
as a process ends, used by the next, a damaged one removed) is in tests/scenarios/test_cli_process.py."""

from __future__ import annotations

import os

import pytest

from cdc_join import class_archive
from cdc_join.class_archive import ENV, ClassArchive, for_jvm, key

CONF = {"spark.driver.defaultJavaOptions": "-XX:-DontCompileHugeMethods", "spark.driver.memory": "4g"}


def test_the_archive_is_kept_where_the_variable_says_in_the_cache_folder_else_and_off_turns_it_off(
    monkeypatch, tmp_path
):
    monkeypatch.setenv(ENV, str(tmp_path / "a"))
    assert class_archive.folder() == str(tmp_path / "a")
    monkeypatch.setenv(ENV, str(tmp_path / "with space"))
    assert for_jvm(CONF) is None  # Spark would split the Java option at the space
    monkeypatch.setenv(ENV, "off")
    assert class_archive.folder() is None and for_jvm(CONF) is None
    monkeypatch.delenv(ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert class_archive.folder() == str(tmp_path / "cache" / "cdc_join" / "class-archive")


def test_a_jvm_s_archive_is_told_by_its_java_options_class_path_and_memory_not_by_its_jit(
    monkeypatch, tmp_path
):
    base = key(CONF)
    assert base is not None and key(dict(CONF)) == base
    small = {**CONF, "spark.driver.defaultJavaOptions": "-XX:-DontCompileHugeMethods -XX:TieredStopAtLevel=1"}
    assert key(small) == base  # a JVM started for small work shares it
    for name, value in [
        ("spark.driver.defaultJavaOptions", "-XX:-UseCompressedOops"),
        ("spark.driver.extraJavaOptions", "-Dx=1"),
        ("spark.driver.extraClassPath", "/opt/extra.jar"),
        ("spark.driver.memory", "8g"),
    ]:
        assert key({**CONF, name: value}) != base, name
    import pyspark

    other = tmp_path / "venv" / "pyspark"  # the same PySpark installed elsewhere (another venv)
    (other / "jars").mkdir(parents=True)
    for name in os.listdir(os.path.join(os.path.dirname(pyspark.__file__), "jars")):
        (other / "jars" / name).write_text("")
    monkeypatch.setattr(pyspark, "__file__", str(other / "__init__.py"))
    assert key(CONF) != base  # its class path differs, and the JVM would refuse the archive
    monkeypatch.setenv("JAVA_HOME", "/no/such/java")
    assert key(CONF) is None  # no Java runtime to tell it by: no archive


def test_a_jvm_with_an_archive_maps_it_one_without_records_its_classes_but_the_first_only_marks(tmp_path):
    archive = ClassArchive(str(tmp_path / "folder" / "k.jsa"))
    # The first command of this JVM on the machine: no option, a mark (a container started
    # afresh for every run never pays for writing an archive nobody would read).
    assert not archive.records and archive.java_options() == ""
    assert os.listdir(tmp_path / "folder") == ["k.jsa.seen"]
    assert archive.records and archive.java_options() == "-XX:+RecordDynamicDumpInfo"
    archive = ClassArchive(str(tmp_path / "k.jsa"))
    (tmp_path / "k.jsa").write_bytes(b"archive")
    assert not archive.records
    assert archive.java_options().startswith(f"-XX:SharedArchiveFile={tmp_path / 'k.jsa'} -Xshare:auto")


class _Dumped:
    """A stand-in for the JVM's dump: writes ``body`` where it is asked to, or fails."""

    def __init__(self, body: bytes | None) -> None:
        self.body, self.paths = body, []

    def __call__(self, spark, path: str) -> None:
        self.paths.append(path)
        if self.body is None:
            raise RuntimeError("the JVM refused")
        with open(path, "wb") as f:
            f.write(self.body)


def test_an_archive_is_written_under_a_name_of_its_own_then_renamed_into_place_by_one_writer(
    monkeypatch, tmp_path
):
    archive = ClassArchive(str(tmp_path / "folder" / "k.jsa"))
    dumped = _Dumped(b"classes")
    monkeypatch.setattr(class_archive, "_dump", dumped)
    lock = tmp_path / "folder" / "k.jsa.lock"
    os.makedirs(lock.parent)
    lock.write_text("")  # another process is writing it
    assert archive.write(None) is False and dumped.paths == [] and not archive.ready
    lock.unlink()
    assert archive.write(None) is True
    assert dumped.paths == [f"{archive.path}.{os.getpid()}.part"]
    assert sorted(os.listdir(tmp_path / "folder")) == ["k.jsa"]  # no lock, no part left
    assert archive.write(None) is False and len(dumped.paths) == 1  # there already


def test_an_archive_the_jvm_could_not_write_leaves_nothing(monkeypatch, tmp_path):
    archive = ClassArchive(str(tmp_path / "k.jsa"))
    monkeypatch.setattr(class_archive, "_dump", _Dumped(None))
    assert archive.write(None) is False
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("age", [0, class_archive.STALE_S + 60])
def test_locks_and_parts_a_dead_writer_left_are_removed_once_stale(monkeypatch, tmp_path, age):
    monkeypatch.setenv(ENV, str(tmp_path))
    left = [tmp_path / "k.jsa.lock", tmp_path / "k.jsa.77.part"]
    for path in left:
        path.write_text("")
        os.utime(path, (os.path.getmtime(path) - age,) * 2)
    assert for_jvm(CONF) is not None
    assert all(path.exists() == (age == 0) for path in left)


def test_a_folder_that_cannot_be_written_gives_no_archive_and_no_error(monkeypatch, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the folder would be
    archive = ClassArchive(str(blocked / "archive" / "k.jsa"))
    monkeypatch.setattr(class_archive, "_dump", _Dumped(b"classes"))
    assert archive.write(None) is False
