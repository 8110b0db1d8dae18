"""The seed's "Original Value Hash" example: a response computed for an old left value arrives
after the left row changed, and must be discarded rather than produce ``A|Y,2,bar`` twice.

Stages are driven by hand: the response is computed while the left row is ``A|Y,1``, the row
then changes to ``A|Y,2`` in a completed run, and only then is the old response resolved.
"""

from __future__ import annotations

import pytest
from pyspark.sql import functions as F

from cdc_join.changeset import materialize
from cdc_join.columns import LHS_HASH, WRITTEN
from cdc_join.join import lookup, resolve, state
from tests.support import make_pipeline, silver_rows, subscriptions

pytestmark = [pytest.mark.kip213]


def _responses_for_right_key(pipeline, key: int):
    """The subscribers a change of right key ``key`` finds (KIP-213: the responses it sends)."""
    cfg, store = pipeline.config, pipeline.storage
    join = cfg.joins[0]
    changed = materialize(pipeline.spark.createDataFrame([(key,)], "fk_fk long"))
    path = cfg.subscription_path(join)
    found, _ = lookup.subscribers(store, cfg, join, changed, store.version(path))
    return materialize(found)


def _check(pipeline, responses):
    """The stale check of ``responses`` against the current left rows: (valid, stale) counts."""
    cfg = pipeline.config
    left_rows = materialize(
        state.read_current(pipeline.storage, cfg.state_path("lhs"), cfg.left_source.primary_key)
    )
    nothing_changed = responses.table.select(["pk_id"]).slice(0, 0)
    checked = resolve.check(responses, left_rows, nothing_changed, cfg, cfg.joins[0])
    stale = checked.count_true(resolve.STALE)
    return checked.rows - stale, stale


@pytest.mark.core
def test_response_for_an_old_left_value_is_rejected_by_the_hash_check(tmp_path, spark, storage):
    pipeline, w = make_pipeline(tmp_path, spark, storage, join_type="inner")
    w.write("rhs", [w.upsert("rhs", {"id": 7, "value": "bar"}, 1)])  # 1- RHS is updated to Y|bar
    w.write("lhs", [w.upsert("lhs", {"id": "A", "fk": 7, "v": 1}, 2)])  # 2- LHS is updated to A|Y,1
    pipeline.run()
    in_flight = _responses_for_right_key(pipeline, 7)  # 4- RHS answers the first Y|A+ message
    assert in_flight.rows == 1

    w.write("lhs", [w.upsert("lhs", {"id": "A", "fk": 7, "v": 2}, 3)])  # 3- LHS is updated to A|Y,2
    pipeline.run()
    assert silver_rows(pipeline) == {("A", 7, 2, "bar")}

    assert _check(pipeline, in_flight) == (0, 1)  # 5- LHS processes it: stale, discarded
    assert _check(pipeline, _responses_for_right_key(pipeline, 7)) == (1, 0)


@pytest.mark.kill
def test_leftover_subscription_of_a_crashed_run_is_dropped_as_stale_and_removed(tmp_path, spark, storage):
    pipeline, w = make_pipeline(tmp_path, spark, storage, join_type="left")
    cfg = pipeline.config
    join = cfg.joins[0]
    w.write(
        "rhs", [w.upsert("rhs", {"id": 1, "value": "one"}, 1), w.upsert("rhs", {"id": 2, "value": "two"}, 2)]
    )
    w.write("lhs", [w.upsert("lhs", {"id": "k", "fk": 2, "v": 1}, 3)])
    pipeline.run()
    # A leftover CombinedKey(1, k): as if a run died after subscribing k to fk 1.
    sub_path = cfg.subscription_path(join)
    current = storage.read(sub_path)
    leftover = (
        current.withColumn("fk_fk", F.lit(1).cast("long"))
        .withColumn(LHS_HASH, F.lit(12345).cast("long"))
        .withColumn(WRITTEN, F.lit(storage.version(sub_path) + 1).cast("long"))
    )
    storage.append(sub_path, leftover)
    assert subscriptions(pipeline) == {(1, "k"), (2, "k")}

    w.write("rhs", [w.upsert("rhs", {"id": 1, "value": "one, renamed"}, 4)])
    report = pipeline.run()
    assert report.steps["resolve"]["stale_dropped"] == 1
    assert report.steps["cleanup"]["stale_subscriptions_removed"] == 1
    assert silver_rows(pipeline) == {("k", 2, 1, "two")}
    assert subscriptions(pipeline) == {(2, "k")}
    assert pipeline.verify().ok
