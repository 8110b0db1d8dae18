"""Property: whatever order, delay, duplication or crashes CDC events come with, silver after
every completed run equals the join of the current source rows (DESIGN.md §2).

Histories are random creates/updates/deletes/fk changes over three tables (``lhs`` joined to
``rhs`` on ``fk`` and to ``rhs2`` on ``fk2``, each join inner or left), plus an occasional
truncate of ``rhs``. They are delivered in random batches: shuffled within a batch, some events
duplicated, some held back to a later batch (late), old events delivered again after newer
ones (at-least-once), garbage lines mixed in. Some runs are
killed after a random step and rerun. The oracle below recomputes the join in plain Python.
"""

from __future__ import annotations

import contextlib
import os
import random
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdc_join.report import SimulatedCrash
from tests.support import make_pipeline, silver_rows

TABLES = {
    "lhs": {"id": "string", "fk": "int64", "fk2": "int64", "v": "int64"},
    "rhs": {"id": "int64", "value": "string"},
    "rhs2": {"id": "int64", "name": "string"},
}
SELECT = {
    "key": "lhs.id",
    "fk": "lhs.fk",
    "fk2": "lhs.fk2",
    "v": "lhs.v",
    "value": "rhs.value",
    "name": "rhs2.name",
}
LEFT_KEYS = ["a", "b", "c", "d"]
RIGHT_KEYS = [1, 2, 3]
CRASH_STEPS = [
    "ingest",
    "state:lhs",
    "state:rhs",
    "subscription:rhs",
    "lookup:rhs2",
    "resolve",
    "silver",
    "cleanup",
]
EXAMPLES = int(os.environ.get("CDC_JOIN_PROPERTY_EXAMPLES", "4"))

fk_value = st.one_of(st.none(), st.sampled_from(RIGHT_KEYS))
operation = st.one_of(
    st.tuples(
        st.just("lhs"),
        st.sampled_from(["c", "u"]),
        st.sampled_from(LEFT_KEYS),
        fk_value,
        fk_value,
        st.integers(0, 3),
    ),
    st.tuples(st.just("lhs"), st.just("d"), st.sampled_from(LEFT_KEYS), st.none(), st.none(), st.just(0)),
    st.tuples(
        st.just("rhs"),
        st.sampled_from(["c", "u", "d"]),
        st.sampled_from(RIGHT_KEYS),
        st.none(),
        st.none(),
        st.integers(0, 3),
    ),
    st.tuples(
        st.just("rhs2"),
        st.sampled_from(["c", "u", "d"]),
        st.sampled_from(RIGHT_KEYS),
        st.none(),
        st.none(),
        st.integers(0, 3),
    ),
    st.tuples(st.just("rhs"), st.just("t"), st.just(0), st.none(), st.none(), st.just(0)),
)


def _row(table: str, key, fk, fk2, n: int) -> dict:
    if table == "lhs":
        return {"id": key, "fk": fk, "fk2": fk2, "v": n}
    column = "value" if table == "rhs" else "name"
    return {"id": key, column: f"{table}-{key}-{n}"}


def oracle(delivered: list[tuple], join_types: tuple[str, str]) -> set[tuple]:
    """The join of the current rows implied by the delivered events (DESIGN.md §2)."""
    newest: dict[tuple[str, object], tuple] = {}
    truncated: dict[str, int] = {}
    for lsn, table, op, row in delivered:
        if op == "t":
            truncated[table] = max(truncated.get(table, -1), lsn)
            continue
        key = (table, row["id"])
        if key not in newest or lsn > newest[key][0]:
            newest[key] = (lsn, op, row)
    current: dict[str, dict] = {t: {} for t in TABLES}
    for (table, key), (lsn, op, row) in newest.items():
        if op != "d" and lsn > truncated.get(table, -1):
            current[table][key] = row
    out = set()
    for row in current["lhs"].values():
        r1 = current["rhs"].get(row["fk"]) if row["fk"] is not None else None
        r2 = current["rhs2"].get(row["fk2"]) if row["fk2"] is not None else None
        if (join_types[0] == "inner" and r1 is None) or (join_types[1] == "inner" and r2 is None):
            continue
        out.add((row["id"], row["fk"], row["fk2"], row["v"], r1 and r1["value"], r2 and r2["name"]))
    return out


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)
@given(
    ops=st.lists(operation, min_size=8, max_size=30),
    join_types=st.tuples(st.sampled_from(["inner", "left"]), st.sampled_from(["inner", "left"])),
    batches=st.integers(2, 4),
    seed=st.integers(0, 2**32 - 1),
)
def test_silver_equals_oracle_after_every_completed_run(spark, storage, ops, join_types, batches, seed):
    rng = random.Random(seed)
    root = Path(tempfile.mkdtemp(prefix="cdc_join_property_"))
    pipeline, writer = make_pipeline(
        root,
        spark,
        storage,
        tables=TABLES,
        joins=[
            {"right": "rhs", "foreign_key": ["fk"], "type": join_types[0]},
            {"right": "rhs2", "foreign_key": ["fk2"], "type": join_types[1]},
        ],
        select=SELECT,
    )
    # Every source needs a first event before columns are known (a run waits until then).
    seeds = [
        (1, "lhs", "c", _row("lhs", "z", None, None, 0)),
        (2, "rhs", "c", _row("rhs", 99, None, None, 0)),
        (3, "rhs2", "c", _row("rhs2", 99, None, None, 0)),
    ]
    history = []
    for lsn, (table, op, key, fk, fk2, n) in enumerate(ops, start=len(seeds) + 1):
        row = None if op == "t" else _row(table, key, fk, fk2, n)
        history.append((lsn, table, op, row))
    cuts = sorted(rng.sample(range(1, len(history)), min(batches - 1, len(history) - 1)))
    pending = [history[i:j] for i, j in zip([0, *cuts], [*cuts, len(history)], strict=True)]
    delivered: list[tuple] = []
    held: list[tuple] = []
    for number, batch in enumerate(pending):
        last = number == len(pending) - 1
        now = held + [e for e in batch if last or rng.random() > 0.3] + (seeds if number == 0 else [])
        held = [e for e in batch if e not in now]
        now += [e for e in now if rng.random() < 0.2]  # duplicates
        if delivered:  # at-least-once delivery: old events arrive again, after newer ones
            now += rng.sample(delivered, min(len(delivered), rng.randint(1, 4)))
        rng.shuffle(now)
        _land(writer, now, rng)
        delivered += now
        crash = rng.choice(CRASH_STEPS) if rng.random() < 0.4 else None
        if crash:
            with contextlib.suppress(SimulatedCrash):
                pipeline.run(crash_after=crash)
        pipeline.run()
        assert silver_rows(pipeline) == oracle(delivered, join_types), f"after batch {number}, crash={crash}"
    assert pipeline.verify().ok


def _land(writer, events: list[tuple], rng: random.Random) -> None:
    by_table: dict[str, list] = {}
    for lsn, table, op, row in events:
        if op == "t":
            event = writer.event(table, "t", lsn=lsn)
        elif op == "d":
            event = writer.delete(table, row, lsn)
        else:
            event = writer.upsert(table, row, lsn, op)
        by_table.setdefault(table, []).append(event)
    for table, table_events in by_table.items():
        if rng.random() < 0.3:
            table_events.insert(rng.randrange(len(table_events) + 1), "{not json at all")
        writer.write(table, table_events)
