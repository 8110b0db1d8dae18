"""The error types cdc_join raises; every message names the input that is wrong."""

from __future__ import annotations


class CdcJoinError(Exception):
    """Base class of every error cdc_join raises on purpose.

    Args:
        message: what is wrong, naming the input.
        hint: what to do next, when it is more specific than the CLI's default for the type.
    """

    def __init__(self, message: str = "", *, hint: str | None = None) -> None:
        self.hint = hint
        super().__init__(message)


class ConfigError(CdcJoinError):
    """The pipeline YAML is invalid. Raised before any data is read or written.

    Args:
        message: what is wrong.
        key: the dotted key of the offending entry, e.g. ``joins[0].foreign_key``.
        path: the config file.
    """

    def __init__(
        self, message: str, *, key: str | None = None, path: object = None, hint: str | None = None
    ) -> None:
        self.message = message
        self.key = key
        self.path = path
        where = []
        if path is not None:
            where.append(str(path))
        if key:
            where.append(key)
        super().__init__(f"{': '.join(where)}: {message}" if where else message, hint=hint)


class ConfigErrors(ConfigError):
    """Several mistakes in one pipeline YAML, reported together so one edit can fix them all.

    Args:
        problems: each mistake, naming its key.
        path: the config file.
    """

    def __init__(self, problems: list[ConfigError] | tuple[ConfigError, ...], *, path: object = None) -> None:
        self.problems = tuple(problems)
        lines = "\n".join(f"  {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} problems:\n{lines}", path=path)


def config_errors(problems: list[ConfigError], path: object = None) -> ConfigError:
    """One error to raise for ``problems`` (at least one), naming the config file ``path``: the
    problem itself when there is one, else :class:`ConfigErrors`."""
    if len(problems) == 1:
        one = problems[0]
        return ConfigError(one.message, key=one.key, path=path if path is not None else one.path)
    return ConfigErrors(problems, path=path)


class InputError(CdcJoinError):
    """Source data cannot be processed as a whole (e.g. no usable sequence field)."""


class SourceNotReadyError(InputError):
    """A source the join needs has neither events nor declared columns yet."""


class StorageError(CdcJoinError):
    """A Delta table cannot be read or written, or no storage backend is usable."""


class ConcurrentRunError(CdcJoinError):
    """Another run of the same pipeline holds the lock."""


class VerifyError(CdcJoinError):
    """Silver differs from a full recompute of the join."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
