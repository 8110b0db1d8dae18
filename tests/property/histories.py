"""What the property tests share: events as dicts, landing them, the current rows they imply,
runs that are killed part-way sometimes, and the shares their examples are drawn in."""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterable, Sequence
from typing import Any

import pytest

from cdc_join.report import SimulatedCrash

#: Each property test runs as this many tests (``CDC_JOIN_PROPERTY_SHARES``, default 1), each
#: drawing :func:`examples_per_share` examples of its own: under pytest-xdist the workers then
#: share a property test's examples instead of one worker drawing them all while the other
#: waits (CI runs 2 shares on 2 workers).
SHARES = int(os.environ.get("CDC_JOIN_PROPERTY_SHARES", "1"))

#: A property test's ``share`` parameter: which of the :data:`SHARES` it is (``1of2``, ...).
shares = pytest.mark.parametrize("share", range(1, SHARES + 1), ids=lambda n: f"{n}of{SHARES}")


def examples_per_share(examples: int) -> int:
    """The examples each share draws for ``examples`` in all: rounded up, so that the shares
    together never draw fewer."""
    return -(-examples // SHARES)


def drawn_by_the_first_share(share: int, seed: int, batches: int, payload_only: set) -> bool:
    """Whether share ``share`` (of :data:`SHARES`) drew the example every share draws first:
    Hypothesis starts each test with its simplest example (seed 0, the fewest batches, no
    payload-only table, ...), so the shares after the first reject it (``assume``, which does not
    count as an example) rather than run it again."""
    return share > 1 and seed == 0 and batches == 2 and not payload_only


def change(table: str, op: str, key: Any, row: dict | None, lsn: int) -> dict:
    """One event of a history (``op``: c, u, r, d or t)."""
    return {"table": table, "op": op, "key": key, "row": row, "lsn": lsn}


def land(writer, events: list[dict], tables: Iterable[str]) -> list[dict]:
    """Write each table's events as one file; return them with their order (lsn, file, line)."""
    landed = []
    for table in tables:
        mine = [e for e in events if e["table"] == table]
        if not mine:
            continue
        lines = []
        for e in mine:
            if e["op"] == "t":
                lines.append(writer.event(table, "t", lsn=e["lsn"]))
            elif e["op"] == "d":
                lines.append(writer.delete(table, e["row"], e["lsn"]))
            else:
                lines.append(writer.upsert(table, e["row"], e["lsn"], e["op"]))
        path = writer.write(table, lines)
        landed += [{**e, "order": (e["lsn"], path.name, n)} for n, e in enumerate(mine, start=1)]
    return landed


def current_rows(delivered: list[dict], tables: Iterable[str]) -> dict[str, dict]:
    """Per table, the current rows: per key the event of greatest (sequence, file, line); a
    delete, or a truncate at a greater sequence, removes it."""
    newest: dict[tuple, dict] = {}
    truncated: dict[str, int] = {}
    for e in delivered:
        if e["op"] == "t":
            truncated[e["table"]] = max(truncated.get(e["table"], -1), e["order"][0])
            continue
        key = (e["table"], e["key"])
        if key not in newest or e["order"] > newest[key]["order"]:
            newest[key] = e
    current: dict[str, dict] = {t: {} for t in tables}
    for (table, key), e in newest.items():
        if e["op"] != "d" and e["order"][0] >= truncated.get(table, -1):
            current[table][key] = e["row"]
    return current


def run_with_crashes(
    pipeline,
    rng: random.Random,
    plans: Sequence[str],
    run_crashes: Sequence[str],
    refresh_crashes: Sequence[str],
    odds: tuple[float, float, float] = (0.3, 0.45, 0.1),
) -> None:
    """One completed run (sometimes a full refresh), after a killed run or refresh sometimes.

    ``odds``: a roll below the first kills a run, below the second (instead) a full refresh; a
    second roll below the third makes the completed one a full refresh."""
    killed_run, killed_refresh, refresh = odds
    roll = rng.random()
    if roll < killed_run:
        with contextlib.suppress(SimulatedCrash):
            pipeline.run(crash_after=rng.choice(run_crashes), plan=rng.choice(plans))
    elif roll < killed_refresh:
        with contextlib.suppress(SimulatedCrash):
            pipeline.full_refresh(crash_after=rng.choice(refresh_crashes))
    if rng.random() < refresh:
        pipeline.full_refresh()
    else:
        pipeline.run(plan=rng.choice(plans))
