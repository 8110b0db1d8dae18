"""The SparkSession a run uses: an active one if there is one (Databricks), else a local one."""

from __future__ import annotations

import os

from pyspark.sql import SparkSession

LOCAL_DEFAULTS = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "4",
    "spark.default.parallelism": "4",
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.adaptive.enabled": "true",
    "spark.driver.memory": "4g",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
}


def get_spark(app_name: str = "cdc_join", extra_conf: dict[str, str] | None = None) -> SparkSession:
    """Return the active SparkSession, or start a local one with small-machine defaults.

    On Databricks (or any driver that already has a session) the active session is reused
    untouched. Locally, the master comes from ``CDC_JOIN_SPARK_MASTER`` (default
    ``local[2]``); where the Delta jars are on the classpath, ``CDC_JOIN_STORAGE=delta-spark``
    also configures the Delta SQL extension and catalog.
    """
    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    if os.environ.get("DATABRICKS_RUNTIME_VERSION"):
        # The cluster's session is configured by the cluster; laptop defaults don't belong there.
        return SparkSession.builder.getOrCreate()
    builder = SparkSession.builder.appName(app_name).master(
        os.environ.get("CDC_JOIN_SPARK_MASTER", "local[2]")
    )
    for key, value in {**LOCAL_DEFAULTS, **(extra_conf or {})}.items():
        builder = builder.config(key, value)
    if os.environ.get("CDC_JOIN_STORAGE") == "delta-spark":
        builder = builder.config("spark.sql.extensions", "io.delta.sql.DeltaSparkSessionExtension").config(
            "spark.sql.catalog.spark_catalog", "org.apache.spark.sql.delta.catalog.DeltaCatalog"
        )
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark
