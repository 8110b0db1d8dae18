"""The Spark session cdc_join starts: its settings on every kind of start, and the Delta jars
taken from the cache once they were resolved."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from cdc_join import session
from cdc_join.storage import delta_jars


def test_a_local_connect_server_gets_every_local_setting():
    # The server starts in this process: driver memory, Java options and the UI are its to set.
    conf = session._local_conf("local[2]", {"spark.sql.shuffle.partitions": "1"}, "delta-rs")
    assert conf["spark.driver.memory"] == session.LOCAL_DEFAULTS["spark.driver.memory"]
    assert "-XX:-DontCompileHugeMethods" in conf["spark.driver.defaultJavaOptions"]
    assert conf["spark.ui.enabled"] == "false"
    assert conf["spark.sql.shuffle.partitions"] == "1"
    assert session._local_conf("sc://host:15002", None, "delta-spark") == {}  # a server of its own


def test_a_jvm_started_for_small_work_compiles_with_c1_only(monkeypatch):
    small = session._local_conf(None, None, "delta-rs", small=True)["spark.driver.defaultJavaOptions"]
    assert session.SMALL_WORK_JAVA_OPTION in small and "-XX:-DontCompileHugeMethods" in small
    assert (
        session.SMALL_WORK_JAVA_OPTION
        not in session._local_conf(None, None, "delta-rs")["spark.driver.defaultJavaOptions"]
    )
    # No generated code for small work, unless the caller says otherwise.
    assert session._local_conf(None, None, "delta-rs", small=True)["spark.sql.codegen.wholeStage"] == "false"
    assert "spark.sql.codegen.wholeStage" not in session._local_conf(None, None, "delta-rs")
    mine = {"spark.sql.codegen.wholeStage": "true"}
    assert session._local_conf(None, mine, "delta-rs", small=True)["spark.sql.codegen.wholeStage"] == "true"
    # A deferred session asks the bytes of the work it starts for: small up to SMALL_WORK_BYTES.
    started = []
    monkeypatch.setattr(session, "get_spark", lambda *_, **kw: started.append(kw["small"]) or object())
    monkeypatch.setattr(session.SparkSession, "getActiveSession", staticmethod(lambda: None))
    for work in (None, 0, session.SMALL_WORK_BYTES, session.SMALL_WORK_BYTES + 1, "unasked"):
        deferred = session.DeferredSession()
        if work != "unasked":
            deferred.work_bytes = lambda work=work: work
        deferred.session()
    assert started == [False, True, True, False, False]
    # A question that needs the session itself (a lake only Spark reads) starts it once, not small.
    deferred, asked = session.DeferredSession(), []
    deferred.work_bytes = lambda: asked.append(1) or (deferred.session() and 0)
    assert deferred.session() is deferred.session()
    assert len(asked) == 1
    assert started == [False, True, True, False, False, False]


def test_a_session_started_for_a_small_verify_gets_its_settings_and_a_big_one_not(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from cdc_join.checks import verify
    from tests.support import make_pipeline

    started = []
    monkeypatch.setattr(
        session, "get_spark", lambda *a, **kw: started.append((a[1:], kw["small"])) or object()
    )
    monkeypatch.setattr(session.SparkSession, "getActiveSession", staticmethod(lambda: None))
    monkeypatch.setattr(verify, "verify", lambda storage, config, **_: storage.spark.session())
    for lake_bytes in (0, session.SMALL_WORK_BYTES + 1):
        monkeypatch.setattr(verify, "read_bytes", lambda config, n=lake_bytes: n)
        deferred = session.DeferredSession()
        pipeline, _ = make_pipeline(tmp_path, deferred, SimpleNamespace(name="delta-rs", spark=deferred))
        pipeline.verify()
        assert deferred.small_conf is None  # taken once, as work_bytes
    assert started == [((verify.SMALL_LAKE_CONF,), True), ((None,), False)]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An Ivy cache of its own, holding one resolved jar."""
    monkeypatch.setattr(delta_jars, "cache_dir", lambda: tmp_path / "ivy")
    jars = tmp_path / "ivy" / "jars"
    jars.mkdir(parents=True)
    jar = jars / "io.delta_delta-spark_4.2_2.13-4.4.0.jar"
    jar.write_bytes(b"jar")
    return jar


def test_jars_resolved_once_are_given_from_the_cache_without_asking_a_repository(cache):
    package = delta_jars.delta_package()
    first = delta_jars.session_conf({})
    assert first["spark.jars.packages"] == package and delta_jars.resolves({}, first)
    other = cache.parent / "org.slf4j_slf4j-api-2.0.13.jar"
    other.write_bytes(b"jar")
    found = f"file://{cache},file://{other},file:///elsewhere/x.jar"
    assert delta_jars.remember(package, found) == [str(cache), str(other)]
    again = delta_jars.session_conf({"spark.jars": "/mine.jar"})
    assert "spark.jars.packages" not in again and "spark.jars.ivySettings" not in again
    assert again["spark.jars"] == f"/mine.jar,{cache},{other}"
    assert not delta_jars.resolves({}, again)
    other.unlink()  # a jar gone from the cache: resolve again
    assert delta_jars.session_conf({})["spark.jars.packages"] == package


def test_a_caller_s_own_packages_are_left_alone(cache):
    conf = delta_jars.session_conf({"spark.jars.packages": "g:a:1"})
    assert "spark.jars" not in conf and not delta_jars.resolves({"spark.jars.packages": "g:a:1"}, conf)


def test_one_process_at_a_time_resolves_into_the_cache(cache, tmp_path):
    # A second process wanting the lock waits until the first lets it go.
    script = textwrap.dedent(
        f"""
        import time
        from pathlib import Path
        from cdc_join.storage import delta_jars
        delta_jars.cache_dir = lambda: Path({str(cache.parent.parent)!r})
        with delta_jars.resolution_lock():
            print(time.time(), flush=True)
        """
    )
    with delta_jars.resolution_lock():
        child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        time.sleep(2.0)
        released = time.time()
    taken = float(child.communicate(timeout=60)[0])
    assert taken >= released


def test_the_lock_is_held_by_one_thread_of_a_process_at_a_time(cache):
    held, order = threading.Event(), []

    def other():
        held.wait(10)
        with delta_jars.resolution_lock():
            order.append("other")

    thread = threading.Thread(target=other)
    thread.start()
    with delta_jars.resolution_lock():
        held.set()
        time.sleep(0.5)
        order.append("first")
    thread.join(10)
    assert order == ["first", "other"]


def test_an_unreachable_connect_server_is_refused_within_the_deadline():
    began = time.monotonic()
    with pytest.raises(session.StorageError, match=r"127\.0\.0\.1:9 \(from CDC_JOIN_SPARK_REMOTE\)"):
        session.check_reachable("sc://127.0.0.1:9/;token=t", timeout=1)
    assert time.monotonic() - began < 10


def test_a_session_that_could_not_start_says_so_again_without_trying_again(monkeypatch):
    # An unreachable Connect server costs its deadline a try: a command asks once, and every
    # later use of the deferred session fails at once with the same error.
    tries = []

    def unreachable(*_, **__):
        tries.append(1)
        raise session.StorageError("the Spark Connect server at h:1 did not answer")

    monkeypatch.setattr(session, "get_spark", unreachable)
    monkeypatch.setattr(session.SparkSession, "getActiveSession", staticmethod(lambda: None))
    deferred = session.DeferredSession()
    for _ in range(3):
        with pytest.raises(session.StorageError, match="did not answer"):
            deferred.session()
    assert tries == [1]


@pytest.mark.connect
def test_the_session_started_here_has_every_local_setting(spark):
    # Run over Spark Connect too (CI): a local Connect server is started by this process.
    assert spark.conf.get("spark.driver.memory") == session.LOCAL_DEFAULTS["spark.driver.memory"]
    assert "-XX:-DontCompileHugeMethods" in spark.conf.get("spark.driver.defaultJavaOptions")
    assert spark.conf.get("spark.ui.enabled") == "false"


@pytest.mark.deep
def test_a_session_started_here_runs_its_jvm_in_utc_on_a_machine_in_another_zone(tmp_path):
    # Delta rebuilds a small table's state after every commit to check its checksum's file list
    # when the session's, the JVM's or the system property's zone is not UTC: one Spark job per
    # commit. A new process (its JVM takes the zone at start) on a machine in Los Angeles.
    script = textwrap.dedent(
        """
        from cdc_join.session import get_spark
        spark = get_spark("tz", {"spark.master": "local[1]"}, storage="delta-spark")
        jvm = spark._jvm
        print(jvm.java.util.TimeZone.getDefault().getID())
        print(jvm.java.lang.System.getProperty("user.timezone"))
        snapshot = getattr(getattr(jvm.org.apache.spark.sql.delta, "Snapshot$"), "MODULE$")
        print(snapshot.allFilesInCrcVerificationForceEnabled(spark._jsparkSession))
        """
    )
    env = {**os.environ, "TZ": "America/Los_Angeles", "CDC_JOIN_STORAGE": "delta-spark"}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["UTC", "UTC", "False"]


@pytest.mark.deep
def test_two_processes_with_a_local_connect_server_at_once_each_reach_their_own(tmp_path):
    # PySpark's remote("local[N]") binds port 15002 in every process: the second of two runs
    # started at once (two pipelines on one machine, two test workers) failed to start.
    script = textwrap.dedent(
        """
        import time
        from pyspark.sql import SparkSession
        from cdc_join.session import get_spark
        spark = get_spark("two", quiet=True)
        own = SparkSession._instantiatedSession  # the local server's own session
        time.sleep(5)  # both servers are up before either stops
        print(spark.range(3).count(), spark.conf.get("spark.app.id") == own.sparkContext.applicationId)
        """
    )
    env = {**os.environ, session.REMOTE_ENV: "local[1]", "CDC_JOIN_STORAGE": "delta-rs"}
    children = [
        subprocess.Popen(
            [sys.executable, "-c", script],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    found = [child.communicate(timeout=600) for child in children]
    for child, (out, err) in zip(children, found, strict=True):
        assert child.returncode == 0, err[-2000:]
        assert out.split() == ["3", "True"], (out, err[-2000:])
