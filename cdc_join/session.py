"""The SparkSession a run uses: an active one if there is one (Databricks), else a local one."""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Iterator

from pyspark.sql import SparkSession

LOCAL_DEFAULTS = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "4",
    "spark.default.parallelism": "4",
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.adaptive.enabled": "true",
    "spark.driver.memory": "4g",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    # Spark keeps the classes it compiled for 100 queries by default; an ingest alone compiles
    # more than that, so a session running one pipeline run after another compiled each run's
    # queries anew (about 40 classes a run).
    "spark.sql.codegen.cache.maxEntries": "1000",
    # HotSpot leaves a method of more than 8,000 bytes of bytecode interpreted for good, and
    # whole-stage code generation writes such methods for wide projections (ingest decodes every
    # column of both images in one). Measured on the ingest of 472,540 events, warm: 24 s → 18.5 s.
    # (The default options: Spark adds them before spark.driver.extraJavaOptions, which a user's
    # spark-defaults.conf may set.)
    "spark.driver.defaultJavaOptions": "-XX:-DontCompileHugeMethods",
}


#: Settings a Connect client cannot change on a running session (Spark warns and ignores them).
_STARTUP_ONLY = frozenset(
    {
        "spark.driver.memory",
        "spark.driver.defaultJavaOptions",
        "spark.ui.enabled",
        "spark.ui.showConsoleProgress",
        "spark.sql.codegen.cache.maxEntries",
    }
)


def get_spark(
    app_name: str = "cdc_join", extra_conf: dict[str, str] | None = None, *, quiet: bool = False
) -> SparkSession:
    """Return the active SparkSession, or start one with small-machine defaults.

    On Databricks (or any driver that already has a session) the active session is reused
    untouched. With ``CDC_JOIN_SPARK_REMOTE`` set, the session is a Spark Connect client:
    ``local[2]`` starts a local Connect server (the ``pyspark[connect]`` extra), and
    ``sc://host:port`` reaches a running one (Databricks serverless runs PySpark this way).
    Otherwise the master comes from ``CDC_JOIN_SPARK_MASTER`` (default ``local[2]``). Where
    the Delta jars are on the classpath, ``CDC_JOIN_STORAGE=delta-spark`` also configures the
    Delta SQL extension and catalog. With ``quiet`` a JVM started here writes its own output
    (log4j start-up lines, JDK warnings) to :data:`JVM_LOG` instead of the terminal; errors
    still reach Python as exceptions.
    """
    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    if os.environ.get("DATABRICKS_RUNTIME_VERSION"):
        # The cluster's session is configured by the cluster; laptop defaults don't belong there.
        return SparkSession.builder.getOrCreate()
    remote = os.environ.get("CDC_JOIN_SPARK_REMOTE")
    if remote:
        builder = SparkSession.builder.appName(app_name).remote(remote)
    else:
        builder = SparkSession.builder.appName(app_name).master(
            os.environ.get("CDC_JOIN_SPARK_MASTER", "local[2]")
        )
    if not remote or not remote.startswith("sc://"):  # a server started here takes the defaults
        for key, value in {**LOCAL_DEFAULTS, **(extra_conf or {})}.items():
            if remote and key in _STARTUP_ONLY:  # a Connect client cannot set these on its session
                continue
            builder = builder.config(key, value)
    if os.environ.get("CDC_JOIN_STORAGE") == "delta-spark":
        builder = builder.config("spark.sql.extensions", "io.delta.sql.DeltaSparkSessionExtension").config(
            "spark.sql.catalog.spark_catalog", "org.apache.spark.sql.delta.catalog.DeltaCatalog"
        )
    with _jvm_output_to(JVM_LOG) if quiet else contextlib.nullcontext():
        spark = builder.getOrCreate()
    if quiet:
        quiet_query_context_logs()
    if not remote:
        spark.sparkContext.setLogLevel("ERROR")
    return spark


#: PySpark's loggers that print every analysis error as JSON with its Java stack trace when the
#: error is raised, even one the caller catches (a ``select`` expression checked before a run).
QUERY_CONTEXT_LOGGERS = ("SQLQueryContextLogger", "DataFrameQueryContextLogger")


def quiet_query_context_logs(quiet: bool = True) -> None:
    """Keep PySpark's query-context error logs off the terminal (``quiet=False``: back on, at
    PySpark's own level): the CLI reports each error in one line, the trace only under
    ``--debug``."""
    try:
        from pyspark.logger import PySparkLogger
    except ImportError:  # an older PySpark has no such loggers
        return
    for name in QUERY_CONTEXT_LOGGERS:
        PySparkLogger.getLogger(name).setLevel(logging.CRITICAL + 1 if quiet else logging.WARNING)


#: Where a quiet session's JVM writes its standard error.
JVM_LOG = os.path.join(
    tempfile.gettempdir(), f"cdc_join-spark-{os.getuid() if hasattr(os, 'getuid') else 0}.log"
)


@contextlib.contextmanager
def _jvm_output_to(path: str) -> Iterator[None]:
    """Point file descriptor 2 at ``path`` while the JVM starts: it inherits that, Python gets
    its own stderr back."""
    saved = os.dup(2)
    try:
        with open(path, "ab") as log:
            os.dup2(log.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
