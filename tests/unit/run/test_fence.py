"""A run's fenced storage refuses a metadata change (schema, properties) on a table another
writer committed to since the run saw it, and makes it when the table is where the run left it."""

from __future__ import annotations

import deltalake
import pytest
from pyspark.sql.types import LongType, StringType, StructField, StructType

from cdc_join.columns import CHANGE_DATA_FEED_PROPERTY as FEED
from cdc_join.errors import ConcurrentRunError
from cdc_join.run.fence import Fenced

KV = StructType([StructField("id", LongType(), False), StructField("v", StringType(), True)])
WIDER = StructType([*KV.fields, StructField("w", StringType(), True)])


pytestmark = pytest.mark.race  # another writer moved the table


def test_a_metadata_change_on_a_table_another_writer_moved_stops_the_run(tmp_path, spark, storage):
    path = str(tmp_path / "silver")
    storage.create(path, KV)
    run = Fenced(storage, {path: storage.version(path)})
    storage.append(path, spark.createDataFrame([(1, "a")], "id long, v string"))  # another writer

    with pytest.raises(ConcurrentRunError, match="moved past version 0"):
        run.set_properties(path, {FEED: "false"})
    with pytest.raises(ConcurrentRunError, match="moved past version 0"):
        run.evolve(path, WIDER)
    assert deltalake.DeltaTable(path).metadata().configuration[FEED] == "true"
    assert storage.schema(path).names == ["id", "v"]


def test_a_metadata_change_moves_the_version_the_run_writes_at(tmp_path, spark, storage):
    path = str(tmp_path / "silver")
    storage.create(path, KV)
    run = Fenced(storage, {path: 0})

    assert run.set_properties(path, {FEED: "false"}) is True
    assert run.set_properties(path, {FEED: "false"}) is False
    assert run.evolve(path, WIDER) is True
    assert run.versions() == {path: storage.version(path)} == {path: 2}
    run.append(path, spark.createDataFrame([(1, "a", "b")], "id long, v string, w string"))
    assert deltalake.DeltaTable(path).metadata().configuration[FEED] == "false"
    assert run.versions() == {path: 3}
