"""cdc_join: incremental foreign-key joins (KIP-213) from Debezium CDC into Delta Lake.

``from cdc_join import Pipeline, load_config``: ``Pipeline(load_config("pipeline.yml")).run()``.
The package reads in the order data moves: ``landing`` (landing folders → bronze), ``join``
(the KIP-213 hops), ``silver`` (the output table), ``checks`` (verify, quality), ``run`` (a run
wired and its path chosen), ``cli``; ``storage`` is the one seam to Delta, and the modules
beside these (``config``, ``errors``, ``schemas``, ``columns``, ``changeset``, ``locations``,
``checkpoint``, ``report``, ``session`` …) are what they all share.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cdc_join.config import JoinConfig, JoinType, PipelineConfig, SourceConfig, load_config
from cdc_join.errors import CdcJoinError, ConfigError, InputError, StorageError

if TYPE_CHECKING:
    from cdc_join.run.pipeline import Pipeline

__all__ = [
    "CdcJoinError",
    "ConfigError",
    "InputError",
    "JoinConfig",
    "JoinType",
    "Pipeline",
    "PipelineConfig",
    "SourceConfig",
    "StorageError",
    "load_config",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Imported when asked for: importing the package (its config, its errors) starts no Spark
    # and loads none of the engine.
    if name == "Pipeline":
        from cdc_join.run.pipeline import Pipeline

        return Pipeline
    raise AttributeError(f"module 'cdc_join' has no attribute {name!r}")
