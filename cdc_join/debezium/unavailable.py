"""Debezium's placeholder for a value it could not read, counted per column of a batch.

PostgreSQL writes it for an unchanged TOASTed value when the table's REPLICA IDENTITY is not
FULL, Oracle for an unchanged LOB: the row in state and silver then holds the placeholder until
a later event carries the value. A run counts them (:func:`unavailable_values`) and warns.
"""

from __future__ import annotations

import base64

import pyarrow as pa
import pyarrow.compute as pc

#: Debezium's default ``unavailable.value.placeholder``: the text (or its bytes) it writes for a
#: value it could not read: PostgreSQL for an unchanged TOASTed value when the table's REPLICA
#: IDENTITY is not FULL, Oracle for an unchanged LOB.
UNAVAILABLE_VALUE = "__debezium_unavailable_value"


#: The same placeholder as base64 text: a ``bytea`` column of payload-only events is a string.
_UNAVAILABLE_BASE64 = base64.b64encode(UNAVAILABLE_VALUE.encode()).decode()


def unavailable_values(after: pa.ChunkedArray) -> dict[str, int]:
    """Per top-level column of the ``after`` images, how many hold :data:`UNAVAILABLE_VALUE`: as
    the text of a string column (or that text in base64), the bytes of a binary column, or an
    element of a list of text.

    Counted on the driver with Arrow kernels over the batch already collected for its write.
    """
    found: dict[str, int] = {}
    if not pa.types.is_struct(after.type):
        return found
    for i, column in enumerate(after.type):
        values = pc.struct_field(after, [i])
        kind = column.type
        if pa.types.is_string(kind) or pa.types.is_large_string(kind):
            hits = pc.sum(pc.is_in(values, pa.array([UNAVAILABLE_VALUE, _UNAVAILABLE_BASE64]))).as_py() or 0
        elif pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
            hits = pc.sum(pc.equal(values, pa.scalar(UNAVAILABLE_VALUE.encode(), kind))).as_py() or 0
        elif (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and (
            pa.types.is_string(kind.value_type) or pa.types.is_large_string(kind.value_type)
        ):
            # Null lists (or null images) may cover values flatten() skips: drop them first.
            lists = pc.drop_null(values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values)
            hit = pc.equal(pc.list_flatten(lists), UNAVAILABLE_VALUE)
            hits = len(pc.unique(pc.filter(pc.list_parent_indices(lists), hit)))
        else:
            continue
        if hits:
            found[column.name] = int(hits)
    return found
