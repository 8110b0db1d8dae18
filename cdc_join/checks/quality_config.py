"""The ``quality:`` section of the pipeline YAML, parsed and checked when the config loads.

::

    quality:
      orphan_rate_max: {customers: 0.05}   # per left-join alias, or one number for all
      freshness_max_minutes: 1440
      quarantine_max: {orders: 0}          # per source, or one number for all
      severity: {orphan_rate: fail, freshness: warn, quarantine: fail}   # the defaults
      expectations:
        - expectation: expect_column_values_to_be_between
          kwargs: {column: quantity, min_value: 0}
          severity: fail                     # or warn; default fail
          name: quantity_not_negative        # optional; default: the expectation's name

Every mistake is reported at once, each naming its key (:class:`~cdc_join.errors.ConfigErrors`):
an unknown key, a threshold out of range, an alias or source the pipeline lacks, a column silver
does not have, an expectation great-expectations does not know or whose arguments it rejects.
What the checks do is :mod:`cdc_join.checks.quality`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import great_expectations as gx
from great_expectations.expectations import Expectation

from cdc_join.columns import RUN_ID, output_columns, silver_key_columns
from cdc_join.config import JoinType, PipelineConfig, Problems
from cdc_join.errors import ConfigError

WARN, FAIL = "warn", "fail"
#: great-expectations' own severities for ours (``Expectation.severity``), and back.
GX_SEVERITY = {FAIL: "critical", WARN: "warning"}
SEVERITY_OF_GX = {"critical": FAIL, "warning": WARN, "info": WARN}
SEVERITIES = (WARN, FAIL)


DEFAULT_SEVERITY = {"orphan_rate": FAIL, "freshness": WARN, "quarantine": FAIL}


_TOP_KEYS = {"orphan_rate_max", "freshness_max_minutes", "quarantine_max", "severity", "expectations"}


_EXPECTATION_KEYS = {"expectation", "kwargs", "severity", "name"}


COLUMN_KWARGS = ("column", "column_A", "column_B")


@dataclass(frozen=True)
class UserExpectation:
    """One expectation from the YAML: a great-expectations expectation name and its arguments."""

    name: str
    expectation: str
    kwargs: Mapping[str, Any]
    severity: str

    def build(self, meta: Mapping[str, Any]) -> Expectation:
        """The great-expectations object (its pydantic model checks the arguments), with its
        severity."""
        return expectation_class(self.expectation)(
            **self.kwargs, meta=dict(meta), severity=GX_SEVERITY[self.severity]
        )


def expectation_class(name: str) -> type[Expectation]:
    """The expectation class of a name like ``expect_column_values_to_be_between``, from the
    expectations great-expectations exports (``gx.expectations``).

    Raises:
        KeyError: no expectation has that name.
    """
    classes = {
        getattr(c, "expectation_type", None): c
        for c in vars(gx.expectations).values()
        if isinstance(c, type) and issubclass(c, Expectation)
    }
    return classes[name]


@dataclass(frozen=True)
class QualitySettings:
    """The validated ``quality:`` section of a pipeline."""

    orphan_rate_max: Mapping[str, float] = field(default_factory=dict)
    freshness_max_minutes: float | None = None
    quarantine_max: Mapping[str, int] = field(default_factory=dict)
    severity: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_SEVERITY))
    expectations: tuple[UserExpectation, ...] = ()


def parse_quality(config: PipelineConfig) -> QualitySettings:
    """Validate ``config.quality``; errors name the ``quality.…`` key.

    Raises:
        ConfigError: an unknown key, a threshold out of range, an unknown join alias or
            expectation, expectation arguments great-expectations rejects, or a column that
            silver does not have.
    """
    raw = config.quality
    p = Problems()  # each part on its own, so one mistake does not hide the others
    p.unknown_keys(raw, _TOP_KEYS, "quality")
    settings = QualitySettings(
        orphan_rate_max=p.value(lambda: _orphan_thresholds(config, raw.get("orphan_rate_max")), {}),
        freshness_max_minutes=p.value(lambda: _freshness(raw.get("freshness_max_minutes"))),
        quarantine_max=p.value(lambda: _quarantine_limits(config, raw.get("quarantine_max")), {}),
        severity=p.value(lambda: _severities(raw.get("severity")), {}),
        expectations=_expectations(config, raw.get("expectations"), p.found),
    )
    p.raise_found(config.config_path)
    return settings


def left_join_aliases(config: PipelineConfig) -> list[str]:
    """Aliases of the left joins (the ones with an orphan rate)."""
    return [j.alias for j in config.joins if j.type is JoinType.LEFT]


def silver_columns(config: PipelineConfig) -> list[str]:
    """Every column of silver: merge key, select outputs, per-alias sequences, run id."""
    aliases = [config.left, *(j.alias for j in config.joins)]
    return [*silver_key_columns(config), *output_columns(config), *(f"_seq_{a}" for a in aliases), RUN_ID]


def _orphan_thresholds(config: PipelineConfig, raw: Any) -> dict[str, float]:
    key = "quality.orphan_rate_max"
    lefts = left_join_aliases(config)
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        return {alias: _rate(raw, key) for alias in lefts}
    for alias in raw:
        if alias not in lefts:
            raise ConfigError(f"{alias!r} is not a left join; left joins are {lefts}", key=f"{key}.{alias}")
    return {str(alias): _rate(value, f"{key}.{alias}") for alias, value in raw.items()}


def _quarantine_limits(config: PipelineConfig, raw: Any) -> dict[str, int]:
    key = "quality.quarantine_max"
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        limit = _count(raw, key)
        return dict.fromkeys(config.sources, limit)
    for source in raw:
        if source not in config.sources:
            raise ConfigError(
                f"{source!r} is not a source; sources are {list(config.sources)}", key=f"{key}.{source}"
            )
    return {str(source): _count(value, f"{key}.{source}") for source, value in raw.items()}


def _count(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"must be a whole number of lines, 0 or more, got {value!r}", key=key)
    return value


def _rate(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ConfigError(f"must be a number from 0 to 1, got {value!r}", key=key)
    return float(value)


def _freshness(raw: Any) -> float | None:
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not math.isfinite(raw) or raw <= 0:
        raise ConfigError(
            f"must be a positive number of minutes, got {raw!r}", key="quality.freshness_max_minutes"
        )
    return float(raw)


def _severities(raw: Any) -> dict[str, str]:
    if raw is None:
        return dict(DEFAULT_SEVERITY)
    if not isinstance(raw, Mapping):
        raise ConfigError("must be a mapping of check to warn/fail", key="quality.severity")
    _no_unknown(raw, set(DEFAULT_SEVERITY), "quality.severity")
    return {**DEFAULT_SEVERITY, **{k: _severity(v, f"quality.severity.{k}") for k, v in raw.items()}}


def _severity(value: Any, key: str) -> str:
    if value not in SEVERITIES:
        raise ConfigError(f"must be 'warn' or 'fail', got {value!r}", key=key)
    return str(value)


def _expectations(
    config: PipelineConfig, raw: Any, problems: list[ConfigError]
) -> tuple[UserExpectation, ...]:
    """The valid expectations; the mistake of each other one is added to ``problems``."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        problems.append(ConfigError("must be a list of expectations", key="quality.expectations"))
        return ()
    names: set[str] = set()
    calls: set[str] = set()
    parsed = []
    for i, spec in enumerate(raw):
        key = f"quality.expectations[{i}]"
        try:
            e = _expectation(config, spec, key)
        except ConfigError as error:
            problems.append(error)
            continue
        # A suite keeps one of two expectations with equal arguments, so one result would vanish.
        call = json.dumps([e.expectation, e.kwargs], sort_keys=True, default=str)
        if e.name in names:
            message = f"two expectations are named {e.name!r}; give each its own 'name'"
            problems.append(ConfigError(message, key=f"{key}.name"))
        elif call in calls:
            problems.append(ConfigError("repeats an earlier expectation with the same arguments", key=key))
        else:
            parsed.append(e)
        names.add(e.name)
        calls.add(call)
    return tuple(parsed)


def _expectation(config: PipelineConfig, spec: Any, key: str) -> UserExpectation:
    if not isinstance(spec, Mapping):
        raise ConfigError("must be a mapping with 'expectation', 'kwargs' and 'severity'", key=key)
    _no_unknown(spec, _EXPECTATION_KEYS, key)
    name = spec.get("expectation")
    if not isinstance(name, str) or not name:
        raise ConfigError("is required: a great-expectations expectation name", key=f"{key}.expectation")
    try:
        expectation_class(name)
    except KeyError:
        raise ConfigError(
            f"unknown expectation {name!r} (names look like expect_column_values_to_be_between)",
            key=f"{key}.expectation",
        ) from None
    kwargs = spec.get("kwargs") or {}
    if not isinstance(kwargs, Mapping):
        raise ConfigError("must be a mapping of argument to value", key=f"{key}.kwargs")
    _check_columns(config, kwargs, f"{key}.kwargs")
    label = spec.get("name", name)
    if not isinstance(label, str) or not label.strip():
        raise ConfigError(f"must be a non-empty string, got {label!r}", key=f"{key}.name")
    expectation = UserExpectation(
        label.strip(), name, dict(kwargs), _severity(spec.get("severity", FAIL), f"{key}.severity")
    )
    try:
        expectation.build({})
    except Exception as e:  # pydantic's ValidationError, or a TypeError of the constructor
        raise ConfigError(f"{name} rejects these arguments: {_first_lines(e)}", key=f"{key}.kwargs") from None
    return expectation


def _check_columns(config: PipelineConfig, kwargs: Mapping[str, Any], key: str) -> None:
    known = silver_columns(config)
    named = [(k, kwargs[k]) for k in COLUMN_KWARGS if k in kwargs]
    named += [(f"column_list[{i}]", c) for i, c in enumerate(kwargs.get("column_list") or [])]
    for k, column in named:
        if column not in known:
            raise ConfigError(f"silver has no column {column!r}; it has {known}", key=f"{key}.{k}")


def _no_unknown(raw: Mapping[str, Any], allowed: set[str], parent: str) -> None:
    for k in raw:
        if k not in allowed:
            raise ConfigError(f"unknown key; expected one of {sorted(allowed)}", key=f"{parent}.{k}")


def _first_lines(error: Exception, limit: int = 6) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return "; ".join(lines[:limit])
