"""The Delta Lake jars a local Spark session loads for the delta-spark backend.

Databricks and clusters started with Delta have the jars already. A session started here gets
them the way Delta's own ``configure_spark_with_delta_pip`` does, through ``spark.jars.packages``:
Spark resolves the Maven artifact (and what it depends on) at start-up and keeps it in its Ivy
cache, so only the first start on a machine downloads anything (about 90 MB).

- **The artifact** carries the Spark version since Delta 4.1:
  ``io.delta:delta-spark_<spark major.minor>_2.13:<delta-spark version>``, from the installed
  ``pyspark`` and ``delta-spark`` packages (the project pins a ``delta-spark`` whose jar exists
  for the pinned ``pyspark``).
- **Resolution fails fast.** Spark's default Ivy settings also read ``~/.m2``, where a pom
  without its jar (left by an earlier Maven run) makes resolution fail, and they wait on a
  registry that does not answer for as long as the connection allows. The session is given
  settings of its own instead (:func:`ivy_settings`): Spark's Ivy cache, then Maven Central
  (or the mirror in ``CDC_JOIN_MAVEN_REPOSITORY``), with connection and read timeouts. A
  session that cannot get the jars stops with :class:`~cdc_join.errors.StorageError` naming
  ``--storage delta-rs``, which needs no jars.
- **Resolved once, then read from the cache.** Once a session started with the jars, the list of
  jars Ivy resolved is kept beside the cache (:func:`remember`), and later sessions get them as
  ``spark.jars`` from there: no Ivy resolution, no repository asked, so a start without network
  works, and processes starting at once never write Ivy's cache together (Ivy's cache is not
  safe for that: concurrent ``--packages`` resolutions fail on each other's files). The first
  resolution on a machine is serialized by a lock file (:func:`resolution_lock`): a process
  that waited for another one's resolution then takes its list.
- Settings the caller or ``spark-defaults.conf`` gives (``spark.jars.packages``,
  ``spark.jars.ivySettings``, ``spark.jars.repositories``) win over these.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse
from xml.sax.saxutils import quoteattr

#: Delta's SQL extension and catalog: MERGE, OPTIMIZE and SQL on ``delta.`path``` need them.
DELTA_CONF = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
}
#: A Maven repository (mirror) to resolve the jars from instead of Maven Central.
REPOSITORY_ENV = "CDC_JOIN_MAVEN_REPOSITORY"
SCALA_VERSION = "2.13"
#: Milliseconds Ivy waits for a connection, and for data on one.
CONNECT_TIMEOUT_MS = 15_000
READ_TIMEOUT_MS = 60_000


def delta_package() -> str:
    """The Maven coordinate of the Delta jar for the installed pyspark and delta-spark."""
    import pyspark

    spark_minor = ".".join(pyspark.__version__.split(".")[:2])
    try:
        delta = metadata.version("delta-spark")
    except metadata.PackageNotFoundError as exc:
        from cdc_join.errors import StorageError

        raise StorageError(
            "the delta-spark storage backend needs the delta-spark package "
            "(pip install 'cdc_join[spark]'); or use --storage delta-rs"
        ) from exc
    return f"io.delta:delta-spark_{spark_minor}_{SCALA_VERSION}:{delta}"


def cache_dir() -> Path:
    """Where Spark's Ivy keeps resolved jars (Spark's own default, ``~/.ivy2.5.2``)."""
    return Path.home() / ".ivy2.5.2"


def ivy_settings(repository: str | None = None) -> str:
    """Ivy settings text: the local Ivy cache, then one Maven repository, with timeouts.

    Args:
        repository: a Maven repository root; ``None`` means Ivy's default (Maven Central).
    """
    root = "" if not repository else f" root={quoteattr(repository.rstrip('/') + '/')}"
    cache = quoteattr(str(cache_dir() / "cache"))
    return f"""<ivysettings>
  <settings defaultResolver="cdc_join"/>
  <caches defaultCacheDir={cache}/>
  <timeout-constraints>
    <timeout-constraint name="fail-fast"
      connectionTimeout="{CONNECT_TIMEOUT_MS}" readTimeout="{READ_TIMEOUT_MS}"/>
  </timeout-constraints>
  <resolvers>
    <chain name="cdc_join" returnFirst="true">
      <ibiblio name="maven" m2compatible="true" usepoms="true" timeoutConstraint="fail-fast"{root}/>
    </chain>
  </resolvers>
</ivysettings>
"""


def session_conf(given: dict[str, str]) -> dict[str, str]:
    """What a local session needs for Delta, beyond ``given`` (the settings it has already): the
    jars already resolved (:func:`cached_jars`) as ``spark.jars``, else the Maven coordinate to
    resolve (``spark.jars.packages``, see :func:`resolves`)."""
    conf = {k: v for k, v in DELTA_CONF.items() if k not in given}
    if "spark.jars.packages" in given:
        return conf
    package = delta_package()
    jars = cached_jars(package)
    if jars is not None:
        conf["spark.jars"] = ",".join([*filter(None, given.get("spark.jars", "").split(",")), *jars])
        return conf
    conf["spark.jars.packages"] = package
    if "spark.jars.ivySettings" not in given and "spark.jars.repositories" not in given:
        conf["spark.jars.ivySettings"] = str(_write_settings(os.environ.get(REPOSITORY_ENV) or None))
        conf["spark.jars.ivy"] = str(cache_dir())
    return conf


def resolves(given: dict[str, str], conf: dict[str, str]) -> bool:
    """Whether a session started with ``conf`` resolves the Delta jars through Ivy for this
    module (the caller did not ask for packages of its own)."""
    return "spark.jars.packages" not in given and conf.get("spark.jars.packages") == delta_package()


def _manifest(package: str) -> Path:
    return cache_dir() / f"cdc_join-jars-{re.sub(r'[^A-Za-z0-9_.-]', '_', package)}.txt"


def cached_jars(package: str) -> list[str] | None:
    """The jars a session resolved for ``package`` before, when every one is still in the cache;
    ``None`` otherwise (then the session resolves them)."""
    try:
        listed = [line for line in _manifest(package).read_text().splitlines() if line.strip()]
    except OSError:
        return None
    if not listed or not all(os.path.isfile(jar) for jar in listed):
        return None
    return listed


def remember(package: str, resolved: str) -> list[str]:
    """Keep the jars a session got for ``package`` (its ``spark.jars``: comma-separated
    ``file:`` URIs or paths) that lie in the Ivy cache; returns them."""
    jars = []
    cache = str(cache_dir())
    for item in filter(None, (s.strip() for s in resolved.split(","))):
        parsed = urlparse(item)
        path = unquote(parsed.path) if parsed.scheme == "file" else item
        if path.startswith(cache) and path.endswith(".jar") and os.path.isfile(path):
            jars.append(path)
    if any(os.path.basename(j).startswith("io.delta_delta-spark") for j in jars):
        manifest = _manifest(package)
        temporary = manifest.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text("".join(f"{jar}\n" for jar in jars))
        os.replace(temporary, manifest)
    return jars


@contextlib.contextmanager
def resolution_lock() -> Iterator[None]:
    """Hold the machine's lock on resolving jars into the Ivy cache (a file lock, released when
    the process ends however it ends); where the OS has no ``fcntl``, nothing is held."""
    try:
        import fcntl
    except ImportError:  # Windows: no POSIX file locks
        yield
        return
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "cdc_join-resolve.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _write_settings(repository: str | None) -> Path:
    """The settings file, written where each user's cache is (rewritten only when it changes)."""
    text = ivy_settings(repository)
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / ("cdc_join-ivysettings.xml" if repository is None else "cdc_join-ivysettings-mirror.xml")
    if not path.exists() or path.read_text() != text:
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(text)
        os.replace(temporary, path)
    return path


def failure_hint(package: str, log: str | None) -> str:
    """The one line a session start that could not get the jars ends with."""
    where = f" (Spark's output: {log})" if log else ""
    return (
        f"Spark could not start with Delta Lake: resolving {package} failed{where}. "
        f"Use --storage delta-rs (no jars needed), or make the artifact reachable "
        f"({REPOSITORY_ENV}=<Maven mirror URL>)"
    )
