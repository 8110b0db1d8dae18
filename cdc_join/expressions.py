"""The text of ``select`` expressions: tokens, and what an expression may not do.

A select expression is Spark SQL that runs with the job's privileges, so the config check
rejects subqueries (they can read any table the job can) and calls of functions that run JVM
code or reach other data or services. The check works on tokens, as Spark's lexer sees them,
not on the raw text: a name in backticks, a comment between a name and its ``(``, a raw string
or an escaped quote cannot hide a call, and a word inside a string literal or a comment is not
one.
"""

from __future__ import annotations

from dataclasses import dataclass

from cdc_join.errors import ConfigError

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
#: Words that start a query inside an expression (``(SELECT …)``, ``IN (TABLE t)``).
_QUERY_WORDS = ("select", "table")


@dataclass(frozen=True)
class Token:
    """One lexical token: ``kind`` is ``name`` (``quoted`` when in backticks), ``string``,
    ``number`` or ``symbol``."""

    kind: str
    text: str
    quoted: bool = False


def tokens(text: str) -> list[Token]:
    """Spark SQL tokens of ``text``, comments and white space dropped.

    Raises:
        ValueError: an unclosed string, backtick name or comment.
    """
    out: list[Token] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c.isspace():
            i += 1
        elif text.startswith("--", i):
            end = text.find("\n", i)
            i = n if end < 0 else end + 1
        elif text.startswith("/*", i):
            i = _comment_end(text, i)
        elif c in "'\"" or (c in "rR" and i + 1 < n and text[i + 1] in "'\""):
            raw = c in "rR"
            start = i + 1 if raw else i
            end = _string_end(text, start, raw)
            out.append(Token("string", text[start + 1 : end - 1]))
            i = end
        elif c == "`":
            end, name = _backticked(text, i)
            out.append(Token("name", name, quoted=True))
            i = end
        elif c.isalpha() or c == "_":
            j = i + 1
            while j < n and (text[j].isalnum() or text[j] == "_"):
                j += 1
            out.append(Token("name", text[i:j]))
            i = j
        elif c.isdigit():
            j = i + 1
            while j < n and (text[j].isalnum() or text[j] in "._"):
                j += 1
            out.append(Token("number", text[i:j]))
            i = j
        else:
            out.append(Token("symbol", c))
            i += 1
    return out


def _comment_end(text: str, i: int) -> int:
    """The end of the bracketed comment opening at ``i`` (Spark's nest)."""
    depth, j = 0, i
    while j < len(text):
        if text.startswith("/*", j):
            depth, j = depth + 1, j + 2
        elif text.startswith("*/", j):
            depth, j = depth - 1, j + 2
            if depth == 0:
                return j
        else:
            j += 1
    raise ValueError("a comment (/* … */) is not closed")


def _string_end(text: str, i: int, raw: bool) -> int:
    """The end of the string literal whose quote is at ``i`` (backslash escapes unless raw)."""
    quote, j = text[i], i + 1
    while j < len(text):
        if text[j] == "\\" and not raw:
            j += 2
        elif text[j] == quote:
            return j + 1
        else:
            j += 1
    raise ValueError(f"a string literal ({quote}…{quote}) is not closed")


def _backticked(text: str, i: int) -> tuple[int, str]:
    """The end and the name of the backtick-quoted identifier at ``i`` (``` `` ``` is one `)."""
    j, name = i + 1, []
    while j < len(text):
        if text[j] == "`":
            if text.startswith("``", j):
                name.append("`")
                j += 2
                continue
            return j + 1, "".join(name)
        name.append(text[j])
        j += 1
    raise ValueError("a `quoted name` is not closed")


def check_safe(text: str, key: str) -> list[Token]:
    """The tokens of a select expression that may run; else a :class:`ConfigError` naming ``key``.

    Rejected: a subquery (``SELECT``, ``TABLE``), a call of a :data:`FORBIDDEN_FUNCTIONS`
    function however it is written, ``IDENTIFIER(…)`` (a name computed from a string could be
    any of them), and a call of a function named with a catalog or schema (a stored function,
    which runs code of its own).
    """
    try:
        found = tokens(text)
    except ValueError as e:
        raise ConfigError(f"is not a valid expression: {e}", key=key) from None
    for i, token in enumerate(found):
        if token.kind != "name":
            continue
        word = token.text.lower()
        after_dot = i > 0 and found[i - 1].text == "." and found[i - 1].kind == "symbol"
        called = i + 1 < len(found) and found[i + 1].kind == "symbol" and found[i + 1].text == "("
        if word in _QUERY_WORDS and not token.quoted and not after_dot:
            raise ConfigError(
                f"may not hold a subquery ({token.text.upper()}): use the sources' columns only", key=key
            )
        if not called:
            continue
        if word in FORBIDDEN_FUNCTIONS:
            raise ConfigError(
                f"may not call {token.text}(): it runs code or reads data with the job's privileges", key=key
            )
        if word == "identifier" and not token.quoted:
            raise ConfigError("may not call IDENTIFIER(): write names out", key=key)
        if after_dot:
            name = _dotted_name(found, i)
            raise ConfigError(f"may not call a stored function ({name}()): use Spark's built-ins", key=key)
    return found


def _dotted_name(found: list[Token], end: int) -> str:
    """The dotted name ending at token ``end`` (``a.b.f``)."""
    parts, i = [found[end].text], end
    while i >= 2 and found[i - 1].text == "." and found[i - 2].kind == "name":
        parts.insert(0, found[i - 2].text)
        i -= 2
    return ".".join(parts)


def code_of(found: list[Token]) -> str:
    """The expression rebuilt from its tokens, literals blanked (``''``) and comments dropped:
    text whose names are all code, for finding the aliases it refers to."""
    out, previous = [], None
    for t in found:
        if previous is not None and previous.kind != "symbol" and t.kind != "symbol":
            out.append(" ")  # two words stay two words; `a . b` stays `a.b`
        if t.kind == "string":
            out.append("''")
        elif t.quoted:
            out.append("`" + t.text.replace("`", "``") + "`")
        else:
            out.append(t.text)
        previous = t
    return "".join(out)
