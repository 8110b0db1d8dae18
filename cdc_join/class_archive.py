"""A class archive for the JVM a ``cdc-join`` command starts: its classes loaded from one file.

A scheduler starts ``cdc-join`` as a new process for every run, and a new JVM spends seconds
finding, reading and verifying the same ten thousand classes of Spark and its libraries each
time. HotSpot's class data sharing keeps them in an archive that the next JVM maps instead
(JDK 13+; the Java runtime's own classes are in the archive it ships). A command's JVM is
started with the archive when there is one for it. Else the first command only leaves a mark
(a machine whose files do not outlive the process, a container started afresh for each run,
never pays for an archive no later process would use); a command that finds the mark records
what its JVM loads, and its process writes the archive as it ends (``VM.cds dynamic_dump``, a
command of the running JVM, JDK 17+: about 10,000 classes, 120 MB, 5-10 s once).

The archive is kept per JVM: one file per Java runtime, Spark install and Java options
(:func:`key`), in ``$CDC_JOIN_CLASS_ARCHIVE`` (a folder; ``off`` turns this off), else in the
user's cache folder. It is written under a name of its own and renamed into place, so a reader
finds a whole archive or none; one process writes it at a time (a lock file), and a JVM that
cannot use it (another build, another class path) starts without it, as ``-Xshare:auto`` does.
Only JVMs this process starts get it: not a Spark Connect server elsewhere, not Databricks.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_log = logging.getLogger(__name__)

#: The variable naming the folder of the archives, or ``off``.
ENV = "CDC_JOIN_CLASS_ARCHIVE"
#: A lock or unfinished archive older than this was left by a process that died.
STALE_S = 600.0
#: The settings whose values change what a JVM loads or how its classes are laid out.
KEYED_SETTINGS = (
    "spark.driver.defaultJavaOptions",
    "spark.driver.extraJavaOptions",
    "spark.driver.extraClassPath",
    "spark.driver.memory",
)


def folder() -> str | None:
    """Where the archives are kept; ``None`` when turned off."""
    chosen = os.environ.get(ENV, "").strip()
    if chosen.lower() in ("off", "0", "false", "no"):
        return None
    if chosen:
        return chosen
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "cdc_join", "class-archive")


def key(conf: Mapping[str, str]) -> str | None:
    """What tells one JVM's archive from another's: the Java runtime (its path and its module
    image), PySpark's jars (their folder and names) and the settings of :data:`KEYED_SETTINGS`;
    ``None`` when no Java runtime is found."""
    java = _java()
    if java is None:
        return None
    home = os.path.dirname(os.path.dirname(os.path.realpath(java)))
    parts = [os.path.realpath(java), *_stamp(os.path.join(home, "lib", "modules"))]
    try:
        import pyspark

        jars = os.path.join(os.path.dirname(pyspark.__file__), "jars")
        # (The folder too: the JVM takes an archive only for the class path it was written for.)
        parts += [os.path.realpath(jars), pyspark.__version__, *sorted(os.listdir(jars))]
    except (ImportError, OSError):
        return None
    # (The JIT's options change no class: a JVM started for small work shares the archive.)
    parts += [f"{name}={_without_jit(conf.get(name, ''))}" for name in KEYED_SETTINGS]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def _without_jit(options: str) -> str:
    return " ".join(o for o in options.split() if not o.startswith("-XX:TieredStopAtLevel"))


def _java() -> str | None:
    home = os.environ.get("JAVA_HOME")
    found = os.path.join(home, "bin", "java") if home else shutil.which("java")
    return found if found and os.path.exists(found) else None


def _stamp(path: str) -> list[str]:
    try:
        status = os.stat(path)
    except OSError:
        return []
    return [str(status.st_size), str(int(status.st_mtime))]


@dataclass(frozen=True)
class ClassArchive:
    """The archive of one JVM's classes (:func:`for_jvm`)."""

    path: str

    @property
    def ready(self) -> bool:
        return os.path.isfile(self.path)

    @property
    def records(self) -> bool:
        """Whether a JVM started now records its classes for the archive: there is none, and
        an earlier command on this machine left the mark (:meth:`java_options`)."""
        return not self.ready and os.path.isfile(f"{self.path}.seen")

    def java_options(self) -> str:
        """The Java options that start a JVM with the archive, or that let it write one; none
        for the first command of this JVM on the machine, which leaves the mark instead."""
        if not self.ready and not self.records:
            with contextlib.suppress(OSError):
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                with open(f"{self.path}.seen", "a", encoding="utf-8"):
                    pass
            return ""
        if self.ready:
            # A JVM that cannot use the archive (another build) starts without it, silently; one
            # damaged since it was written makes HotSpot crash as it maps it, and its crash
            # report goes to the temporary folder, not the user's working folder.
            crash = os.path.join(tempfile.gettempdir(), "cdc_join-jvm-crash-%p.log")
            return (
                f"-XX:SharedArchiveFile={self.path} -Xshare:auto -Xlog:cds=off -Xlog:cds+dynamic=off "
                f"-XX:ErrorFile={crash}"
            )
        return "-XX:+RecordDynamicDumpInfo"

    def write(self, spark: Any) -> bool:
        """Write the archive of the classes the JVM of ``spark`` has loaded, unless another
        process is writing it or it exists; whether it was written."""
        if self.ready:
            return False
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
        except OSError as exc:  # a folder this user cannot write: no archive, and no error
            _log.info("no class archive written: %s", exc)
            return False
        with _locked(f"{self.path}.lock") as held:
            if not held or self.ready:
                return False
            unfinished = f"{self.path}.{os.getpid()}.part"
            try:
                _dump(spark, unfinished)
                os.replace(unfinished, self.path)
            except Exception as exc:  # the JVM could not write it: the next one starts without
                _log.info("no class archive written: %s", exc)
                with contextlib.suppress(OSError):
                    os.remove(unfinished)
                return False
        return True

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            os.remove(self.path)

    def write_at_exit(self, spark: Any) -> None:
        """Write the archive as this process ends, when every class its work needed is loaded."""
        if not self.ready:
            atexit.register(self.write, spark)


def for_jvm(conf: Mapping[str, str]) -> ClassArchive | None:
    """The archive for a JVM started with ``conf``; ``None`` when turned off or unknown, or
    where its folder's path has white space (at which Spark splits the Java options)."""
    where, found = folder(), key(conf)
    if where is None or found is None:
        return None
    if any(c.isspace() for c in where + tempfile.gettempdir()):
        return None  # Spark splits the Java options at white space
    _remove_stale(where)
    return ClassArchive(os.path.join(where, f"{found}.jsa"))


def _dump(spark: Any, path: str) -> None:
    """``VM.cds dynamic_dump path`` in the JVM of ``spark`` (started with
    ``-XX:+RecordDynamicDumpInfo``), through the platform's diagnostic command bean."""
    jvm, gateway = spark._jvm, spark.sparkContext._gateway
    lang = jvm.java.lang

    def array(kind: Any, *items: Any) -> Any:
        made = gateway.new_array(kind, len(items))
        for i, item in enumerate(items):
            made[i] = item
        return made

    server = jvm.java.lang.management.ManagementFactory.getPlatformMBeanServer()
    bean = jvm.javax.management.ObjectName("com.sun.management:type=DiagnosticCommand")
    # Called through the public interface's method: the server's own class is not exported.
    kinds = [lang.Class.forName(n) for n in ("javax.management.ObjectName", "java.lang.String")]
    kinds += [lang.Class.forName(n) for n in ("[Ljava.lang.Object;", "[Ljava.lang.String;")]
    invoke = lang.Class.forName("javax.management.MBeanServer").getMethod("invoke", array(lang.Class, *kinds))
    arguments = array(lang.String, "dynamic_dump", path)
    signature = array(lang.String, "[Ljava.lang.String;")
    invoke.invoke(server, array(lang.Object, bean, "vmCds", array(lang.Object, arguments), signature))
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        raise OSError(f"the JVM wrote no archive at {path}")


@contextlib.contextmanager
def _locked(path: str):  # type: ignore[no-untyped-def]
    """Whether this process holds the lock file ``path`` (created here, removed after)."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except OSError:  # another writer holds it, or the folder cannot be written
        yield False
        return
    os.close(fd)
    try:
        yield True
    finally:
        with contextlib.suppress(OSError):
            os.remove(path)


def _remove_stale(where: str) -> None:
    """Locks and unfinished archives of processes that died while writing (older than
    :data:`STALE_S`)."""
    try:
        names = os.listdir(where)
    except OSError:
        return
    now = time.time()
    for name in names:
        if name.endswith((".lock", ".part")):
            path = os.path.join(where, name)
            with contextlib.suppress(OSError):
                if now - os.path.getmtime(path) > STALE_S:
                    os.remove(path)
