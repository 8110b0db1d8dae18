"""cdc_join: incremental foreign-key joins (KIP-213) from Debezium CDC into Delta Lake."""

from cdc_join.config import JoinConfig, JoinType, PipelineConfig, SourceConfig, load_config
from cdc_join.errors import CdcJoinError, ConfigError, InputError, StorageError

__all__ = [
    "CdcJoinError",
    "ConfigError",
    "InputError",
    "JoinConfig",
    "JoinType",
    "PipelineConfig",
    "SourceConfig",
    "StorageError",
    "load_config",
]
__version__ = "0.1.0"
