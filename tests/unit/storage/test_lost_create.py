"""What a failed CREATE means when another writer may be creating the same table."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from pyspark.sql.types import LongType, StructField, StructType

from cdc_join.errors import ConcurrentRunError, StorageError
from cdc_join.storage.base import lost_create


def test_a_create_that_lost_to_a_writer_whose_table_shows_up_later_did_not_create_it():
    seen = iter([False, False, True])
    error = StorageError("could not create t: [TABLE_OR_VIEW_ALREADY_EXISTS] t already exists")
    assert lost_create(lambda _: next(seen), "t", error, wait=5) is False


def test_a_table_that_is_said_to_exist_but_never_shows_up_is_a_lost_race():
    error = StorageError("could not create t: [TABLE_OR_VIEW_ALREADY_EXISTS] t already exists")
    with pytest.raises(ConcurrentRunError, match="another run is creating it"):
        lost_create(lambda _: False, "t", error, wait=0.3)


def test_any_other_create_failure_is_raised_as_it_was():
    error = StorageError("could not create t: permission denied")
    with pytest.raises(StorageError, match="permission denied"):
        lost_create(lambda _: False, "t", error, wait=5)


class _CreatingElsewhere:
    """A session whose CREATE loses to another writer between Spark's check and Delta's: the
    other writer's log is there, unfinished, and its first commit lands a moment later."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def sql(self, statement: str) -> None:
        from pyspark.errors import AnalysisException

        log = self.folder / "_delta_log"
        log.mkdir(parents=True)
        (log / ".00000000000000000000.json.tmp").write_text("")

        def commit() -> None:
            time.sleep(0.5)
            (log / "00000000000000000000.json").write_text("{}\n")

        threading.Thread(target=commit).start()
        raise AnalysisException(
            message=f"[DELTA_CREATE_TABLE_WITH_NON_EMPTY_LOCATION] Cannot create table ('{self.folder}'). "
            f"The associated location ('{self.folder}') is not empty and also not a Delta table."
        )


def test_delta_on_spark_finding_another_creator_s_unfinished_log_lost_the_create(tmp_path):
    from cdc_join.storage.delta_spark import DeltaSparkStorage

    folder = tmp_path / "t"
    store = DeltaSparkStorage(_CreatingElsewhere(folder))  # type: ignore[arg-type]
    assert store.create(str(folder), StructType([StructField("id", LongType())])) is False


def test_a_folder_of_another_tool_s_files_is_refused_before_any_create(tmp_path):
    from cdc_join.storage.delta_spark import DeltaSparkStorage

    folder = tmp_path / "t"
    folder.mkdir()
    (folder / "orders.csv").write_text("id\n1\n")
    store = DeltaSparkStorage(_CreatingElsewhere(folder))  # type: ignore[arg-type]
    with pytest.raises(StorageError, match=r"not empty and holds no Delta table \(orders.csv\)"):
        store.create(str(folder), StructType([StructField("id", LongType())]))
    assert not (folder / "_delta_log").exists()
