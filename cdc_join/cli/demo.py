"""``cdc-join demo``: the Debezium tutorial's ``inventory`` database, joined end to end.

orders ⋈ customers (on ``purchaser``) ⋈ products (on ``product_id``). A first batch lands the
snapshot; a second batch moves an order to another customer (fk change), renames a customer who
has several orders (a right-side change fanning out), deletes an order and adds one. Silver is
shown before and after, with the run reports and a final ``verify``.
"""

from __future__ import annotations

import datetime
import tempfile
from pathlib import Path

import yaml

from cdc_join.config import load_config
from cdc_join.landing.event_writer import EventWriter
from cdc_join.run.pipeline import Pipeline
from cdc_join.session import get_spark
from cdc_join.storage import get_storage

TABLES = {
    "customers": {"id": "int32", "first_name": "string", "last_name": "string", "email": "string"},
    "products": {"id": "int32", "name": "string", "description": "string", "weight": "double"},
    "orders": {
        "id": "int32",
        "order_date": "date",
        "purchaser": "int32",
        "quantity": "int32",
        "product_id": "int32",
    },
}

CUSTOMERS = [
    (1001, "Sally", "Thomas", "sally.thomas@acme.com"),
    (1002, "George", "Bailey", "gbailey@foobar.com"),
    (1003, "Edward", "Walker", "ed@walker.com"),
    (1004, "Anne", "Kretchmar", "annek@noanswer.org"),
]
PRODUCTS = [
    (101, "scooter", "Small 2-wheel scooter", 3.14),
    (102, "car battery", "12V car battery", 8.1),
    (103, "12-pack drill bits", "12-pack of drill bits with sizes ranging from #40 to #3", 0.8),
    (104, "hammer", "12oz carpenter's hammer", 0.75),
    (105, "hammer", "14oz carpenter's hammer", 0.875),
    (106, "hammer", "16oz carpenter's hammer", 1.0),
    (107, "rocks", "box of assorted rocks", 5.3),
    (108, "jacket", "water resistent black wind breaker", 0.1),
    (109, "spare tire", "24 inch spare tire", 22.2),
]
ORDERS = [
    (10001, datetime.date(2016, 1, 16), 1001, 1, 102),
    (10002, datetime.date(2016, 1, 17), 1002, 2, 105),
    (10003, datetime.date(2016, 2, 19), 1002, 2, 106),
    (10004, datetime.date(2016, 2, 21), 1003, 1, 107),
]

PIPELINE = {
    "name": "orders_enriched",
    "lake": "lake",
    "sources": {
        "customers": {"landing": "landing/customers", "primary_key": ["id"], "sequence_by": ["source.lsn"]},
        "products": {"landing": "landing/products", "primary_key": ["id"], "sequence_by": ["source.lsn"]},
        "orders": {"landing": "landing/orders", "primary_key": ["id"], "sequence_by": ["source.lsn"]},
    },
    "left": "orders",
    "joins": [
        {"right": "customers", "foreign_key": ["purchaser"], "type": "left"},
        {"right": "products", "foreign_key": ["product_id"], "type": "inner"},
    ],
    "select": {
        "order_id": "orders.id",
        "order_date": "orders.order_date",
        "quantity": "orders.quantity",
        "customer_id": "orders.purchaser",
        "customer_name": "concat_ws(' ', customers.first_name, customers.last_name)",
        "customer_email": "customers.email",
        "product": "products.name",
        "total_weight": "orders.quantity * products.weight",
    },
    "output": "orders_enriched",
}


def _as_dict(table: str, values: tuple) -> dict:
    return dict(zip(TABLES[table], values, strict=True))


def write_snapshot(writer: EventWriter) -> None:
    """Batch 1: the tutorial's initial rows, as snapshot reads (op ``r``)."""
    lsn = 1000
    for table, rows in (("customers", CUSTOMERS), ("products", PRODUCTS), ("orders", ORDERS)):
        events = []
        for row in rows:
            lsn += 1
            events.append(writer.upsert(table, _as_dict(table, row), lsn, op="r"))
        writer.write(table, events)


def write_changes(writer: EventWriter) -> None:
    """Batch 2: an fk change, a customer rename with fan-out, a delete and an insert."""
    o1 = _as_dict("orders", ORDERS[0])
    writer.write(
        "orders",
        [
            writer.event("orders", "u", before=o1, after={**o1, "purchaser": 1003}, lsn=2001),
            writer.delete("orders", _as_dict("orders", ORDERS[3]), lsn=2002),
            writer.upsert(
                "orders", _as_dict("orders", (10005, datetime.date(2016, 3, 1), 1004, 3, 109)), 2003, "c"
            ),
        ],
    )
    george = _as_dict("customers", CUSTOMERS[1])
    renamed = {**george, "last_name": "Bailey-Jones", "email": "george@bailey-jones.com"}
    writer.write("customers", [writer.event("customers", "u", before=george, after=renamed, lsn=2004)])


def prepare(folder: Path, *, quiet: bool = False, storage: str | None = None) -> Pipeline:
    """Write the pipeline YAML and the first batch under ``folder``; return the pipeline on
    ``storage`` (default: ``CDC_JOIN_STORAGE``, else ``auto``)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pipeline.yml").write_text(yaml.safe_dump(PIPELINE, sort_keys=False))
    writer = EventWriter(folder / "landing", TABLES)
    write_snapshot(writer)
    # The demo's batches are a few dozen events: small work (cdc_join.session.SMALL_WORK_BYTES).
    spark = get_spark("cdc_join-demo", quiet=quiet, storage=storage, small=True, class_archive=True)
    return Pipeline(load_config(folder / "pipeline.yml"), spark, get_storage(spark, storage))


def show_silver(pipeline: Pipeline, title: str) -> None:
    print(f"\n== {title} ==")
    cols = [name for name, _ in pipeline.config.select]
    pipeline.storage.read(pipeline.config.silver_path).select(*cols).orderBy("order_id").show(truncate=False)


def run_demo(directory: str | None = None, *, quiet: bool = False, storage: str | None = None) -> Pipeline:
    """Run the whole demo, printing each step; returns the pipeline for further inspection."""
    folder = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="cdc_join_demo_"))
    print(f"demo folder: {folder}")
    pipeline = prepare(folder, quiet=quiet, storage=storage)
    print(f"storage backend: {pipeline.storage.name}")
    print(pipeline.run().summary())
    show_silver(pipeline, "silver after the snapshot")
    write_changes(EventWriter(folder / "landing", TABLES))
    print("\nlanded batch 2: order 10001 moves to customer 1003, customer 1002 (two orders) is renamed,")
    print("order 10004 is deleted, order 10005 is created")
    print(pipeline.run().summary())
    show_silver(pipeline, "silver after batch 2")
    print(pipeline.verify().summary())
    print(f"\nconfig: {folder / 'pipeline.yml'}  tables: {pipeline.config.lake}")
    return pipeline
