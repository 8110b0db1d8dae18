"""A predicate that names a set of keys, in the SQL of each backend: what a keyed replace
(:meth:`cdc_join.storage.base.Storage.replace_keys`) deletes, and the query that reads those
keys' rows on the driver from a table with deletion vectors (:func:`rows_of`).

The keys are the rows of an Arrow table of one column (a key of several columns is not named
yet: Spark's ``IN`` of structs wants the literals' struct type spelled out, field names and
all). Only values whose text is exact in both dialects are written as literals: integers,
strings, booleans, decimals and dates. :func:`nameable` says whether a set of keys can be
named (one column, no null, only those types); a caller that gets ``False`` writes another
way (silver MERGEs).

Spark SQL reads a backslash in a string literal as an escape and two quotes as two adjacent
literals, DataFusion (delta-rs) doubles a quote and takes backslashes as they are: each
dialect gets its own escaping, and Spark's only with ``spark.sql.parser.escapedStringLiterals``
off (its default; :func:`spark_predicate` is not used otherwise).
"""

from __future__ import annotations

import datetime
import decimal
from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from cdc_join.errors import StorageError

#: The most keys one predicate names: its text grows with them, and Spark's parser with it.
MOST_KEYS = 20_000


def nameable(keys: pa.Table) -> bool:
    """Whether :func:`spark_predicate` and :func:`delta_rs_predicate` can name these keys."""
    if keys.num_columns != 1 or not 0 < keys.num_rows <= MOST_KEYS:
        return False
    for column in keys.columns:
        kind = column.type
        typed = (
            pa.types.is_integer(kind)
            or pa.types.is_string(kind)
            or pa.types.is_large_string(kind)
            or pa.types.is_boolean(kind)
            or pa.types.is_decimal(kind)
            or pa.types.is_date32(kind)
        )
        if not typed or column.null_count:
            return False
    return True


def spark_predicate(columns: Sequence[str], keys: pa.Table) -> str:
    """Spark SQL: a row's key column equals one of ``keys``' values (``k IN (…)``)."""
    return _predicate(columns, keys, _spark_identifier, _spark_text)


def delta_rs_predicate(columns: Sequence[str], keys: pa.Table) -> str:
    """DataFusion SQL (delta-rs): the same predicate."""
    return _predicate(columns, keys, _delta_rs_identifier, _delta_rs_text)


def _predicate(
    columns: Sequence[str],
    keys: pa.Table,
    identifier: Callable[[str], str],
    text: Callable[[str], str],
) -> str:
    if len(columns) != 1 or not nameable(keys):
        raise ValueError(
            "keys must be one column of 1 to MOST_KEYS integers, strings, booleans, decimals or dates"
        )
    values = [_literal(v, text) for v in keys.column(0).to_pylist()]
    return f"{identifier(columns[0])} IN ({', '.join(values)})"


def check_named(rows: pa.Table, columns: Sequence[str], keys: pa.Table) -> None:
    """Raise unless every row of ``rows`` has its key (``columns``) among ``keys``: a keyed
    replace must not write a row whose key its delete did not name.

    Raises:
        StorageError: naming the first key that is not among them.
    """
    (column,) = columns
    values = rows.column(column)
    found = pc.fill_null(pc.is_in(values, value_set=keys.column(0).combine_chunks().cast(values.type)), False)
    missing = values.filter(pc.invert(found))
    if len(missing):
        raise StorageError(
            f"a keyed replace got a row whose {column} ({missing[0].as_py()!r}) is not among its keys"
        )


def rows_of(
    table: Any, column: str, values: Sequence[Any], columns: Sequence[str] | None = None
) -> pa.Table | None:
    """The rows of a delta-rs table (``deltalake.DeltaTable``) whose ``column`` equals one of
    ``values`` (a null matches nothing), only ``columns`` of them, read by delta-rs's
    ``QueryBuilder``: the reader of delta-rs that applies deletion vectors, where pyarrow
    datasets refuse such a table. ``None`` where :func:`nameable` cannot name the values.

    The values are a ``VALUES`` list joined with the table, not an ``IN`` list: DataFusion's
    process crashed (a segmentation fault, no exception) on ``IN`` of 50,000 integers, and
    joined 250,000 (2026-12-06). A range of the values beside the join lets delta-rs skip the
    files whose statistics lie outside it.
    """
    distinct = list(dict.fromkeys(v for v in values if v is not None))
    schema = pa.schema(table.schema().to_arrow())
    wanted = schema if columns is None else pa.schema([schema.field(c) for c in columns])
    if not distinct:
        return wanted.empty_table()
    keys = pa.table({column: pa.array(distinct)})
    if not nameable(keys):
        return None
    name = _delta_rs_identifier(column)
    literals = [_literal(v, _delta_rs_text) for v in distinct]
    where = ""
    if not isinstance(distinct[0], bool):
        low, high = (_literal(v, _delta_rs_text) for v in (min(distinct), max(distinct)))
        where = f" WHERE t.{name} >= {low} AND t.{name} <= {high}"
    listed = ", ".join(f"t.{_delta_rs_identifier(c)}" for c in wanted.names)
    sql = (
        f"SELECT {listed} FROM t JOIN (VALUES {', '.join(f'({v})' for v in literals)}) AS k(key)"
        f" ON t.{name} = k.key{where}"
    )
    from deltalake import QueryBuilder

    found = pa.table(QueryBuilder().register("t", table).execute(sql).read_all())
    return found.select(wanted.names).cast(wanted)


def all_rows(table: Any) -> pa.Table:
    """Every row of a delta-rs table, its deletion vectors applied (``QueryBuilder``)."""
    from deltalake import QueryBuilder

    schema = pa.schema(table.schema().to_arrow())
    found = pa.table(QueryBuilder().register("t", table).execute("SELECT * FROM t").read_all())
    return found.select(schema.names).cast(schema)


def _literal(value: object, text: Callable[[str], str]) -> str:
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return text(value)
    if isinstance(value, decimal.Decimal):
        scale = max(-int(value.as_tuple().exponent), 0)
        return f"CAST('{value:f}' AS DECIMAL(38, {scale}))"
    if isinstance(value, datetime.date):
        return f"DATE '{value.isoformat()}'"
    raise ValueError(f"no literal for {value!r}")


def _spark_identifier(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def _spark_text(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _delta_rs_identifier(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _delta_rs_text(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"
