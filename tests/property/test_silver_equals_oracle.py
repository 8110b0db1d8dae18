"""Property: whatever order, delay, duplication or crashes CDC events come with, silver after
every completed run equals the join of the current source rows (README.md, "What silver holds").

Three tables: ``lhs`` (40 columns: past the 32 whose file statistics Delta keeps) joined to
``rhs`` on a composite foreign key ``(a, b)`` and to ``rhs2`` on ``fk2``, each join inner or
left. The generators draw what real data has:

- a null in every column of every type (string, int, bigint, decimal, double, boolean, date,
  timestamp, nested struct and array, with null fields and null elements), foreign keys with
  one part null;
- both envelopes: each table's events carry the Kafka Connect schema or only the payload, so
  types come from schemas or from inference (a column that starts out all null is void until
  its first value);
- equal sequence values (the later landing file, then line, wins), truncates followed by
  more events, a column whose type widens (``rhs2.w``: int, then bigint with values past 2^31),
  an array that holds no element for the first batches (``lhs.ar``: without a Connect schema
  it has no element type until its first element; ``--hypothesis-show-statistics`` counts the
  examples where bronze held it so);
- the sequence rule configured (``sequence_by: [source.lsn]``) or the connector's default, with
  the positions a PostgreSQL (``source.sequence``) or MySQL (binlog file, pos, row) connector
  writes, with numbers that gain digits every few events (text order is not number order);
  PostgreSQL's include initial-snapshot rows anywhere in the history (a snapshot run again
  after streaming) and first-streamed changes, both with a null last commit LSN;
- delivery in random batches, shuffled, with duplicates, late events, old events delivered
  again after newer ones, and garbage lines; runs and full refreshes killed after a random
  step, then run again; runs told to recompute (the cost rule's set-based plan).

The oracle recomputes, in plain Python from the delivered events, each source's current rows
(compared with its state table: a wrong newest event shows there even when no silver row
carries that row) and their join (compared with silver). Examples:
``CDC_JOIN_PROPERTY_EXAMPLES`` (default 3; CI runs 6 on delta-rs, 3 over Spark Connect on
delta-rs and 4 on delta-spark), or ``CDC_JOIN_PROPERTY_PROFILE=slow`` for 300 with shrinking;
``CDC_JOIN_PROPERTY_SHARES`` splits them between tests (``tests/property/histories.py``).
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from datetime import date, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, assume, event, given, settings
from hypothesis import strategies as st

from cdc_join.join.state import current_rows as current_rows_of
from tests.property.histories import drawn_by_the_first_share, examples_per_share, run_with_crashes, shares
from tests.support import SEQUENCE_BY_LSN, make_pipeline, subscriptions

# Examples, rounds or step boundaries set by CDC_JOIN_* variables: CI runs them deeper (-m depth).
pytestmark = [pytest.mark.depth, pytest.mark.connect]

TABLES = {
    "lhs": {
        "id": "string",
        "a": "int64",
        "b": "string",
        "fk2": "int32",
        "s": "string",
        "i": "int32",
        "l": "int64",
        "d": "decimal(10,2)",
        "f": "double",
        "bo": "boolean",
        "dt": "date",
        "ts": "timestamp",
        "st": "struct<x:int32,y:string>",
        "ar": "array<int32>",
        # 40 columns in all: Delta keeps file statistics of the first 32 leaf columns only, so
        # lhs's state table (its columns, then cdc_join's) and silver have none of their own
        # columns' (run ids, sequences), as real tables of 25 columns or more have none.
        **{f"p{i:02d}": ("string", "int64", "double", "boolean")[i % 4] for i in range(26)},
    },
    "rhs": {"a": "int64", "b": "string", "value": "string", "n": "int64"},
    "rhs2": {"id": "int32", "name": "string", "w": "int32"},
}
PRIMARY_KEYS = {"lhs": ["id"], "rhs": ["a", "b"], "rhs2": ["id"]}
LEFT_VALUES = ["s", "i", "l", "d", "f", "bo", "dt", "ts", "st", "ar", *(f"p{i:02d}" for i in range(26))]
SELECT = {
    "key": "lhs.id",
    "a": "lhs.a",
    "b": "lhs.b",
    "fk2": "lhs.fk2",
    **{c: f"lhs.{c}" for c in LEFT_VALUES},
    "value": "rhs.value",
    "n": "rhs.n",
    "name": "rhs2.name",
    "w": "rhs2.w",
}
LEFT_KEYS = ["k1", "k2", "k3", "k4"]
A_VALUES, B_VALUES, RHS2_KEYS = [1, 2], ["x", "y"], [1, 2, 3]
RUN_CRASHES = [
    "ingest",
    "state:lhs",
    "state:rhs",
    "plan",
    "subscription:rhs",
    "lookup",
    "state",
    "resolve",
    "silver",
    "cleanup",
]
# Tables this small always run incrementally by the cost rule: an example's runs are all left
# to it, all told to recompute (the affected rows found by scanning the state tables instead of
# looking up subscriptions), or each either way.
PLANS = {"auto": ["auto"], "recompute": ["recompute"], "mixed": ["auto", "recompute"]}
REFRESH_CRASHES = ["state:lhs", "state:rhs2", "subscription:rhs", "resolve", "silver"]
# configured: sequence_by [source.lsn]; otherwise no sequence_by, and the connector's default
RULES = ["configured", "postgresql", "mysql"]
PROFILE = os.environ.get("CDC_JOIN_PROPERTY_PROFILE", "")
EXAMPLES = int(os.environ.get("CDC_JOIN_PROPERTY_EXAMPLES", "300" if PROFILE == "slow" else "3"))
# An example costs tens of seconds of Spark: shrinking a failure can take longer than the whole
# suite, so only the slow profile shrinks. Without it a failure still prints its full example
# and a @reproduce_failure blob to replay it.
PHASES = tuple(Phase) if PROFILE == "slow" else (Phase.explicit, Phase.reuse, Phase.generate)

maybe = st.booleans()
operation = st.one_of(
    st.tuples(
        st.just("lhs"),
        st.sampled_from(["c", "u", "r"]),
        st.sampled_from(LEFT_KEYS),
        st.one_of(st.none(), st.sampled_from(A_VALUES)),
        st.one_of(st.none(), st.sampled_from(B_VALUES)),
        st.one_of(st.none(), st.sampled_from(RHS2_KEYS)),
        maybe,
    ),
    st.tuples(
        st.just("lhs"), st.just("d"), st.sampled_from(LEFT_KEYS), st.none(), st.none(), st.none(), maybe
    ),
    st.tuples(
        st.just("rhs"),
        st.sampled_from(["c", "u", "d"]),
        st.tuples(st.sampled_from(A_VALUES), st.sampled_from(B_VALUES)),
        st.none(),
        st.none(),
        st.none(),
        maybe,
    ),
    st.tuples(
        st.just("rhs2"),
        st.sampled_from(["c", "u", "d"]),
        st.sampled_from(RHS2_KEYS),
        st.none(),
        st.none(),
        st.none(),
        maybe,
    ),
    st.tuples(
        st.sampled_from(["rhs", "rhs2"]), st.just("t"), st.none(), st.none(), st.none(), st.none(), maybe
    ),
)


def _value(rng: random.Random, type_name: str, wide: bool = False) -> Any:
    """A random value of a column type, null a quarter of the time (nested parts too)."""
    if rng.random() < 0.25:
        return None
    if type_name == "string":
        return rng.choice(["", "x", "null", "a b", "é"])
    if type_name == "int32":
        return rng.choice([0, -1, 7, 2**31 - 1])
    if type_name == "int64":
        return rng.choice([0, -5, 2**40, 3_000_000_000]) if wide else rng.choice([0, -5, 2**40])
    if type_name == "decimal(10,2)":
        return rng.choice([Decimal("0.00"), Decimal("-1.25"), Decimal("12345678.90")])
    if type_name == "double":
        return rng.choice([0.5, -2.25, 1e10])
    if type_name == "boolean":
        return rng.choice([True, False])
    if type_name == "date":
        return date(2024, 1, 1) + timedelta(days=rng.randint(-40000, 400))
    if type_name == "timestamp":
        return datetime(2024, 1, 1) + timedelta(microseconds=rng.randint(-(10**15), 10**12))
    if type_name.startswith("struct<"):
        return {"x": _value(rng, "int32"), "y": _value(rng, "string")}
    if type_name.startswith("array<"):
        return [_value(rng, "int32") for _ in range(rng.randint(0, 3))]
    raise AssertionError(type_name)


def _row(
    table: str, key: Any, fk: tuple, rng: random.Random, wide: bool, untyped: bool = False
) -> dict[str, Any]:
    if table == "lhs":
        row = {"id": key, "a": fk[0], "b": fk[1], "fk2": fk[2]}
        row |= {c: _value(rng, TABLES["lhs"][c]) for c in LEFT_VALUES}
        if untyped:  # no element to give the array its type yet
            row["ar"] = rng.choice([None, [], [None], [None, None]])
        return row
    if table == "rhs":
        return {"a": key[0], "b": key[1], "value": _value(rng, "string"), "n": _value(rng, "int64")}
    return {
        "id": key,
        "name": _value(rng, "string"),
        "w": _value(rng, "int64", True) if wide else _value(rng, "int32"),
    }


# -- the oracle ----------------------------------------------------------------------------


def _expected_value(value: Any, type_name: str, payload_only: bool) -> Any:
    """What a value of a column decodes to: by schema, or as payload-only JSON is inferred."""
    if value is None or not payload_only:
        return value
    if type_name.startswith("decimal"):
        return float(value)
    if type_name == "date":
        return (value - date(1970, 1, 1)).days
    if type_name == "timestamp":
        delta = value - datetime(1970, 1, 1)
        return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
    return value


def current_rows(delivered: list[dict]) -> dict[str, dict]:
    """Per table, the current rows the delivered events imply (README.md, "What silver holds"): per key the
    event of greatest (sequence, file, line); a delete or a truncate older than it removes it."""
    newest: dict[tuple, dict] = {}
    truncated: dict[str, tuple] = {}
    for e in delivered:
        if e["op"] == "t":
            truncated[e["table"]] = max(truncated.get(e["table"], (-1,)), e["order"][0])
            continue
        key = (e["table"], e["key"])
        if key not in newest or e["order"] > newest[key]["order"]:
            newest[key] = e
    current: dict[str, dict] = {t: {} for t in TABLES}
    for (table, key), e in newest.items():
        if e["op"] != "d" and e["order"][0] >= truncated.get(table, (-1,)):
            current[table][key] = e["row"]
    return current


def oracle(delivered: list[dict], join_types: tuple[str, str], payload_only: set[str]) -> set[tuple]:
    """The join of the current rows (README.md, "What silver holds")."""
    current = current_rows(delivered)
    out = set()
    for row in current["lhs"].values():
        r1 = (
            current["rhs"].get((row["a"], row["b"]))
            if row["a"] is not None and row["b"] is not None
            else None
        )
        r2 = current["rhs2"].get(row["fk2"]) if row["fk2"] is not None else None
        if (join_types[0] == "inner" and r1 is None) or (join_types[1] == "inner" and r2 is None):
            continue
        left = [
            _freeze(_expected_value(row[c], TABLES["lhs"][c], "lhs" in payload_only))
            for c in ["id", "a", "b", "fk2", *LEFT_VALUES]
        ]
        out.add((*left, r1 and r1["value"], r1 and r1["n"], r2 and r2["name"], r2 and r2["w"]))
    return out


def _freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def expected_states(delivered: list[dict], payload_only: set[str]) -> dict[str, set[tuple]]:
    """Per table, its current rows as decoded values (every column, in declared order)."""
    return {
        table: {
            tuple(
                _freeze(_expected_value(row[c], TABLES[table][c], table in payload_only))
                for c in TABLES[table]
            )
            for row in rows.values()
        }
        for table, rows in current_rows(delivered).items()
    }


def states(pipeline) -> dict[str, set[tuple]]:
    """Per source, the current rows its state table holds: a wrong newest event shows here even
    when no silver row carries the row (an inner join with no match, a right row no left row
    names)."""
    out = {}
    for table, columns in TABLES.items():
        path = pipeline.config.state_path(table)
        if not pipeline.storage.exists(path):
            out[table] = set()
            continue
        rows = current_rows_of(pipeline.storage.read(path), PRIMARY_KEYS[table]).select(*columns).collect()
        out[table] = {
            tuple(_freeze(v.asDict(recursive=True) if hasattr(v, "asDict") else v) for v in r) for r in rows
        }
    return out


def expected_subscriptions(delivered: list[dict]) -> list[set[tuple]]:
    """Per join, the ``(fk…, pk)`` of every current left row whose foreign key has no null part
    (KIP-213: a null foreign key subscribes to nothing)."""
    rows = current_rows(delivered)["lhs"].values()
    return [
        {(r["a"], r["b"], r["id"]) for r in rows if r["a"] is not None and r["b"] is not None},
        {(r["fk2"], r["id"]) for r in rows if r["fk2"] is not None},
    ]


def _subscriptions(pipeline) -> list[set[tuple]]:
    """Per join, its current subscriptions: after a completed run a crash's leftovers are gone."""
    return [subscriptions(pipeline, i) for i in range(2)]


def silver(pipeline) -> set[tuple]:
    cfg = pipeline.config
    if not pipeline.storage.exists(cfg.silver_path):
        return set()
    rows = pipeline.storage.read(cfg.silver_path).select(*SELECT).collect()
    return {tuple(_freeze(v.asDict(recursive=True) if hasattr(v, "asDict") else v) for v in r) for r in rows}


# -- the property --------------------------------------------------------------------------


@shares
@settings(
    max_examples=examples_per_share(EXAMPLES),
    phases=PHASES,
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
    payload_only=st.sets(st.sampled_from(sorted(TABLES))),
    batches=st.integers(2, 4),
    seed=st.integers(0, 2**32 - 1),
    plans=st.sampled_from(sorted(PLANS)),
    rule=st.sampled_from(RULES),
)
def test_silver_equals_oracle_after_every_completed_run(
    spark, storage, share, ops, join_types, payload_only, batches, seed, plans, rule
):
    assume(not drawn_by_the_first_share(share, seed, batches, payload_only))
    rng = random.Random(seed)
    root = Path(tempfile.mkdtemp(prefix="cdc_join_property_"))
    pipeline, writer = make_pipeline(
        root,
        spark,
        storage,
        tables={t: dict(c) for t, c in TABLES.items()},
        joins=[
            {"right": "rhs", "foreign_key": ["a", "b"], "type": join_types[0]},
            {"right": "rhs2", "foreign_key": ["fk2"], "type": join_types[1]},
        ],
        select=SELECT,
        primary_keys=PRIMARY_KEYS,
        sequence_by=SEQUENCE_BY_LSN if rule == "configured" else None,
    )
    writer.payload_only = set(payload_only)
    widen_batch = rng.randint(1, batches)  # from this batch on, rhs2.w is a bigint in the schema
    # before this batch lhs.ar holds no element (only [], [null] or null): without a Connect
    # schema it has no element type until then (0: from the start; `batches`: never)
    typed_batch = rng.randint(0, batches)
    history = _history(ops, rng, batches, widen_batch, typed_batch)
    untyped = typed_batch > 0
    seeds = [_event("lhs", "c", "k0", _row("lhs", "k0", (None, None, None), rng, False, untyped), 1)]
    # A left row no op changes and no redelivery repeats, naming right keys ops do change: only
    # right-driven updates (a lookup, or a recompute's scan) keep its silver row right.
    named = (A_VALUES[0], B_VALUES[0], RHS2_KEYS[0])
    seeds += [_event("lhs", "c", "k9", _row("lhs", "k9", named, rng, False, untyped), 4)]
    seeds += [_event("rhs", "c", (9, "z"), _row("rhs", (9, "z"), (), rng, False), 2)]
    seeds += [_event("rhs2", "c", 99, _row("rhs2", 99, (), rng, False), 3)]
    delivered: list[dict] = []
    held: list[dict] = []
    untyped_before = False
    for number, batch in enumerate(history):
        last = number == len(history) - 1
        now = held + [e for e in batch if last or rng.random() > 0.3] + (seeds if number == 0 else [])
        held = [e for e in batch if e not in now]
        now += [e for e in now if rng.random() < 0.2]  # duplicates
        if delivered:  # at-least-once delivery: old events arrive again, after newer ones
            # (never k9's: a copy in a later file is a newer event, which would change k9)
            again = [e for e in delivered if e["key"] != "k9"]
            now += rng.sample(again, min(len(again), rng.randint(1, 4)))
        rng.shuffle(now)
        if number >= widen_batch:
            writer.tables["rhs2"]["w"] = "int64"
        delivered += _land(writer, now, rng, rule)
        run_with_crashes(pipeline, rng, PLANS[plans], RUN_CRASHES, REFRESH_CRASHES, odds=(0.25, 0.4, 0.15))
        untyped = _untyped_array(pipeline)  # what --hypothesis-show-statistics counts
        event("lhs.ar without an element type" if untyped else "lhs.ar typed or absent")
        if untyped_before and not untyped:
            event("lhs.ar got its element type in a later batch")
        untyped_before = untyped_before or untyped
        expected = oracle(delivered, join_types, set(payload_only))
        assert states(pipeline) == expected_states(delivered, set(payload_only)), f"after batch {number}"
        assert silver(pipeline) == expected, f"after batch {number}"
        assert _subscriptions(pipeline) == expected_subscriptions(delivered), f"after batch {number}"
    assert pipeline.verify().ok


def _untyped_array(pipeline) -> bool:
    """Whether bronze holds ``lhs.ar`` as an array without an element type yet (a payload-only
    source whose arrays have been only empty or all null)."""
    path = pipeline.config.bronze_path("lhs")
    if not pipeline.storage.exists(path):
        return False
    after = pipeline.storage.schema(path)["_after"].dataType
    return "ar" in after.names and after["ar"].dataType.simpleString() == "array<void>"


def _history(
    ops: list[tuple], rng: random.Random, batches: int, widen_batch: int, typed_batch: int
) -> list[list[dict]]:
    """The ops as events with sequences (some equal to the previous one), cut into batches."""
    events, lsn = [], 10
    cuts = sorted(rng.sample(range(1, len(ops)), min(batches - 1, len(ops) - 1)))
    batch_of = [sum(1 for c in cuts if i >= c) for i in range(len(ops))]
    for i, (table, op, key, a, b, fk2, same_lsn) in enumerate(ops):
        lsn += 0 if same_lsn else 1
        wide = batch_of[i] >= widen_batch
        untyped = batch_of[i] < typed_batch
        row = None if op == "t" else _row(table, key, (a, b, fk2), rng, wide, untyped)
        # what a PostgreSQL connector would have written it as (other rules ignore it)
        kind = rng.choices(["streamed", "snapshot", "first"], [0.7, 0.15, 0.15])[0]
        if kind == "snapshot" and op in ("d", "t"):
            kind = "streamed"  # a snapshot reads rows (op "r"): no deletes, no truncates
        events.append(_event(table, "r" if kind == "snapshot" else op, key, row, lsn, kind))
    out: list[list[dict]] = [[] for _ in range(max(batch_of) + 1)]
    for i, e in enumerate(events):
        out[batch_of[i]].append(e)
    return out


def _event(table: str, op: str, key: Any, row: dict | None, lsn: int, kind: str = "streamed") -> dict:
    return {"table": table, "op": op, "key": key, "row": row, "lsn": lsn, "kind": kind}


def _land(writer, events: list[dict], rng: random.Random, rule: str) -> list[dict]:
    """Write each table's events as one file (garbage mixed in); return them with their order."""
    landed = []
    for table in TABLES:
        mine = [e for e in events if e["table"] == table]
        if not mine:
            continue
        lines: list[Any] = []
        ranks: list[tuple] = []
        for e in mine:
            if e["op"] == "t":
                lines.append(writer.event(table, "t", lsn=e["lsn"]))
            elif e["op"] == "d":
                lines.append(writer.delete(table, e["row"], e["lsn"]))
            else:
                lines.append(writer.upsert(table, e["row"], e["lsn"], e["op"]))
            ranks.append(_position(lines[-1], rule, e["lsn"], e["kind"]))
        if rng.random() < 0.3:
            lines.insert(rng.randrange(len(lines) + 1), "{not json at all")
        path = writer.write(table, lines)
        numbered = [n for n, line in enumerate(lines, start=1) if not isinstance(line, str)]
        order = zip(mine, ranks, numbered, strict=True)
        landed += [{**e, "order": (rank, path.name, n)} for e, rank, n in order]
    return landed


def _position(event: dict, rule: str, lsn: int, kind: str) -> tuple[int, ...]:
    """Give an event the source position its connector would write for sequence ``lsn``, and
    return the rank the oracle orders it by (then by file and line).

    The positions order as ``lsn`` does, equal ones included (but for PostgreSQL's kinds at one
    ``lsn``, below), and have numbers that gain digits every few steps (as text, "12" < "5").
    MySQL's position is (binlog file, pos, row). PostgreSQL's ``source.sequence`` is ``[last
    commit LSN, LSN]`` as text: a ``streamed`` event at ``n`` is ``[2^(n - n % 2), 2^n]`` (one
    transaction commits every two LSNs), a ``snapshot`` row ``[null, 2^n]`` (Debezium starts an
    initial snapshot, run again or not, with no last commit LSN: the row sorts after every
    change committed before it, at an even ``n`` before the changes of ``n`` itself, at an odd
    one after them) and a ``first`` event ``[null, 2^n]`` too (the first transaction streamed
    after a snapshot: after the changes before it).
    """
    if rule == "configured":
        return (lsn,)
    payload = event.get("payload", event)
    source = payload["source"]
    if rule == "postgresql":
        first, position = 2 ** (lsn - lsn % 2), 2**lsn
        source["lsn"] = position
        source["snapshot"] = ("true", "last", "first")[lsn % 3] if kind == "snapshot" else "false"
        pair = [None if kind != "streamed" else str(first), str(position)]
        source["sequence"] = json.dumps(pair)
        extra = [
            {"type": "string", "optional": True, "field": "snapshot"},
            {"type": "string", "optional": True, "field": "sequence"},
        ]
        ranks = {"streamed": (first, position), "snapshot": (position, -1), "first": (position, position)}
        rank = ranks[kind]
    else:
        del source["lsn"]
        binlog = f"mysql-bin.{lsn // 4:06d}"
        source |= {"connector": "mysql", "file": binlog, "pos": 4 + 2 ** (lsn % 4 * 3), "row": 0}
        extra = [
            {"type": "string", "optional": False, "field": "file"},
            {"type": "int64", "optional": False, "field": "pos"},
            {"type": "int32", "optional": True, "field": "row"},
        ]
        rank = (lsn,)
    if "schema" in event:
        schema = next(f for f in event["schema"]["fields"] if f["field"] == "source")
        schema["fields"] = [f for f in schema["fields"] if f["field"] != "lsn" or rule != "mysql"] + extra
        schema["name"] = f"io.debezium.connector.{rule}.Source"
    return rank
