"""Telling local paths from URIs, the one rule every module uses.

A location is a local path when it has no scheme (``/data/lake``, ``lake``) or the ``file:``
scheme (``file:/data/lake``, ``file:///data/lake``); anything else with a scheme names another
file system (``s3://…``, ``abfss://…``, ``dbfs:/…``). A scheme is two or more characters, so a
Windows drive (``C:\\lake``) stays a path.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

URI_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:")
_GLOB_SPECIAL = re.compile(r"([\\*?\[\]{}])")


def has_scheme(location: str | os.PathLike[str]) -> bool:
    """Whether ``location`` starts with a URI scheme (``file:`` included)."""
    return bool(URI_SCHEME.match(os.fspath(location)))


def local_path(location: str | os.PathLike[str]) -> str | None:
    """The local file-system path ``location`` names, or ``None`` for another file system.

    ``file:/a/b`` and ``file:///a/b`` give ``/a/b``; a path without scheme is itself.
    """
    text = os.fspath(location)
    if text.startswith("file:"):
        rest = text[len("file:") :]
        return "/" + rest.lstrip("/") if rest.startswith("//") else rest
    return None if has_scheme(text) else text


def glob_escape(path: str) -> str:
    """``path`` with Hadoop glob characters escaped: Spark's file readers expand globs in every
    path they are given, and a folder name may contain ``[``, ``{`` or ``*``."""
    return _GLOB_SPECIAL.sub(r"\\\1", path)


_TABLE_NAME = re.compile(r"^(`[^`]+`|[A-Za-z_][A-Za-z0-9_]*)(\.(`[^`]+`|[A-Za-z_][A-Za-z0-9_]*)){1,2}$")


def is_table_name(ref: str) -> bool:
    """Whether ``ref`` names a metastore / Unity Catalog table (``catalog.schema.table``).

    Paths always hold a ``/`` or a scheme (config paths are made absolute), names never do.
    """
    return "/" not in ref and ":" not in ref and bool(_TABLE_NAME.match(ref))


def quote_table_name(name: str) -> str:
    """``a.b.c`` → ```a`.`b`.`c``` for SQL (parts already quoted are kept)."""
    parts = re.findall(r"`[^`]+`|[^.]+", name)
    return ".".join(p if p.startswith("`") else f"`{p}`" for p in parts)


def local_bytes(locations: Iterable[str]) -> int | None:
    """The bytes of every file under each of ``locations`` (a missing one holds none), read
    from the local file system; ``None`` where one is a table name or another file system."""
    total = 0
    for location in locations:
        folder = None if is_table_name(location) else local_path(location)
        if folder is None:
            return None
        for root, _, names in os.walk(folder):
            for name in names:
                try:
                    total += os.path.getsize(os.path.join(root, name))
                except OSError:  # removed while listed (a vacuum)
                    continue
    return total
