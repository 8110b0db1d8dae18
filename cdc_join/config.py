"""Pipeline configuration: the YAML of DESIGN.md §4 as frozen, validated dataclasses.

Everything that can be checked without reading data is checked here, so a wrong config fails
before any table is touched, with an error naming the file and the key.
"""

from __future__ import annotations

import enum
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cdc_join.errors import ConfigError
from cdc_join.schemas import parse_type
from cdc_join.storage.base import is_table_name

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# `alias.column` references in a select expression, outside string literals.
_QUALIFIED = re.compile(r"(?<![\w.`])`?([A-Za-z_][A-Za-z0-9_]*)`?\s*\.\s*`?[A-Za-z_]")
_STRING_LITERAL = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"")
# Lambda parameters of higher-order functions: `x -> x.a`, `(acc, x) -> acc + x.a`.
#: Functions a select expression may not call: they run JVM code (reflect, java_method), read
#: secrets, files or remote services with the job's privileges, or cost money per call.
FORBIDDEN_FUNCTIONS = (
    "reflect",
    "try_reflect",
    "java_method",
    "secret",
    "try_secret",
    "http_request",
    "read_files",
    "read_kafka",
    "ai_query",
)
_FORBIDDEN_CALL = re.compile(rf"(?i)\b({'|'.join(FORBIDDEN_FUNCTIONS)})\s*\(")
_SUBQUERY = re.compile(r"(?i)\bselect\b")
_LAMBDA_PARAMS = re.compile(r"(?:\(\s*([A-Za-z_][\w\s,]*)\)|\b([A-Za-z_]\w*))\s*->")

CONNECTORS = ("postgresql", "mysql", "sqlserver")
#: What a run that quarantined events ends with: ``fail`` (exit code 3) or ``warn`` (exit 0).
ON_QUARANTINE = ("fail", "warn")


class JoinType(str, enum.Enum):
    """How a left row without a matching right row is treated (DESIGN.md §2)."""

    INNER = "inner"
    LEFT = "left"


@dataclass(frozen=True)
class SourceConfig:
    """One captured table.

    Exactly one of ``landing`` (a folder of Debezium JSON-lines files) and ``bronze`` (an
    existing bronze Delta table written by another tool) is set. ``sequence_by`` lists the
    Debezium fields (dotted paths into the event, e.g. ``source.lsn``) whose values, compared
    in order, decide which event is newest; empty means "the connector's default"
    (see :mod:`cdc_join.debezium`). ``columns`` optionally declares the row's columns and Spark
    SQL types, used until the source's first event arrives (see :mod:`cdc_join.bronze`).
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
    """A foreign-key join from the left source to ``right``.

    ``foreign_key`` lists left columns matching the right primary key, in order. ``alias`` is
    the name select expressions use for the right side (defaults to the right source name), so
    one right table can be joined twice under two aliases.
    """

    right: str
    foreign_key: tuple[str, ...]
    type: JoinType = JoinType.INNER
    alias: str = ""

    def __post_init__(self) -> None:
        if not self.alias:
            object.__setattr__(self, "alias", self.right)


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
    landing_lookback_hours: float | None = None
    """With a value, ingest lists only landing files modified after the newest ingest minus
    this many hours, so finding new files does not grow with every file ever landed."""
    """Maintenance drops delete tombstones whose event is older than this (``None``: never)."""

    # -- table locations (DESIGN.md §4) ------------------------------------------------------
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
        """A local lock file, or None where tables live in a metastore or an object store."""
        if self.tables or _is_uri(self.lake):
            return None
        return _join(self.lake, "_cdc_join", self.name, "_lock")

    @property
    def left_source(self) -> SourceConfig:
        return self.sources[self.left]

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


def _is_uri(text: str) -> bool:
    return "://" in text or text.startswith("dbfs:")


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


def load_config(path: str | os.PathLike[str], *, check_paths: bool = True) -> PipelineConfig:
    """Read and validate a pipeline YAML file.

    Args:
        path: the YAML file. Relative paths inside it resolve against its folder.
        check_paths: whether local landing folders must exist.

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
        raise ConfigError(_bare_message(e), key=e.key, path=cfg_path) from None
    except yaml.YAMLError as e:
        raise ConfigError(f"not valid YAML: {e}", path=cfg_path) from e
    try:
        return parse_config(raw, base_dir=cfg_path.parent, check_paths=check_paths, config_path=cfg_path)
    except ConfigError as e:
        if e.path is None:
            raise ConfigError(_bare_message(e), key=e.key, path=cfg_path) from None
        raise


def _bare_message(e: ConfigError) -> str:
    text = str(e)
    return text[len(e.key) + 2 :] if e.key and text.startswith(f"{e.key}: ") else text


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
}
_TOP_KEYS |= {"description"}
_SCHEMA_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?$")
_SOURCE_KEYS = {"landing", "bronze", "primary_key", "sequence_by", "connector", "columns"}
_JOIN_KEYS = {"right", "foreign_key", "type", "as"}


def parse_config(
    raw: Any,
    *,
    base_dir: Path | None = None,
    check_paths: bool = True,
    config_path: Path | None = None,
) -> PipelineConfig:
    """Validate an already-parsed YAML document (see :func:`load_config`)."""
    base = base_dir or Path.cwd()
    if not isinstance(raw, Mapping):
        raise ConfigError("the config must be a mapping of keys to values")
    _no_unknown(raw, _TOP_KEYS, "")
    name = _name(_required(raw, "name", ""), "name")
    tables = parse_tables(raw.get("tables"))
    if tables is None and raw.get("lake") is None:
        raise ConfigError("is required (or 'tables: catalog.schema' to address tables by name)", key="lake")
    lake = _resolve(_string(raw["lake"], "lake"), base) if raw.get("lake") is not None else ""
    sources = _sources(_required(raw, "sources", ""), base, check_paths)
    left = _string(_required(raw, "left", ""), "left")
    if left not in sources:
        raise ConfigError(f"unknown source {left!r}; sources are {sorted(sources)}", key="left")
    joins = _joins(raw.get("joins") or [], sources, left)
    unused = [name for name in sources if name != left and name not in {j.right for j in joins}]
    if unused:
        raise ConfigError(
            f"source {unused[0]!r} is not joined: name it as 'left' or as a join's 'right', or remove it",
            key=f"sources.{unused[0]}",
        )
    aliases = {left, *(j.alias for j in joins)}
    select = _select(_required(raw, "select", ""), aliases)
    output = _name(_required(raw, "output", ""), "output")
    quality = raw.get("quality") or {}
    if not isinstance(quality, Mapping):
        raise ConfigError("must be a mapping", key="quality")
    on_quarantine = raw.get("on_quarantine", "fail")
    if on_quarantine not in ON_QUARANTINE:
        raise ConfigError(f"must be one of {list(ON_QUARANTINE)}, got {on_quarantine!r}", key="on_quarantine")
    horizon = raw.get("tombstone_horizon_days")
    if horizon is not None and (
        isinstance(horizon, bool) or not isinstance(horizon, int | float) or horizon <= 0
    ):
        raise ConfigError(f"must be a positive number of days, got {horizon!r}", key="tombstone_horizon_days")
    lookback = raw.get("landing_lookback_hours")
    if lookback is not None and (
        isinstance(lookback, bool) or not isinstance(lookback, int | float) or not 0 < lookback < 1e6
    ):
        raise ConfigError(
            f"must be a positive number of hours, got {lookback!r}", key="landing_lookback_hours"
        )
    return PipelineConfig(
        name=name,
        lake=lake,
        sources=sources,
        left=left,
        joins=joins,
        select=select,
        output=output,
        config_path=config_path,
        quality=dict(quality),
        tables=tables,
        on_quarantine=on_quarantine,
        tombstone_horizon_days=None if horizon is None else float(horizon),
        landing_lookback_hours=None if lookback is None else float(lookback),
    )


def parse_tables(value: Any) -> str | None:
    """A ``tables:`` value (``catalog.schema`` or ``schema``), checked; ``None`` when absent."""
    if value is None:
        return None
    text = _string(value, "tables")
    if not _SCHEMA_NAME.match(text):
        raise ConfigError(f"must be 'catalog.schema' or 'schema', got {text!r}", key="tables")
    return text


def _sources(raw: Any, base: Path, check_paths: bool) -> dict[str, SourceConfig]:
    if not isinstance(raw, Mapping) or not raw:
        raise ConfigError("must be a non-empty mapping of source name to settings", key="sources")
    out = {}
    for name, spec in raw.items():
        key = f"sources.{name}"
        _name(name, key)
        if not isinstance(spec, Mapping):
            raise ConfigError("must be a mapping", key=key)
        _no_unknown(spec, _SOURCE_KEYS, key)
        landing = spec.get("landing")
        bronze = spec.get("bronze")
        if landing is not None:
            landing = _resolve(_string(landing, f"{key}.landing"), base)
            if check_paths and not _is_uri(landing) and not Path(landing).is_dir():
                raise ConfigError(f"landing folder {landing} does not exist", key=f"{key}.landing")
        if bronze is not None:
            bronze = _string(bronze, f"{key}.bronze")
            bronze = bronze if is_table_name(bronze) else _resolve(bronze, base)
        connector = spec.get("connector")
        if connector is not None and connector not in CONNECTORS:
            raise ConfigError(f"must be one of {list(CONNECTORS)}, got {connector!r}", key=f"{key}.connector")
        primary_key = _columns(_required(spec, "primary_key", key), f"{key}.primary_key")
        out[str(name)] = SourceConfig(
            name=str(name),
            primary_key=primary_key,
            sequence_by=_columns(spec["sequence_by"], f"{key}.sequence_by", dotted=True)
            if spec.get("sequence_by") is not None
            else (),
            landing=landing,
            bronze=bronze,
            connector=connector,
            columns=_declared_columns(spec.get("columns"), primary_key, f"{key}.columns"),
        )
    return out


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


def _joins(raw: Any, sources: Mapping[str, SourceConfig], left: str) -> tuple[JoinConfig, ...]:
    if not isinstance(raw, list):
        raise ConfigError("must be a list of joins", key="joins")
    joins = []
    for i, spec in enumerate(raw):
        key = f"joins[{i}]"
        if not isinstance(spec, Mapping):
            raise ConfigError("must be a mapping", key=key)
        _no_unknown(spec, _JOIN_KEYS, key)
        right = _string(_required(spec, "right", key), f"{key}.right")
        if right not in sources:
            raise ConfigError(f"unknown source {right!r}; sources are {sorted(sources)}", key=f"{key}.right")
        if right == left:
            raise ConfigError("a source cannot be joined to itself", key=f"{key}.right")
        fk = _columns(_required(spec, "foreign_key", key), f"{key}.foreign_key")
        right_pk = sources[right].primary_key
        if len(fk) != len(right_pk):
            raise ConfigError(
                f"has {len(fk)} column(s) but {right!r} has a primary key of "
                f"{len(right_pk)}: {list(right_pk)}",
                key=f"{key}.foreign_key",
            )
        type_text = spec.get("type", "inner")
        try:
            join_type = JoinType(str(type_text).lower())
        except ValueError:
            raise ConfigError(f"must be 'inner' or 'left', got {type_text!r}", key=f"{key}.type") from None
        alias = _name(spec.get("as", right), f"{key}.as")
        joins.append(JoinConfig(right=right, foreign_key=fk, type=join_type, alias=alias))
    seen: set[str] = set()
    for i, j in enumerate(joins):
        if j.alias in seen or j.alias == left:
            raise ConfigError(
                f"alias {j.alias!r} is used twice; give each join of {j.right!r} its own 'as'",
                key=f"joins[{i}]",
            )
        seen.add(j.alias)
    return tuple(joins)


def _select(raw: Any, aliases: set[str]) -> tuple[tuple[str, str], ...]:
    if not isinstance(raw, Mapping) or not raw:
        raise ConfigError("must be a non-empty mapping of output column to SQL expression", key="select")
    out = []
    lowered: dict[str, str] = {}
    for column, expr in raw.items():
        key = f"select.{column}"
        _name(column, key)
        if str(column).startswith("_"):
            raise ConfigError("output column names starting with '_' are reserved for metadata", key=key)
        if str(column).lower() in lowered:
            raise ConfigError(f"duplicate output column (also {lowered[str(column).lower()]!r})", key=key)
        lowered[str(column).lower()] = str(column)
        text = _string(expr, key)
        code = _STRING_LITERAL.sub("''", text)
        _check_safe(code, key)
        params = {p.strip() for m in _LAMBDA_PARAMS.findall(code) for p in ",".join(m).split(",")}
        unknown = sorted(set(_QUALIFIED.findall(code)) - aliases - params)
        if unknown:
            raise ConfigError(
                f"refers to unknown source alias(es) {unknown}; known: {sorted(aliases)}", key=key
            )
        out.append((str(column), text))
    return tuple(out)


def _check_safe(code: str, key: str) -> None:
    """A select expression is Spark SQL run with the job's privileges: no subqueries (they can
    read any table the job can), no calls of :data:`FORBIDDEN_FUNCTIONS`."""
    if _SUBQUERY.search(code):
        raise ConfigError("may not hold a subquery (SELECT): use the sources' columns only", key=key)
    called = _FORBIDDEN_CALL.search(code)
    if called:
        raise ConfigError(
            f"may not call {called.group(1)}(): it runs code or reads data with the job's privileges",
            key=key,
        )


def _required(raw: Mapping[str, Any], name: str, parent: str) -> Any:
    if raw.get(name) is None:
        raise ConfigError("is required", key=f"{parent}.{name}" if parent else name)
    return raw[name]


def _no_unknown(raw: Mapping[str, Any], allowed: set[str], parent: str) -> None:
    for k in raw:
        if k not in allowed:
            raise ConfigError(
                f"unknown key; expected one of {sorted(allowed)}", key=f"{parent}.{k}" if parent else str(k)
            )


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
    if _is_uri(text) or os.path.isabs(text):
        return text
    return str((base / text).resolve())
