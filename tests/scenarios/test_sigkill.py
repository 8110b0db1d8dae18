"""A run or a full refresh killed with SIGKILL at a random moment, then run again, leaves exactly
the silver of a twin pipeline that was never interrupted.

The simulated crashes of test_runs.py stop a run between two steps. Here the CLI runs as its own
process, as a scheduler starts it, and the whole process group (Python and its JVM) is killed
inside a step: during Spark's start-up or ingest, or a fraction of a second after a step began,
which lands in reads, in delta-rs writes and between a step's commits. The next run (in this
process, ``run`` whichever command was killed) takes over the dead run's lock and completes;
silver then equals the twin's, and ``verify`` passes. Each trial lands a batch of random events
(upserts, deletes, foreign keys moving and going null, duplicates, late events) in both
pipelines.

``CDC_JOIN_KILL_TRIALS`` trials (default 3: two runs and one full refresh killed; every third
trial kills a full refresh), ``CDC_JOIN_KILL_SEED`` picks the events and kill points. Deep
(about two minutes for three trials): CI runs it with ``-m deep``.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import make_pipeline, silver_rows

pytestmark = [pytest.mark.deep, pytest.mark.sigkill, pytest.mark.kill]

TRIALS = int(os.environ.get("CDC_JOIN_KILL_TRIALS", "3"))
SEED = int(os.environ.get("CDC_JOIN_KILL_SEED", "7"))
_CLI = "import sys; from cdc_join.cli.main import main; sys.exit(main(sys.argv[1:]))"


def _step_lines(lines: list[str]) -> int:
    return sum(1 for line in lines if line.startswith("[run ") and line.endswith(" ..."))


def _killed(config: Path, command: str, after_steps: int, delay: float) -> tuple[int | None, str]:
    """Start ``cdc-join COMMAND CONFIG``; SIGKILL its process group ``delay`` seconds after it
    printed its ``after_steps``-th step line. Returns its exit status (``None``: killed while
    still running) and the last line it printed."""
    process = subprocess.Popen(
        [sys.executable, "-c", _CLI, command, str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    assert process.stdout is not None
    seen: list[str] = []
    killed = False
    try:
        for line in process.stdout:
            seen.append(line.rstrip("\n"))
            if _step_lines(seen) >= after_steps:
                time.sleep(delay)
                killed = process.poll() is None
                break
    finally:  # killed here whatever happens, so no JVM outlives the test
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        status = process.wait(timeout=300)
        process.stdout.close()
    return (None if killed else status), (seen[-1] if seen else "")


def test_a_run_or_full_refresh_killed_anywhere_and_rerun_ends_like_an_uninterrupted_run(
    tmp_path, spark, storage
):
    rng = random.Random(SEED)
    killed, writer = make_pipeline(tmp_path / "killed", spark, storage, join_type="left")
    twin, twin_writer = make_pipeline(tmp_path / "twin", spark, storage, join_type="left")
    lsn = 0

    def land_a_batch() -> None:
        nonlocal lsn
        for table in ("rhs", "lhs"):
            events = []
            for _ in range(rng.randint(1, 8)):
                lsn = max(1, lsn + rng.choice([1, 1, 1, -3]))  # now and then an event arrives late
                if table == "rhs":
                    key = rng.randint(1, 4)
                    row = {"id": key, "value": f"r{key}@{lsn}"}
                else:
                    key = rng.choice("abcdefgh")
                    row = {"id": key, "fk": rng.choice([1, 2, 3, 4, 5, None]), "v": lsn}
                deleted = rng.random() < 0.2
                event = writer.delete(table, {"id": key}, lsn) if deleted else writer.upsert(table, row, lsn)
                events += [event] * (2 if rng.random() < 0.2 else 1)  # and now and then twice
            writer.write(table, events)
            twin_writer.write(table, events)

    land_a_batch()
    twin.run()
    killed.run()
    steps = {"run": 10, "full-refresh": 6}  # step lines each prints for this pipeline
    outcomes = []
    for trial in range(TRIALS):
        land_a_batch()
        twin.run()
        command = "full-refresh" if trial % 3 == 2 else "run"
        after = rng.randint(1, steps[command])
        # After the first step line (ingest, while the JVM warms up) anywhere in the next ~12 s;
        # later, within 0.6 s of a step starting, where its reads and writes are.
        delay = rng.uniform(0, 12) if after == 1 else rng.uniform(0, 0.6)
        status, last = _killed(killed.config.config_path, command, after, delay)
        outcomes.append(f"{command} {'killed' if status is None else f'exited {status}'} at {last!r}")
        killed.run()  # a full refresh killed midway is finished by the next run (README)
        where = f"trial {trial}: {outcomes[-1]}"
        assert silver_rows(killed) == silver_rows(twin), where
        assert killed.verify().ok, where
    killed.run()  # and an ordinary run after the last rerun changes nothing
    assert silver_rows(killed) == silver_rows(twin)
    assert any("killed" in o for o in outcomes), outcomes
    print("\n".join(outcomes))
