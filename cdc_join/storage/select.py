"""Choosing the storage backend: delta-spark where Spark can load Delta, else delta-rs.

The choice is ``backend`` if given, else the environment variable ``CDC_JOIN_STORAGE``:
``delta-rs``, ``delta-spark``, or ``auto`` (also the default when unset or empty). ``auto``
takes delta-spark when the Delta classes load in the session's JVM (Databricks, or a cluster
started with the Delta jars) and delta-rs otherwise. Forcing delta-spark where the classes do
not load is an error that says why, rather than a late ``DATA_SOURCE_NOT_FOUND`` from Spark.
"""

from __future__ import annotations

import os
import threading
import weakref

from pyspark.sql import SparkSession

from cdc_join.errors import StorageError
from cdc_join.storage.base import Storage

ENV_VAR = "CDC_JOIN_STORAGE"
DELTA_RS = "delta-rs"
DELTA_SPARK = "delta-spark"
AUTO = "auto"
BACKENDS = (DELTA_RS, DELTA_SPARK, AUTO)

# io.delta.tables.DeltaTable is the public API class and also exists on Databricks, whose Delta
# internals live under com.databricks.*; DeltaLog is the open-source engine class.
_DELTA_CLASSES = ("io.delta.tables.DeltaTable", "org.apache.spark.sql.delta.DeltaLog")
_DELTA_EXTENSION = "io.delta.sql.DeltaSparkSessionExtension"

_lock = threading.Lock()
_cache: weakref.WeakKeyDictionary[SparkSession, dict[str, Storage]] = weakref.WeakKeyDictionary()


def _jvm_of(spark: SparkSession) -> object | None:
    """The py4j JVM view of a classic session; ``None`` on Spark Connect."""
    try:
        return spark._jvm
    except Exception:  # Spark Connect raises PySparkAttributeError (JVM_ATTRIBUTE_NOT_SUPPORTED)
        return None


def delta_jars_available(spark: SparkSession) -> tuple[bool, str]:
    """Whether Delta Lake can be used through Spark in this session, and why (not).

    On a classic session the Delta classes are loaded through the JVM, and Delta's SQL session
    extension must be configured (Databricks has it built in). On Spark Connect there is no JVM
    handle; the session's ``spark.sql.extensions`` or a Databricks runtime stand in.

    Returns:
        ``(available, reason)``; ``reason`` is a sentence for logs and skip messages.
    """
    jvm = _jvm_of(spark)
    if jvm is None:
        if os.environ.get("DATABRICKS_RUNTIME_VERSION"):
            return True, f"Databricks runtime {os.environ['DATABRICKS_RUNTIME_VERSION']} ships Delta"
        try:
            extensions = spark.conf.get("spark.sql.extensions", "") or ""
        except Exception as exc:
            return False, f"Spark Connect session; could not read spark.sql.extensions ({exc})"
        if _DELTA_EXTENSION in extensions:
            return True, f"Spark Connect session with {_DELTA_EXTENSION} configured"
        return False, f"Spark Connect session without {_DELTA_EXTENSION} in spark.sql.extensions"
    failures = []
    loaded = None
    for name in _DELTA_CLASSES:
        try:
            # The context class loader: jars added with spark.jars(.packages) live there, not
            # in the loader of java.lang.Class.
            loader = jvm.java.lang.Thread.currentThread().getContextClassLoader()  # type: ignore[attr-defined]
            jvm.java.lang.Class.forName(name, False, loader)  # type: ignore[attr-defined]
            loaded = name
            break
        except Exception as exc:
            failures.append(_describe(exc))
    if loaded is None:
        return False, "Delta jars are not on the Spark classpath (" + "; ".join(failures) + ")"
    # MERGE, OPTIMIZE and SQL on delta.`path` need Delta's session extension; Databricks has it
    # built in without listing it.
    if os.environ.get("DATABRICKS_RUNTIME_VERSION"):
        return True, f"{loaded} loads in the Spark JVM (Databricks runtime)"
    extensions = spark.conf.get("spark.sql.extensions", "") or ""
    if _DELTA_EXTENSION not in extensions:
        return False, (
            f"{loaded} loads but spark.sql.extensions does not include {_DELTA_EXTENSION} "
            "(start the session with CDC_JOIN_STORAGE=delta-spark, see cdc_join.session)"
        )
    return True, f"{loaded} loads in the Spark JVM and {_DELTA_EXTENSION} is configured"


def _describe(exc: Exception) -> str:
    """A one-line account of a failed class load (py4j wraps the Java exception)."""
    java_exc = getattr(exc, "java_exception", None)
    if java_exc is not None:
        try:
            return str(java_exc.toString())
        except Exception:
            pass
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def requested_backend(backend: str | None) -> str:
    """The backend asked for (argument, else ``CDC_JOIN_STORAGE``, else ``auto``); no Spark needed.

    Raises:
        StorageError: an unknown name.
    """
    choice = backend if backend is not None else os.environ.get(ENV_VAR, "")
    choice = (choice or AUTO).strip().lower()
    if choice not in BACKENDS:
        source = "backend argument" if backend is not None else f"environment variable {ENV_VAR}"
        raise StorageError(f"Unknown storage backend {choice!r} (from the {source}); use one of {BACKENDS}")
    return choice


def _build(spark: SparkSession, name: str) -> Storage:
    if name == DELTA_RS:
        from cdc_join.storage.delta_rs import DeltaRsStorage

        return DeltaRsStorage(spark)
    from cdc_join.storage.delta_spark import DeltaSparkStorage

    return DeltaSparkStorage(spark)


def get_storage(spark: SparkSession, backend: str | None = None) -> Storage:
    """The storage backend for ``spark``: one cached instance per session and backend name.

    Args:
        spark: the session the backend computes in.
        backend: ``"delta-rs"``, ``"delta-spark"`` or ``"auto"``; ``None`` reads
            ``CDC_JOIN_STORAGE`` (unset means ``auto``).

    Raises:
        StorageError: an unknown backend name, or delta-spark forced where the Delta jars
            cannot be loaded.
    """
    choice = requested_backend(backend)
    # A session not started yet (cdc_join.session.DeferredSession) that knows whether it will
    # load Delta: trusted, so that choosing starts no JVM (a start without the jars fails then).
    configured = getattr(spark, "delta_configured", lambda: None)()
    if choice == AUTO:
        available = configured if configured is not None else delta_jars_available(spark)[0]
        name = DELTA_SPARK if available else DELTA_RS
    elif choice == DELTA_SPARK:
        available, reason = (True, "") if configured else delta_jars_available(spark)
        if not available:
            raise StorageError(f"The delta-spark storage backend was requested but cannot be used: {reason}")
        name = DELTA_SPARK
    else:
        name = DELTA_RS
    with _lock:
        per_session = _cache.setdefault(spark, {})
        if name not in per_session:
            per_session[name] = _build(spark, name)
        return per_session[name]
