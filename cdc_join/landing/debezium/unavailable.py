"""Debezium's placeholder for a value it could not read, counted per column of a batch.

PostgreSQL writes it for an unchanged TOASTed value when the table's REPLICA IDENTITY is not
FULL, Oracle for an unchanged LOB: the row in state and silver then holds the placeholder until
a later event carries the value. Ingest counts them in Spark, with the batch's other counts
(:func:`unavailable_checks`), and a run warns.
"""

from __future__ import annotations

import base64

from pyspark.sql.types import ArrayType, BinaryType, StringType, StructType

from cdc_join.landing.debezium.sql import ident, lit

#: Debezium's default ``unavailable.value.placeholder``: the text (or its bytes) it writes for a
#: value it could not read: PostgreSQL for an unchanged TOASTed value when the table's REPLICA
#: IDENTITY is not FULL, Oracle for an unchanged LOB.
UNAVAILABLE_VALUE = "__debezium_unavailable_value"


#: The same placeholder as base64 text: a ``bytea`` column of payload-only events is a string.
_UNAVAILABLE_BASE64 = base64.b64encode(UNAVAILABLE_VALUE.encode()).decode()


def unavailable_checks(row: StructType, image: str) -> dict[str, str]:
    """Per top-level column of ``row`` that can hold :data:`UNAVAILABLE_VALUE`, a SQL condition
    true where that column of ``image`` (a column of type ``row``) holds it: as the text of a
    string column (or that text in base64), the bytes of a binary column, or an element of an
    array of text. Columns of other types are left out."""
    checks = {}
    for field in row.fields:
        value = f"{image}.{ident(field.name)}"
        kind = field.dataType
        if isinstance(kind, StringType):
            checks[field.name] = f"{value} IN ({lit(UNAVAILABLE_VALUE)}, {lit(_UNAVAILABLE_BASE64)})"
        elif isinstance(kind, BinaryType):
            checks[field.name] = f"{value} = CAST({lit(UNAVAILABLE_VALUE)} AS BINARY)"
        elif isinstance(kind, ArrayType) and isinstance(kind.elementType, StringType):
            checks[field.name] = f"exists({value}, x -> x = {lit(UNAVAILABLE_VALUE)})"
    return checks
