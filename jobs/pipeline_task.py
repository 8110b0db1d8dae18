"""Entry point of the bundle's pipeline tasks (Databricks ``spark_python_task``); runs locally too.

    python jobs/pipeline_task.py [--tables C.S | --lake URI] [--storage B] run CONFIG [--no-ingest] [--plan P]
    python jobs/pipeline_task.py [--tables C.S | --lake URI] [--storage B] check CONFIG [--run-id N]
    python jobs/pipeline_task.py [--tables C.S | --lake URI] [--storage B] full-refresh CONFIG
    python jobs/pipeline_task.py [--tables C.S | --lake URI] [--storage B] verify CONFIG [--repair]
    python jobs/pipeline_task.py [--tables C.S | --lake URI] [--storage B] optimize CONFIG [--force]

It is ``cdc-join`` (same commands, options and exit codes, see ``cdc-join --help``): the task
parameters are the CLI's arguments. ``--tables`` (the bundle's ``catalog.schema``) or ``--lake``
replaces the config's, so one pipeline YAML serves every bundle target.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from cdc_join import cli

build_parser = cli.build_parser
open_pipeline = cli.open_pipeline


def main(argv: Sequence[str] | None = None) -> int:
    if os.environ.get("DATABRICKS_RUNTIME_VERSION"):
        from pyspark.sql import SparkSession

        # A task's process may not have made the runtime's session active yet; doing so first
        # keeps get_spark from applying its small-machine settings to the cluster's session.
        SparkSession.builder.getOrCreate()
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
