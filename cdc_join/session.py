"""The SparkSession a run uses: an active one if there is one (Databricks), else a local one."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import tempfile
import warnings
from collections.abc import Callable, Iterator
from typing import cast

from pyspark.sql import SparkSession

from cdc_join import class_archive as archives
from cdc_join.errors import StorageError
from cdc_join.storage import delta_jars

_log = logging.getLogger(__name__)

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
    # The JVM's own zone is UTC, like the session's: Delta checks a table's file list against
    # a full replay of its log after every commit when the JVM's or the machine's zone is
    # another (allFilesInCrc.verificationMode.forceOnNonUTC), a Spark job per commit on a laptop
    # outside UTC.
    # (The default options: Spark adds them before spark.driver.extraJavaOptions, which a user's
    # spark-defaults.conf may set.)
    "spark.driver.defaultJavaOptions": "-XX:-DontCompileHugeMethods -Duser.timezone=UTC",
    # Delta replays a table's log in this many tasks (default 50) whenever its snapshot is
    # rebuilt, which a run does for every table it writes. Measured on a two-source pipeline,
    # delta-spark backend: a run with a few changes 10 s -> 5.5 s, a verify 13 s -> 3.7 s.
    "spark.databricks.delta.snapshotPartitions": "2",
}

#: New landing bytes up to which a run counts as small work (:func:`get_spark`'s ``small``).
SMALL_WORK_BYTES = 4 * 1024 * 1024
#: The Java option of a JVM started for small work: its JIT compiles with C1 only. A new
#: process running a small batch spends its seconds in code the JVM has not compiled yet, and
#: C2's compilations take one of the two cores from it; C1 code is slower, which pays only for
#: long work. Measured (2026-12-07, a new `cdc-join run` process on delta-spark, 10 changed rows,
#: interleaved, 3 each): 23.1-24.1 s -> 19.2-19.5 s (one of 28.2 s); in one warm test session of
#: many small runs it cost 25% (93 s -> 117 s), so only a JVM started for small work gets it.
SMALL_WORK_JAVA_OPTION = "-XX:TieredStopAtLevel=1"
#: Spark's settings for small work, unless the caller sets them: no generated code (Spark's
#: interpreted expressions), which a small batch runs faster than Janino compiles the code it
#: would generate. Measured as above, with C1 only on both sides: 18.0-18.4 s -> 16.1-16.4 s;
#: at SF 1 with 1,500 changed rows in a warm session it cost 15% (benchmarks/README.md).
SMALL_WORK_CONF = {"spark.sql.codegen.wholeStage": "false", "spark.sql.codegen.factoryMode": "NO_CODEGEN"}


def get_spark(
    app_name: str = "cdc_join",
    extra_conf: dict[str, str] | None = None,
    *,
    quiet: bool = False,
    storage: str | None = None,
    small: bool = False,
    class_archive: bool = False,
) -> SparkSession:
    """Return the active SparkSession, or start one with small-machine defaults.

    On Databricks (or any driver that already has a session) the active session is reused
    untouched. With ``CDC_JOIN_SPARK_REMOTE`` set, the session is a Spark Connect client:
    ``local[2]`` starts a local Connect server (the ``pyspark[connect]`` extra), and
    ``sc://host:port`` reaches a running one (Databricks serverless runs PySpark this way).
    Otherwise the master comes from ``CDC_JOIN_SPARK_MASTER`` (default ``local[2]``). Where
    ``storage`` (default ``CDC_JOIN_STORAGE``) ``delta-spark`` gives a session started here the
    Delta jars (fetched once into Spark's Ivy cache, see :mod:`cdc_join.storage.delta_jars`) and
    Delta's SQL extension and catalog. With ``quiet`` a JVM started here writes its own output
    (log4j start-up lines, JDK warnings) to :data:`JVM_LOG` instead of the terminal; errors
    still reach Python as exceptions. With ``small`` the session is for small work (a run of a
    few megabytes of new events): a JVM started here compiles with C1 only
    (:data:`SMALL_WORK_JAVA_OPTION`) and Spark generates no code (:data:`SMALL_WORK_CONF`).
    With ``class_archive`` (a command's new process) a JVM started here loads its classes from
    the archive kept for it, or writes one as this process ends (:mod:`cdc_join.class_archive`).

    Raises:
        StorageError: the Delta jars could not be had (the message names ``--storage delta-rs``).
    """
    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    if os.environ.get("DATABRICKS_RUNTIME_VERSION"):
        # The cluster's session is configured by the cluster; laptop defaults don't belong there.
        return SparkSession.builder.getOrCreate()
    remote = os.environ.get(REMOTE_ENV)
    if remote and remote.startswith("sc://"):
        check_reachable(remote)
    conf = _local_conf(remote, extra_conf, storage, small)
    archive = archives.for_jvm(conf) if class_archive and not remote else None
    if delta_jars.resolves(extra_conf or {}, conf):
        # Ivy's cache takes one resolution at a time; whoever waited finds the jars resolved.
        with delta_jars.resolution_lock():
            conf = _local_conf(remote, extra_conf, storage, small)
            spark = _start_with(archive, app_name, remote, conf, quiet)
            if "spark.jars.packages" in conf:
                delta_jars.remember(conf["spark.jars.packages"], _resolved_jars(spark))
    else:
        spark = _start_with(archive, app_name, remote, conf, quiet)
    if quiet:
        quiet_query_context_logs()
    if not remote:
        spark.sparkContext.setLogLevel("ERROR")
    return spark


class DeferredSession:
    """A :func:`get_spark` session started when first used, so that a command that finds it
    has nothing to do (a run with nothing landed and nothing unapplied, see
    :mod:`cdc_join.run.idle`) starts no JVM. Everything else reaches the session through it.
    """

    def __init__(
        self,
        app_name: str = "cdc_join",
        *,
        quiet: bool = False,
        storage: str | None = None,
        class_archive: bool = False,
    ) -> None:
        self._args = (app_name, quiet, storage)
        self._class_archive = class_archive
        self._session: SparkSession | None = SparkSession.getActiveSession()
        self._failed: StorageError | None = None
        """Why the session could not start: asked again, it says so at once instead of trying
        again (an unreachable Connect server costs :data:`CONNECT_TIMEOUT_S` a try)."""
        self.work_bytes: Callable[[], int | None] | None = None
        """Asked as the session starts: the bytes of work it is started for (a run's new
        landing files), ``None`` when unknown; up to :data:`SMALL_WORK_BYTES` the session is
        started for small work (:func:`get_spark`)."""
        self.small_conf: dict[str, str] | None = None
        """Settings a session started for small work gets besides :data:`SMALL_WORK_CONF`: those
        of work whose every input is small (a verify of a small lake, whose ``work_bytes`` are
        all it reads), which a run, reading a big lake for a small batch, cannot take."""

    @property
    def started(self) -> bool:
        return self._session is not None

    def session(self) -> SparkSession:
        """The session, started now if it was not."""
        if self._session is None:
            if self._failed is not None:
                raise self._failed
            app_name, quiet, storage = self._args
            # Asked once; a question that itself needs the session (a lake Spark reads) finds
            # none to ask and starts it for work of unknown size.
            ask, self.work_bytes = self.work_bytes, None
            try:
                work = ask() if ask is not None else None
            except Exception:  # the run's own reads report what is wrong, with their context
                work = None
            if self._session is not None:  # started while asking
                return self._session
            small = work is not None and work <= SMALL_WORK_BYTES
            extra, self.small_conf = (self.small_conf if small else None), None
            try:
                self._session = get_spark(
                    app_name,
                    extra,
                    quiet=quiet,
                    storage=storage,
                    small=small,
                    class_archive=self._class_archive,
                )
            except StorageError as exc:
                self._failed = exc
                raise
        return self._session

    def delta_configured(self) -> bool | None:
        """Whether the session this would start here loads Delta (``CDC_JOIN_STORAGE`` or the
        ``storage`` asked for is ``delta-spark``); ``None`` when only a started session can tell:
        it was started already, runs elsewhere (Databricks, Spark Connect), or Spark's own
        settings files or arguments may add jars."""
        if (
            self._session is not None
            or os.environ.get("DATABRICKS_RUNTIME_VERSION")
            or os.environ.get(REMOTE_ENV)
        ):
            return None
        if os.environ.get("PYSPARK_SUBMIT_ARGS") or _spark_defaults_file() is not None:
            return None
        return _wants_delta(self._args[2])

    def __getattr__(self, name: str) -> object:
        # Not set yet (a copy):
        if name in ("_args", "_session", "_failed", "work_bytes", "small_conf", "_class_archive"):
            raise AttributeError(name)
        return getattr(self.session(), name)


def started(spark: SparkSession | DeferredSession) -> SparkSession:
    """The session itself, started if ``spark`` defers it."""
    return spark.session() if isinstance(spark, DeferredSession) else spark


def _spark_defaults_file() -> str | None:
    """Spark's ``spark-defaults.conf`` that a session started here would read, if there is one."""
    folders = [os.environ.get("SPARK_CONF_DIR")]
    if os.environ.get("SPARK_HOME"):
        folders.append(os.path.join(os.environ["SPARK_HOME"], "conf"))
    try:
        import pyspark

        folders.append(os.path.join(os.path.dirname(pyspark.__file__), "conf"))
    except ImportError:
        pass
    for folder in filter(None, folders):
        path = os.path.join(folder, "spark-defaults.conf")
        if os.path.exists(path):
            return path
    return None


def _start_with(
    archive: archives.ClassArchive | None,
    app_name: str,
    remote: str | None,
    conf: dict[str, str],
    quiet: bool,
) -> SparkSession:
    """:func:`_start` of a session whose JVM gets ``archive``'s Java options: it loads its
    classes from the archive, or records them for the archive this process then writes as it
    ends (or none: the first command only marks the machine). A JVM that does not start with
    the archive (one damaged since it was written makes HotSpot crash) starts again without
    it, and the archive is removed."""
    options = "" if archive is None else archive.java_options()
    if archive is None or not options:
        return _start(_builder(app_name, remote, conf), conf, quiet)
    key, ready = "spark.driver.defaultJavaOptions", archive.ready
    given = {**conf, key: f"{conf.get(key, '')} {options}".strip()}
    try:
        spark = _start(_builder(app_name, remote, given), given, quiet)
    except Exception as exc:
        if not ready or "JAVA_GATEWAY_EXITED" not in f"{exc} {exc.__cause__}":
            raise
        _log.warning("the JVM did not start with the class archive %s: removed", archive.path)
        archive.remove()
        return _start(_builder(app_name, remote, conf), conf, quiet)
    if not ready:
        archive.write_at_exit(spark)
    return spark


def _builder(app_name: str, remote: str | None, conf: dict[str, str]) -> SparkSession.Builder:
    builder = SparkSession.builder.appName(app_name)
    if remote:
        builder = builder.remote(remote)
    else:
        builder = builder.master(os.environ.get("CDC_JOIN_SPARK_MASTER", "local[2]"))
    for key, value in conf.items():
        builder = builder.config(key, value)
    return builder


def _resolved_jars(spark: SparkSession) -> str:
    """The session's ``spark.jars``: with ``spark.jars.packages``, what Ivy resolved ("" if it
    cannot be read)."""
    try:
        return spark.conf.get("spark.jars", "") or ""
    except Exception:  # a session that does not give its static settings away
        return ""


#: The variable naming a Spark Connect server (or ``local[N]``, one this process starts).
REMOTE_ENV = "CDC_JOIN_SPARK_REMOTE"
#: Seconds to wait for a Spark Connect server to answer before giving up (the Connect client
#: itself retries an unreachable server for about ten minutes).
CONNECT_TIMEOUT_S = 10.0


def check_reachable(remote: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Raise :class:`StorageError` within ``timeout`` seconds unless the Spark Connect server
    ``remote`` (``sc://host[:port][/;params]``) answers: a gRPC channel built from the address
    as the Connect client builds it (TLS, token) gets ready, which takes a server speaking
    HTTP/2 behind it, not only an open port.

    The error names the address and :data:`REMOTE_ENV`, which set it, so a scheduler sees a
    failed job at once instead of a client retrying for minutes.
    """
    import grpc
    from pyspark.sql.connect.client.core import DefaultChannelBuilder

    builder = DefaultChannelBuilder(remote)
    channel = builder.toChannel()
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout)
    except grpc.FutureTimeoutError:
        raise StorageError(
            f"the Spark Connect server at {builder.endpoint} (from {REMOTE_ENV}) did not answer "
            f"within {timeout:g} s. Start the server, fix {REMOTE_ENV}, or unset it to run Spark "
            "in this process"
        ) from None
    finally:
        channel.close()


def _local_conf(
    remote: str | None, extra_conf: dict[str, str] | None, storage: str | None, small: bool = False
) -> dict[str, str]:
    """The settings of a session, or of a local Connect server (``local[N]``), started here:
    the server is started in this process with every one of them, those only a start can set
    (driver memory, Java options, the UI) too; for ``small`` work the JIT option and
    :data:`SMALL_WORK_CONF`. None for a
    remote Connect server, which has its own."""
    if remote and remote.startswith("sc://"):
        return {}
    conf = {**LOCAL_DEFAULTS, **(SMALL_WORK_CONF if small else {}), **(extra_conf or {})}
    if small:
        options = conf.get("spark.driver.defaultJavaOptions", "")
        conf["spark.driver.defaultJavaOptions"] = f"{options} {SMALL_WORK_JAVA_OPTION}".strip()
    if _wants_delta(storage):
        conf.update(delta_jars.session_conf(conf))
    return conf


def _wants_delta(storage: str | None) -> bool:
    """Whether a session started here gets the Delta jars: ``storage``, else
    ``CDC_JOIN_STORAGE``, is ``delta-spark``."""
    wanted = storage if storage is not None else os.environ.get("CDC_JOIN_STORAGE", "")
    return (wanted or "").strip().lower() == "delta-spark"


def _start(builder: SparkSession.Builder, conf: dict[str, str], quiet: bool) -> SparkSession:
    """``builder.getOrCreate()``; a start that could not get the Delta jars says so in one line."""
    try:
        with _jvm_output_to(JVM_LOG) if quiet else contextlib.nullcontext(), warnings.catch_warnings():
            # A local Connect server starts with every setting; the client then also tries to
            # set each on its session, and warns for those only a start can set (the jars).
            warnings.filterwarnings("ignore", message="Failed to set spark\\.", category=UserWarning)
            remote = os.environ.get(REMOTE_ENV)
            served = _serve_locally(builder, remote) if remote and not remote.startswith("sc://") else None
            return served or builder.getOrCreate()
    except Exception as exc:
        if "spark.jars.packages" not in conf or "JAVA_GATEWAY_EXITED" not in str(exc):
            raise
        raise StorageError(
            delta_jars.failure_hint(conf["spark.jars.packages"], JVM_LOG if quiet else None)
        ) from exc


def _serve_locally(builder: SparkSession.Builder, master: str) -> SparkSession | None:
    """A Spark Connect session on a local server (``master``: ``local[N]``) started in this
    process, on a port of its own, with the builder's settings. PySpark's own
    ``remote("local[N]")`` binds port 15002 in every process: a second process doing the same
    at once failed to start (the port was taken). ``None`` (start it PySpark's way) when PySpark
    lacks the entry point."""
    try:
        from pyspark.sql.connect.session import SparkSession as ConnectSession

        serve = ConnectSession._start_connect_server
    except (ImportError, AttributeError):
        return None
    with socket.socket() as probe:  # a port nothing listens on now
        probe.bind(("localhost", 0))
        port = probe.getsockname()[1]
    options = {k: v for k, v in builder._options.items() if k != "spark.remote"}
    serve(master, {**options, "spark.connect.grpc.binding.port": str(port)})
    os.environ["SPARK_LOCAL_REMOTE"] = "1"  # as PySpark marks it: stopping the client stops it
    os.environ["SPARK_CONNECT_MODE_ENABLED"] = "1"
    client = ConnectSession.builder.remote(f"sc://localhost:{port}")
    return cast(SparkSession, client.config(map=options).getOrCreate())


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
    """Point file descriptors 1 and 2 at ``path`` while the JVM starts: it inherits them, Python
    gets its own back."""
    import sys

    sys.stdout.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        with open(path, "ab") as log:
            # Standard output too: Ivy prints its resolution report there.
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            yield
    finally:
        sys.stdout.flush()
        for fd, copy in zip((1, 2), saved, strict=True):
            os.dup2(copy, fd)
            os.close(copy)
