"""Pipeline configuration: the pipeline YAML as frozen, validated dataclasses.

Everything that can be checked without reading data is checked here, so a wrong config fails
before any table is touched, with an error naming the file and the key.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cdc_join.errors import ConfigError, ConfigErrors, config_errors
from cdc_join.expressions import check_safe, code_of
from cdc_join.locations import has_scheme, is_table_name, local_path
from cdc_join.schemas import parse_type

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# `alias.column` references in a select expression, outside string literals.
_QUALIFIED = re.compile(r"(?<![\w.`])`?([A-Za-z_][A-Za-z0-9_]*)`?\s*\.\s*`?[A-Za-z_]")
# Lambda parameters of higher-order functions: `x -> x.a`, `(acc, x) -> acc + x.a`.
_LAMBDA_PARAMS = re.compile(r"(?:\(\s*([A-Za-z_][\w\s,]*)\)|\b([A-Za-z_]\w*))\s*->")

CONNECTORS = ("postgresql", "mysql", "mariadb", "sqlserver", "db2", "oracle")
#: What a run that quarantined events ends with: ``fail`` (exit code 3) or ``warn`` (exit 0).
ON_QUARANTINE = ("fail", "warn")


class JoinType(str, enum.Enum):
    """How a left row without a matching right row is treated; ``collect`` nests the right
    rows naming the left row (one-to-many) as an array instead."""

    INNER = "inner"
    LEFT = "left"
    COLLECT = "collect"


@dataclass(frozen=True)
class SourceConfig:
    """One captured table.

    Exactly one of ``landing`` (a folder of Debezium JSON-lines files) and ``bronze`` (an
    existing bronze Delta table written by another tool) is set. ``sequence_by`` lists the
    Debezium fields (dotted paths into the event, e.g. ``source.lsn``) whose values, compared
    in order, decide which event is newest; empty means "the connector's default"
    (see :mod:`cdc_join.landing.debezium`). ``columns`` optionally declares the row's columns and Spark
    SQL types, used until the source's first event arrives (see :mod:`cdc_join.landing.bronze`).
    """

    name: str
    primary_key: tuple[str, ...]
    sequence_by: tuple[str, ...] = ()
    landing: str | None = None
    bronze: str | None = None
    connector: str | None = None
    columns: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if (self.landing is None) == (self.bronze is None):
            raise ConfigError("give exactly one of 'landing' and 'bronze'", key=f"sources.{self.name}")
        if not self.primary_key:
            raise ConfigError("must name at least one column", key=f"sources.{self.name}.primary_key")


@dataclass(frozen=True)
class JoinConfig:
    """A foreign-key join from a source joined earlier (``source``, the config's ``from``) to
    ``right``: one hop of a chain, whose left side is ``source``.

    ``foreign_key`` lists columns of ``source`` matching the right primary key, in order.
    ``source`` is an alias: the left source (the default, left empty until the pipeline fills
    it in) or the alias of an earlier join. ``alias`` is the name select expressions use for
    the right side (defaults to the right source name), so one right table can be joined twice
    under two aliases.
    """

    right: str
    foreign_key: tuple[str, ...]
    type: JoinType = JoinType.INNER
    alias: str = ""
    source: str = ""
    max_children: int = 10_000
    """``collect``: a parent with more children than this fails the run (a data problem, not
    an array to build in one row)."""

    def __post_init__(self) -> None:
        if not self.alias:
            object.__setattr__(self, "alias", self.right)

    @property
    def collects(self) -> bool:
        """Whether the join nests its right rows (children) under the left row: then
        ``foreign_key`` lists columns of the children matching the left primary key."""
        return self.type is JoinType.COLLECT


@dataclass(frozen=True)
class PipelineConfig:
    """A whole pipeline: sources, one left source, its joins, the output projection."""

    name: str
    lake: str
    sources: Mapping[str, SourceConfig]
    left: str
    joins: tuple[JoinConfig, ...]
    select: tuple[tuple[str, str], ...]
    output: str
    config_path: Path | None = None
    quality: Mapping[str, Any] = field(default_factory=dict)
    tables: str | None = None
    on_quarantine: str = "fail"
    tombstone_horizon_days: float | None = None
    """Maintenance drops delete tombstones whose event is older than this (``None``: never)."""
    landing_lookback_hours: float | None = None
    """With a value, ingest lists only landing files modified after the newest ingest minus
    this many hours, so finding new files does not grow with every file ever landed."""
    silver_change_feed: bool = True
    """Whether silver keeps Delta's Change Data Feed, for jobs that read silver incrementally.
    Off, a MERGE into silver need not read the rows it replaces (their pre-images)."""

    # -- table locations ----------------------------------------------------------------------
    # With ``tables: catalog.schema`` every table is addressed by name in that schema
    # (delta-spark backend); otherwise by path under ``lake``.
    def bronze_path(self, source: str) -> str:
        src = self.sources[source]
        if src.bronze is not None:
            return src.bronze
        return f"{self.tables}.bronze_{source}" if self.tables else _join(self.lake, "bronze", source)

    @property
    def silver_path(self) -> str:
        return f"{self.tables}.{self.output}" if self.tables else _join(self.lake, "silver", self.output)

    @property
    def internal_root(self) -> str:
        """The folder (or, by name, the table-name prefix) of the pipeline's internal tables."""
        return (
            f"{self.tables}.cdc_join__{self.name}"
            if self.tables
            else _join(self.lake, "_cdc_join", self.name)
        )

    def _internal(self, *parts: str) -> str:
        if self.tables:
            return "__".join([self.internal_root, *parts])
        return _join(self.internal_root, *parts)

    def state_path(self, source: str) -> str:
        return self._internal("state", source)

    def subscription_path(self, join: JoinConfig) -> str:
        return self._internal("subscription", join.alias)

    @property
    def quarantine_path(self) -> str:
        return self._internal("quarantine")

    @property
    def ingest_log_path(self) -> str:
        return self._internal("ingest_log")

    @property
    def runs_path(self) -> str:
        """The run log; its newest row is also the checkpoint of what was processed."""
        return self._internal("runs")

    @property
    def quality_path(self) -> str:
        return self._internal("quality_results")

    @property
    def lock_path(self) -> str | None:
        """A local lock file, or None where tables live in a metastore, an object store or a
        FUSE mount of one (Databricks' ``/Volumes``, ``/dbfs``), where creating a file is not
        atomic and a lock left by a lost cluster could not be told from a live one."""
        if self.tables or has_scheme(self.lake) or self.lake.startswith(_SHARED_MOUNTS):
            return None
        return _join(self.lake, "_cdc_join", self.name, "_lock")

    def __post_init__(self) -> None:
        # A join without ``from`` hangs off the left source.
        joins = tuple(j if j.source else dataclasses.replace(j, source=self.left) for j in self.joins)
        object.__setattr__(self, "joins", joins)

    @property
    def left_source(self) -> SourceConfig:
        return self.sources[self.left]

    def source_of(self, alias: str) -> str:
        """The source an alias reads: the left source's name, or a join's right source."""
        return self.left if alias == self.left else self.join_for_alias(alias).right

    def hop_left(self, join: JoinConfig) -> SourceConfig:
        """The source on the left side of one hop: the one whose rows hold its foreign key
        (for ``collect``, the children)."""
        return self.sources[join.right if join.collects else self.source_of(join.source)]

    @property
    def hop_sources(self) -> tuple[str, ...]:
        """Sources on the left side of some hop (the left source first): a change of one of
        them moves that hop's subscriptions, so its state keeps the rows it replaces."""
        return tuple(dict.fromkeys([self.left, *(self.hop_left(j).name for j in self.joins)]))

    def hops_from(self, alias: str) -> tuple[JoinConfig, ...]:
        """The joins whose foreign key is a column of ``alias``'s rows."""
        return tuple(j for j in self.joins if j.source == alias)

    @property
    def chained(self) -> bool:
        """Whether some join's foreign key is a column of a joined source, not of the left."""
        return any(j.source != self.left for j in self.joins)

    def join_for_alias(self, alias: str) -> JoinConfig:
        for j in self.joins:
            if j.alias == alias:
                return j
        raise KeyError(alias)

    @property
    def right_sources(self) -> tuple[str, ...]:
        """Right source names, each once, in join order."""
        return tuple(dict.fromkeys(j.right for j in self.joins))


def _join(root: str, *parts: str) -> str:
    return "/".join([root.rstrip("/"), *parts])


_SHARED_MOUNTS = ("/Volumes/", "/dbfs/", "/Workspace/")


# -- loading ---------------------------------------------------------------------------------


def _check_unique_keys(node: yaml.Node | None, key: str = "", done: set[int] | None = None) -> None:
    """Reject duplicate mapping keys (YAML would keep the last one), naming the dotted key."""
    done = set() if done is None else done
    if node is None or id(node) in done:  # an anchor's node is checked once
        return
    done.add(id(node))
    if isinstance(node, yaml.MappingNode):
        seen: set[tuple[str, str]] = set()
        for key_node, value_node in node.value:
            name = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else "?"
            child = f"{key}.{name}" if key else name
            if isinstance(key_node, yaml.ScalarNode):
                if (key_node.tag, key_node.value) in seen:
                    raise ConfigError(
                        f"duplicate key {name!r} (line {key_node.start_mark.line + 1})", key=child
                    )
                seen.add((key_node.tag, key_node.value))
            _check_unique_keys(value_node, child, done)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_unique_keys(item, f"{key}[{i}]", done)


def load_config(
    path: str | os.PathLike[str],
    *,
    check_paths: bool = True,
    lake: str | None = None,
    tables: str | None = None,
) -> PipelineConfig:
    """Read and validate a pipeline YAML file.

    Args:
        path: the YAML file. Relative paths inside it resolve against its folder.
        check_paths: whether local landing folders must exist.
        lake: a lake that replaces the file's ``lake`` and ``tables`` (tables are then
            addressed by path under it); the file then needs neither (the CLI's ``--lake``).
        tables: a ``catalog.schema`` that replaces the file's ``tables`` (``--tables``).

    Returns:
        The validated configuration.

    Raises:
        ConfigError: naming the file and the offending key.
    """
    cfg_path = Path(path)
    try:
        text = cfg_path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config: {e.strerror}", path=cfg_path) from e
    try:
        _check_unique_keys(yaml.compose(text, Loader=yaml.SafeLoader))
        raw = yaml.safe_load(text)
    except ConfigError as e:
        raise ConfigError(e.message, key=e.key, path=cfg_path) from None
    except yaml.YAMLError as e:
        raise ConfigError(f"not valid YAML: {e}", path=cfg_path) from e
    try:
        return parse_config(
            raw,
            base_dir=cfg_path.parent,
            check_paths=check_paths,
            config_path=cfg_path,
            lake=lake,
            tables=tables,
        )
    except ConfigErrors as e:
        raise ConfigErrors(e.problems, path=cfg_path) from None
    except ConfigError as e:
        if e.path is None:
            raise ConfigError(e.message, key=e.key, path=cfg_path) from None
        raise


_TOP_KEYS = {
    "name",
    "lake",
    "tables",
    "sources",
    "left",
    "joins",
    "select",
    "output",
    "quality",
    "on_quarantine",
    "tombstone_horizon_days",
    "landing_lookback_hours",
    "silver_change_feed",
}
_TOP_KEYS |= {"description"}
_SCHEMA_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?$")
_SOURCE_KEYS = {"landing", "bronze", "primary_key", "sequence_by", "connector", "columns"}
_JOIN_KEYS = {"right", "foreign_key", "type", "as", "from", "max_children"}


ANY = "*"  # stands for every source name when the sources section itself is wrong


class Problems:
    """The config errors found so far. Each check runs on its own (:meth:`value`), so one
    mistake does not hide the others: a user fixes every one of them in one edit."""

    def __init__(self) -> None:
        self.found: list[ConfigError] = []

    def value(self, check: Callable[[], Any], default: Any = None) -> Any:
        """``check()``'s result, or ``default`` after recording the ConfigError it raised."""
        try:
            return check()
        except ConfigError as e:
            self.found.append(e)
            return default

    def unknown_keys(self, raw: Mapping[str, Any], allowed: set[str], parent: str) -> None:
        """Record every key of ``raw`` that is not ``allowed``."""
        for k in raw:
            if k not in allowed:
                self.found.append(
                    ConfigError(
                        f"unknown key; expected one of {sorted(allowed)}",
                        key=f"{parent}.{k}" if parent else str(k),
                    )
                )

    def raise_found(self, path: object = None) -> None:
        if self.found:
            raise config_errors(self.found, path)


def parse_config(
    raw: Any,
    *,
    base_dir: Path | None = None,
    check_paths: bool = True,
    config_path: Path | None = None,
    lake: str | None = None,
    tables: str | None = None,
) -> PipelineConfig:
    """Validate an already-parsed YAML document (see :func:`load_config`, also for ``lake``
    and ``tables``).

    Raises:
        ConfigError: one mistake; :class:`~cdc_join.errors.ConfigErrors` holds every one when
            there are several.
    """
    base = base_dir or Path.cwd()
    if not isinstance(raw, Mapping):
        raise ConfigError("the config must be a mapping of keys to values")
    p = Problems()
    p.unknown_keys(raw, _TOP_KEYS, "")
    name = p.value(lambda: _name(_required(raw, "name", ""), "name"))
    in_file = p.value(lambda: parse_tables(raw.get("tables")))
    overridden = lake is not None or tables is not None
    lake_path = p.value(lambda: _lake(raw, in_file, base, required=not overridden), "")
    if lake is not None:  # given lake replaces both: every table by path under it
        lake_path, in_file = lake.rstrip("/"), None
    given = tables
    tables = in_file if given is None else p.value(lambda: parse_tables(given))
    sources, broken = _sources(raw.get("sources"), base, check_paths, p)
    left = p.value(lambda: _left(raw, sources, broken))
    joins, joins_broken = _joins(raw.get("joins") or [], sources, broken, left, p)
    if left is not None and not broken and not joins_broken:
        p.value(lambda: _all_joined(sources, left, joins))
    # With the left source or a join in error, which aliases exist is unknown: the select
    # list's references are then not checked, rather than blamed for the other mistake.
    aliases = None if left is None or broken or joins_broken else {left, *(j.alias for j in joins)}
    select = p.value(lambda: _select(_required(raw, "select", ""), aliases, p), ())
    output = p.value(lambda: _name(_required(raw, "output", ""), "output"))
    quality, on_quarantine = _quality(raw, p), _on_quarantine(raw, p)
    horizon = p.value(lambda: _positive(raw, "tombstone_horizon_days", "days", float("inf")))
    lookback = p.value(lambda: _positive(raw, "landing_lookback_hours", "hours", 1e6))
    change_feed = p.value(lambda: _flag(raw, "silver_change_feed", default=True), True)
    p.raise_found()
    return PipelineConfig(
        name=name,
        lake=lake_path,
        sources=sources,
        left=left,
        joins=joins,
        select=select,
        output=output,
        config_path=config_path,
        quality=dict(quality),
        tables=tables,
        on_quarantine=on_quarantine,
        tombstone_horizon_days=horizon,
        landing_lookback_hours=lookback,
        silver_change_feed=change_feed,
    )


def _quality(raw: Mapping[str, Any], p: Problems) -> Mapping[str, Any]:
    """The ``quality:`` section as given (:mod:`cdc_join.checks.quality_config` reads it)."""
    quality = raw.get("quality") or {}
    if not isinstance(quality, Mapping):
        p.found.append(ConfigError("must be a mapping", key="quality"))
        return {}
    return quality


def _on_quarantine(raw: Mapping[str, Any], p: Problems) -> str:
    on_quarantine = raw.get("on_quarantine", "fail")
    if on_quarantine not in ON_QUARANTINE:
        p.found.append(
            ConfigError(f"must be one of {list(ON_QUARANTINE)}, got {on_quarantine!r}", key="on_quarantine")
        )
    return str(on_quarantine)


def _lake(raw: Mapping[str, Any], tables: str | None, base: Path, *, required: bool = True) -> str:
    if raw.get("lake") is None:
        if required and tables is None and raw.get("tables") is None:
            raise ConfigError(
                "is required (or 'tables: catalog.schema' to address tables by name)", key="lake"
            )
        return ""
    return _resolve(_string(raw["lake"], "lake"), base)


def _left(raw: Mapping[str, Any], sources: Mapping[str, SourceConfig], broken: set[str]) -> str | None:
    left = _string(_required(raw, "left", ""), "left")
    if left in broken or ANY in broken:
        return None  # its own error is recorded already
    if left not in sources:
        raise ConfigError(f"unknown source {left!r}; sources are {sorted(set(sources) | broken)}", key="left")
    return left


def _all_joined(sources: Mapping[str, SourceConfig], left: str, joins: tuple[JoinConfig, ...]) -> None:
    unused = [name for name in sources if name != left and name not in {j.right for j in joins}]
    if unused:
        raise ConfigError(
            f"source {unused[0]!r} is not joined: name it as 'left' or as a join's 'right', or remove it",
            key=f"sources.{unused[0]}",
        )


def _positive(raw: Mapping[str, Any], key: str, unit: str, below: float) -> float | None:
    """An optional positive number under ``below`` (``None`` when absent)."""
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < below:
        raise ConfigError(f"must be a positive number of {unit}, got {value!r}", key=key)
    return float(value)


def _flag(raw: Mapping[str, Any], key: str, *, default: bool) -> bool:
    """An optional ``true`` / ``false`` (YAML booleans only: a string ``"no"`` is a mistake)."""
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"must be true or false, got {value!r}", key=key)
    return value


def parse_tables(value: Any) -> str | None:
    """A ``tables:`` value (``catalog.schema`` or ``schema``), checked; ``None`` when absent."""
    if value is None:
        return None
    text = _string(value, "tables")
    if not _SCHEMA_NAME.match(text):
        raise ConfigError(f"must be 'catalog.schema' or 'schema', got {text!r}", key="tables")
    return text


def _sources(
    raw: Any, base: Path, check_paths: bool, p: Problems
) -> tuple[dict[str, SourceConfig], set[str]]:
    """The valid sources, and the names of those that are not (their errors recorded in ``p``;
    :data:`ANY` when the section itself is wrong, so that any name may be one of them)."""
    if raw is None:
        p.found.append(ConfigError("is required", key="sources"))
        return {}, {ANY}
    if not isinstance(raw, Mapping) or not raw:
        p.found.append(ConfigError("must be a non-empty mapping of source name to settings", key="sources"))
        return {}, {ANY}
    out, broken = {}, set()
    for name, spec in raw.items():
        errors = len(p.found)
        source = p.value(lambda name=name, spec=spec: _source(name, spec, base, check_paths, p))
        if source is None or len(p.found) > errors:
            broken.add(str(name))
        else:
            out[str(name)] = source
    return out, broken


def _source(name: Any, spec: Any, base: Path, check_paths: bool, p: Problems) -> SourceConfig | None:
    key = f"sources.{name}"
    _name(name, key)
    if not isinstance(spec, Mapping):
        raise ConfigError("must be a mapping", key=key)
    errors = len(p.found)
    p.unknown_keys(spec, _SOURCE_KEYS, key)
    landing = p.value(lambda: _landing(spec.get("landing"), key, base, check_paths))
    bronze = p.value(lambda: _bronze(spec.get("bronze"), key, base))
    connector = spec.get("connector")
    if connector is not None and connector not in CONNECTORS:
        p.found.append(
            ConfigError(f"must be one of {list(CONNECTORS)}, got {connector!r}", key=f"{key}.connector")
        )
    sequence_by = p.value(
        lambda: (
            _columns(spec["sequence_by"], f"{key}.sequence_by", dotted=True)
            if spec.get("sequence_by") is not None
            else ()
        ),
        (),
    )
    primary_key = _columns(_required(spec, "primary_key", key), f"{key}.primary_key")
    columns = _declared_columns(spec.get("columns"), primary_key, f"{key}.columns")
    if len(p.found) > errors:
        return None
    return SourceConfig(
        name=str(name),
        primary_key=primary_key,
        sequence_by=sequence_by,
        landing=landing,
        bronze=bronze,
        connector=connector,
        columns=columns,
    )


def _landing(value: Any, key: str, base: Path, check_paths: bool) -> str | None:
    if value is None:
        return None
    landing = _resolve(_string(value, f"{key}.landing"), base)
    local = local_path(landing)
    if check_paths and local is not None and not Path(local).is_dir():
        raise ConfigError(f"landing folder {landing} does not exist", key=f"{key}.landing")
    return landing


def _bronze(value: Any, key: str, base: Path) -> str | None:
    if value is None:
        return None
    bronze = _string(value, f"{key}.bronze")
    return bronze if is_table_name(bronze) else _resolve(bronze, base)


def _declared_columns(raw: Any, primary_key: tuple[str, ...], key: str) -> tuple[tuple[str, str], ...]:
    """``columns: {name: type, ...}``, each type checked (Spark SQL type names)."""
    if raw is None:
        return ()
    if not isinstance(raw, Mapping) or not raw:
        raise ConfigError("must be a mapping of column name to Spark SQL type, e.g. {id: bigint}", key=key)
    out = []
    for column, text in raw.items():
        _name(column, f"{key}.{column}")
        try:
            parse_type(_string(text, f"{key}.{column}"))
        except ValueError as e:
            raise ConfigError(str(e), key=f"{key}.{column}") from None
        out.append((str(column), str(text).strip()))
    missing = [c for c in primary_key if c not in dict(out)]
    if missing:
        raise ConfigError(f"must declare the primary key column(s) {missing}", key=key)
    return tuple(out)


def _joins(
    raw: Any, sources: Mapping[str, SourceConfig], broken: set[str], left: str | None, p: Problems
) -> tuple[tuple[JoinConfig, ...], set[str]]:
    """The valid joins, and the aliases of those that are not (their errors recorded in ``p``)."""
    if not isinstance(raw, list):
        p.found.append(ConfigError("must be a list of joins", key="joins"))
        return (), {"?"}
    joins, failed = [], set()
    for i, spec in enumerate(raw):
        earlier = list(joins)
        join = p.value(
            lambda i=i, spec=spec, earlier=earlier: _one_join(
                spec, f"joins[{i}]", sources, broken, left, earlier, p
            )
        )
        if join is None:
            failed.add(str(spec.get("as") or spec.get("right")) if isinstance(spec, Mapping) else "?")
            continue
        if join.alias in {j.alias for j in joins} or join.alias == left:
            p.found.append(
                ConfigError(
                    f"alias {join.alias!r} is used twice; give each join of {join.right!r} its own 'as'",
                    key=f"joins[{i}]",
                )
            )
            failed.add(join.alias)
            continue
        joins.append(join)
    return tuple(joins), failed


def _one_join(
    spec: Any,
    key: str,
    sources: Mapping[str, SourceConfig],
    broken: set[str],
    left: str | None,
    earlier: list[JoinConfig],
    p: Problems,
) -> JoinConfig | None:
    if not isinstance(spec, Mapping):
        raise ConfigError("must be a mapping", key=key)
    errors = len(p.found)
    p.unknown_keys(spec, _JOIN_KEYS, key)
    right = p.value(lambda: _right(spec, key, sources, broken, left))
    fk = p.value(lambda: _columns(_required(spec, "foreign_key", key), f"{key}.foreign_key"))
    type_text = spec.get("type", "inner")
    join_type = p.value(lambda: _join_type(type_text, key))
    # A collect join's foreign key is the children's, matching the parent's (left) key.
    keyed = left if join_type is JoinType.COLLECT else right
    if keyed in sources and fk is not None and len(fk) != len(sources[keyed].primary_key):
        keyed_pk = sources[keyed].primary_key
        p.found.append(
            ConfigError(
                f"has {len(fk)} column(s) but {keyed!r} has a primary key of "
                f"{len(keyed_pk)}: {list(keyed_pk)}",
                key=f"{key}.foreign_key",
            )
        )
    alias = p.value(lambda: _name(spec["as"], f"{key}.as")) if "as" in spec else right
    source = p.value(lambda: _from(spec, key, earlier, left)) if "from" in spec else left
    if join_type is JoinType.COLLECT and source != left:
        p.found.append(
            ConfigError("a collect join nests children under the left source only", key=f"{key}.from")
        )
    cap = p.value(lambda: _max_children(spec, join_type, key))
    if len(p.found) > errors or right is None or source is None:
        return None
    return JoinConfig(
        right=right, foreign_key=fk, type=join_type, alias=alias, source=source, max_children=cap
    )


def _max_children(spec: Mapping[str, Any], join_type: JoinType | None, key: str) -> int:
    if "max_children" not in spec:
        return JoinConfig.max_children
    if join_type is not JoinType.COLLECT:
        raise ConfigError("applies to a collect join only", key=f"{key}.max_children")
    value = spec["max_children"]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"must be a whole number of at least 1, not {value!r}", key=f"{key}.max_children")
    return value


def _from(spec: Mapping[str, Any], key: str, earlier: list[JoinConfig], left: str | None) -> str | None:
    """A join's ``from``: the left source or the alias of a join listed before it (not a
    collect join's: its alias names an array)."""
    name = _string(spec["from"], f"{key}.from")
    collected = [j.alias for j in earlier if j.collects]
    if name in collected:
        raise ConfigError(
            f"{name!r} is a collect join (an array of rows): no join can hang off it", key=f"{key}.from"
        )
    if left is None or name == left or name in [j.alias for j in earlier]:
        return name
    known = [left, *(j.alias for j in earlier if not j.collects)]
    raise ConfigError(
        f"{name!r} is not joined before this join; 'from' names the left source or an earlier "
        f"join's alias: {', '.join(map(repr, known))}",
        key=f"{key}.from",
    )


def _right(
    spec: Mapping[str, Any], key: str, sources: Mapping[str, SourceConfig], broken: set[str], left: str | None
) -> str | None:
    right = _string(_required(spec, "right", key), f"{key}.right")
    if right in broken or ANY in broken:
        return None  # its own error is recorded already
    if right not in sources:
        raise ConfigError(
            f"unknown source {right!r}; sources are {sorted(set(sources) | broken)}", key=f"{key}.right"
        )
    if right == left:
        raise ConfigError("a source cannot be joined to itself", key=f"{key}.right")
    return right


def _join_type(text: Any, key: str) -> JoinType:
    try:
        return JoinType(str(text).lower())
    except ValueError:
        raise ConfigError(f"must be 'inner', 'left' or 'collect', got {text!r}", key=f"{key}.type") from None


def _select(raw: Any, aliases: set[str] | None, p: Problems) -> tuple[tuple[str, str], ...]:
    if not isinstance(raw, Mapping) or not raw:
        raise ConfigError("must be a non-empty mapping of output column to SQL expression", key="select")
    out = []
    lowered: dict[str, str] = {}
    for column, expr in raw.items():
        key = f"select.{column}"
        entry = p.value(
            lambda column=column, expr=expr, key=key: _select_entry(column, expr, key, aliases, lowered)
        )
        if entry is not None:
            out.append(entry)
    return tuple(out)


def _select_entry(
    column: Any, expr: Any, key: str, aliases: set[str] | None, lowered: dict[str, str]
) -> tuple[str, str]:
    _name(column, key)
    if str(column).startswith("_"):
        raise ConfigError("output column names starting with '_' are reserved for metadata", key=key)
    if str(column).lower() in lowered:
        raise ConfigError(f"duplicate output column (also {lowered[str(column).lower()]!r})", key=key)
    lowered[str(column).lower()] = str(column)
    text = _string(expr, key)
    code = code_of(check_safe(text, key))
    params = {p.strip() for m in _LAMBDA_PARAMS.findall(code) for p in ",".join(m).split(",")}
    unknown = sorted(set(_QUALIFIED.findall(code)) - (aliases or set()) - params)
    if unknown and aliases is not None:
        raise ConfigError(f"refers to unknown source alias(es) {unknown}; known: {sorted(aliases)}", key=key)
    return str(column), text


def _required(raw: Mapping[str, Any], name: str, parent: str) -> Any:
    if raw.get(name) is None:
        raise ConfigError("is required", key=f"{parent}.{name}" if parent else name)
    return raw[name]


def _string(value: Any, key: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"must be a non-empty string, got {value!r}", key=key)
    return value.strip()


def _name(value: Any, key: str) -> str:
    text = _string(value, key)
    if not _NAME.match(text):
        raise ConfigError(f"{text!r} is not a valid name (letters, digits, _)", key=key)
    return text


def _columns(value: Any, key: str, *, dotted: bool = False) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items:
        raise ConfigError("must be a column name or a non-empty list of them", key=key)
    out = []
    for i, item in enumerate(items):
        text = _string(item, f"{key}[{i}]")
        parts = text.split(".") if dotted else [text]
        if not all(_NAME.match(p) for p in parts):
            raise ConfigError(f"{text!r} is not a valid column name", key=f"{key}[{i}]")
        out.append(text)
    if len(set(out)) != len(out):
        raise ConfigError(f"lists a column twice: {out}", key=key)
    return tuple(out)


def _resolve(text: str, base: Path) -> str:
    if has_scheme(text) or os.path.isabs(text):
        return text
    return str((base / text).resolve())


def check_addressing(config: PipelineConfig, backend: str) -> None:
    """Tables by name need the delta-spark backend: on delta-rs that is a mistake in the config
    (exit 2), said before anything is read, not a storage failure in the first write."""
    if backend != "delta-rs":
        return
    hint = "give 'lake:' (or --lake DIR) to address the tables by path, or use the delta-spark backend"
    if config.tables:
        raise ConfigError(
            f"{config.tables!r} addresses tables by name, which the delta-rs backend cannot; {hint}",
            key="tables",
            path=config.config_path,
        )
    for name, source in config.sources.items():
        if source.bronze is not None and is_table_name(source.bronze):
            raise ConfigError(
                f"{source.bronze!r} names a table, which the delta-rs backend cannot address; {hint}",
                key=f"sources.{name}.bronze",
                path=config.config_path,
            )
