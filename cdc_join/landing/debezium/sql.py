"""SQL text builders shared by the Debezium parser's stages.

Every stage of :mod:`cdc_join.landing.debezium` is a ``selectExpr`` of generated SQL text, built from
these helpers. Values are VARIANTs (``try_parse_json`` of a line): :func:`get` reads a path and
keeps a JSON ``null`` as a variant null, which :func:`absent` and :func:`present` tell apart from
SQL NULL (a missing field). Keeping that distinction in one place is what stops a JSON ``null``
from turning into the text ``"null"``.
"""

from __future__ import annotations

from cdc_join.errors import InputError
from cdc_join.schemas import ddl as ddl
from cdc_join.schemas import sql_string as lit

#: Longest JSON excerpt a quarantine reason quotes.
MESSAGE_JSON_CHARS = 200


def ident(name: str) -> str:
    """A backtick-quoted SQL identifier."""
    return "`" + name.replace("`", "``") + "`"


def key(name: str) -> str:
    """One variant path step selecting the object field ``name``."""
    if '"' not in name:
        return f'["{name}"]'
    if "'" not in name:
        return f"['{name}']"
    raise InputError(f"field name {name!r} has both quote characters; it cannot be addressed")


def get(v: str, steps: str) -> str:
    """The variant at ``$<steps>`` of ``v``; SQL NULL when absent (a JSON null stays a variant null)."""
    return f"variant_get({v}, {lit('$' + steps)}, 'variant')"


def absent(v: str) -> str:
    """SQL: ``v`` is missing (SQL NULL) or a JSON ``null``."""
    return f"({v} IS NULL OR is_variant_null({v}))"


def present(v: str) -> str:
    """``v`` with a JSON null turned into SQL NULL."""
    return f"CASE WHEN NOT is_variant_null({v}) THEN {v} END"


def as_type(v: str, sql_type: str) -> str:
    """``v`` read as ``sql_type``; NULL when it does not convert (or is a JSON ``null``)."""
    return f"try_variant_get({v}, '$', {lit(sql_type)})"


def kind(v: str) -> str:
    """The variant's own type name (``BIGINT``, ``STRING``, ``OBJECT<…>``, ``VOID`` for null)."""
    return f"schema_of_variant({v})"


def is_number_kind(json_kind: str) -> str:
    """SQL: a :func:`kind` names a number (``BIGINT``, ``DECIMAL(p,s)``, ``DOUBLE``, ``FLOAT``).

    Prefix tests, not a regular expression: this runs once per value of a large batch.
    """
    prefixes = ("BIGINT", "DECIMAL", "DOUBLE", "FLOAT")
    return "(" + " OR ".join(f"startswith({json_kind}, {lit(p)})" for p in prefixes) + ")"


def is_object(v: str, steps: str = "") -> str:
    """SQL: ``v`` (or the value at ``$<steps>`` of it) is a JSON object.

    With ``steps`` the value is read in place: ``is_object(get(v, steps))`` would first copy it
    into a variant of its own (0.3 s per image of a 470,000-event batch).
    """
    return f"(try_variant_get({v}, {lit('$' + steps)}, 'struct<>') IS NOT NULL)"


def json_text(v: str) -> str:
    """The start of ``v``'s JSON text, for quarantine reasons."""
    return f"substr(to_json({v}), 1, {MESSAGE_JSON_CHARS})"


class Names:
    """Fresh lambda variable names, so nested lambdas never shadow each other."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}{self.count}"


def steps(dotted: str) -> str:
    """Variant path steps of a dotted field path (``source.lsn``)."""
    return "".join(key(name) for name in dotted.split("."))
