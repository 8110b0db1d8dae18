"""Unit tests of cdc_join.config: the pipeline YAML (no Spark needed)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

from cdc_join.config import JoinConfig, JoinType, PipelineConfig, SourceConfig, load_config, parse_config
from cdc_join.errors import ConfigError, ConfigErrors

DESIGN_EXAMPLE = """\
name: orders_enriched
lake: lake                       # root folder or URI of every Delta table of this pipeline
sources:
  customers:
    landing: landing/customers   # folder of Debezium JSON-lines files
    primary_key: [id]
    sequence_by: [source.lsn]    # Debezium fields, compared in order
  orders:
    landing: landing/orders
    primary_key: [id]
    sequence_by: [source.lsn]
left: orders
joins:
  - right: customers
    foreign_key: [purchaser]     # left columns matching the right primary key, in order
    type: left                   # inner | left
select:                          # output column: Spark SQL expression over source aliases
  order_id: orders.id
  quantity: orders.quantity
  customer_email: customers.email
output: orders_enriched
"""


def _base() -> dict[str, Any]:
    """A fresh, valid config (the README's example) as a dict to mutate per test."""
    return yaml.safe_load(DESIGN_EXAMPLE)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A folder holding the example's landing folders; configs are written into it."""
    (tmp_path / "landing" / "customers").mkdir(parents=True)
    (tmp_path / "landing" / "orders").mkdir(parents=True)
    return tmp_path


def _write(folder: Path, config: dict[str, Any] | str, name: str = "pipeline.yaml") -> Path:
    path = folder / name
    text = config if isinstance(config, str) else yaml.safe_dump(config, sort_keys=False)
    path.write_text(text)
    return path


def _fails(path: Path, key: str | None, *, check_paths: bool = True) -> ConfigError:
    """Load ``path``, expect a ConfigError naming the file and ``key``, and return it."""
    with pytest.raises(ConfigError) as info:
        load_config(path, check_paths=check_paths)
    err = info.value
    assert err.key == key
    assert str(path) in str(err)
    if key is not None:
        assert key in str(err)
    return err


# -- the README's example -------------------------------------------------------------------


def test_design_example_loads_into_typed_dataclasses(project: Path) -> None:
    path = _write(project, DESIGN_EXAMPLE)

    cfg = load_config(path)

    assert isinstance(cfg, PipelineConfig)
    assert cfg.name == "orders_enriched"
    assert cfg.lake == str((project / "lake").resolve())
    assert cfg.left == "orders"
    assert cfg.output == "orders_enriched"
    assert cfg.config_path == path
    assert set(cfg.sources) == {"customers", "orders"}
    orders = cfg.sources["orders"]
    assert orders == SourceConfig(
        name="orders",
        primary_key=("id",),
        sequence_by=("source.lsn",),
        landing=str((project / "landing" / "orders").resolve()),
    )
    assert cfg.left_source is orders
    assert cfg.joins == (
        JoinConfig(
            right="customers",
            foreign_key=("purchaser",),
            type=JoinType.LEFT,
            alias="customers",
            source="orders",
        ),
    )
    assert cfg.joins[0].type is JoinType.LEFT
    assert cfg.select == (
        ("order_id", "orders.id"),
        ("quantity", "orders.quantity"),
        ("customer_email", "customers.email"),
    )
    assert cfg.right_sources == ("customers",)
    assert cfg.join_for_alias("customers") is cfg.joins[0]


def test_relative_paths_resolve_against_the_config_folder_not_the_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "conf"
    (folder / "landing" / "orders").mkdir(parents=True)
    (folder / "landing" / "customers").mkdir(parents=True)
    path = _write(folder, DESIGN_EXAMPLE)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)

    cfg = load_config(path)

    assert cfg.lake == str((folder / "lake").resolve())
    assert cfg.sources["customers"].landing == str((folder / "landing" / "customers").resolve())


def test_relative_config_path_resolves_against_its_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "conf"
    (folder / "landing" / "orders").mkdir(parents=True)
    (folder / "landing" / "customers").mkdir(parents=True)
    _write(folder, DESIGN_EXAMPLE)
    monkeypatch.chdir(tmp_path)

    cfg = load_config("conf/pipeline.yaml")

    assert cfg.lake == str((folder / "lake").resolve())


def test_table_paths_follow_the_design_layout(project: Path) -> None:
    cfg = load_config(_write(project, DESIGN_EXAMPLE))
    lake = str((project / "lake").resolve())
    internal = f"{lake}/_cdc_join/orders_enriched"

    assert cfg.bronze_path("orders") == f"{lake}/bronze/orders"
    assert cfg.bronze_path("customers") == f"{lake}/bronze/customers"
    assert cfg.silver_path == f"{lake}/silver/orders_enriched"
    assert cfg.internal_root == internal
    assert cfg.state_path("orders") == f"{internal}/state/orders"
    assert cfg.subscription_path(cfg.joins[0]) == f"{internal}/subscription/customers"
    assert cfg.quarantine_path == f"{internal}/quarantine"
    assert cfg.ingest_log_path == f"{internal}/ingest_log"
    assert cfg.runs_path == f"{internal}/runs"
    assert cfg.quality_path == f"{internal}/quality_results"
    assert cfg.lock_path == f"{internal}/_lock"


def test_silver_path_uses_output_and_internal_root_uses_pipeline_name(project: Path) -> None:
    raw = _base()
    raw["name"] = "pipe_a"
    raw["output"] = "enriched"
    cfg = load_config(_write(project, raw))

    assert cfg.silver_path.endswith("/silver/enriched")
    assert cfg.internal_root.endswith("/_cdc_join/pipe_a")


@pytest.mark.parametrize(
    "lake", ["s3://bucket/lake", "s3://bucket/lake/", "abfss://c@acct.dfs.core.windows.net/x"]
)
def test_uri_lake_is_kept_as_is(project: Path, lake: str) -> None:
    raw = _base()
    raw["lake"] = lake
    cfg = load_config(_write(project, raw))

    assert cfg.lake == lake
    root = lake.rstrip("/")
    assert cfg.bronze_path("orders") == f"{root}/bronze/orders"
    assert cfg.silver_path == f"{root}/silver/orders_enriched"
    assert cfg.internal_root == f"{root}/_cdc_join/orders_enriched"


@pytest.mark.parametrize("lake", ["/Volumes/main/cdc/lake", "/dbfs/mnt/lake", "s3://bucket/lake"])
def test_no_lock_file_where_creating_one_is_not_atomic(project: Path, lake: str) -> None:
    # Object stores and their FUSE mounts: the checkpoint commit alone keeps runs apart there.
    raw = _base()
    raw["lake"] = lake
    assert load_config(_write(project, raw)).lock_path is None


def test_absolute_lake_path_is_kept_as_is(project: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    lake = str(tmp_path_factory.mktemp("abs_lake"))
    raw = _base()
    raw["lake"] = lake
    assert load_config(_write(project, raw)).lake == lake


def test_loading_touches_no_table(project: Path) -> None:
    load_config(_write(project, DESIGN_EXAMPLE))

    assert not (project / "lake").exists()
    assert sorted(p.name for p in project.iterdir()) == ["landing", "pipeline.yaml"]


def test_select_keeps_the_yaml_order(project: Path) -> None:
    raw = _base()
    raw["select"] = {
        "zeta": "orders.z",
        "alpha": "orders.a",
        "mid": "customers.m",
        "beta": "orders.b",
    }
    cfg = load_config(_write(project, raw))

    assert [c for c, _ in cfg.select] == ["zeta", "alpha", "mid", "beta"]


def test_all_dataclasses_are_frozen(project: Path) -> None:
    cfg = load_config(_write(project, DESIGN_EXAMPLE))

    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.name = "other"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.sources["orders"].primary_key = ("x",)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.joins[0].alias = "other"  # type: ignore[misc]
    assert isinstance(cfg.joins, tuple)
    assert isinstance(cfg.select, tuple)
    assert all(isinstance(item, tuple) for item in cfg.select)


def test_check_paths_false_skips_the_landing_folder_check(tmp_path: Path) -> None:
    path = _write(tmp_path, DESIGN_EXAMPLE)  # no landing folders exist

    cfg = load_config(path, check_paths=False)

    assert cfg.sources["orders"].landing == str((tmp_path / "landing" / "orders").resolve())


def test_uri_landing_folder_is_not_checked_and_kept_as_is(project: Path) -> None:
    raw = _base()
    raw["sources"]["orders"]["landing"] = "s3://bucket/landing/orders"
    cfg = load_config(_write(project, raw))

    assert cfg.sources["orders"].landing == "s3://bucket/landing/orders"


# -- joins -----------------------------------------------------------------------------------


def test_join_type_defaults_to_inner(project: Path) -> None:
    raw = _base()
    del raw["joins"][0]["type"]
    cfg = load_config(_write(project, raw))

    assert cfg.joins[0].type is JoinType.INNER


@pytest.mark.parametrize(("text", "expected"), [("inner", JoinType.INNER), ("LEFT", JoinType.LEFT)])
def test_join_type_is_parsed_case_insensitively(project: Path, text: str, expected: JoinType) -> None:
    raw = _base()
    raw["joins"][0]["type"] = text
    assert load_config(_write(project, raw)).joins[0].type is expected


def test_alias_defaults_to_the_right_source_name(project: Path) -> None:
    cfg = load_config(_write(project, DESIGN_EXAMPLE))

    assert cfg.joins[0].alias == "customers"
    assert JoinConfig(right="customers", foreign_key=("purchaser",)).alias == "customers"


def test_same_right_source_joined_twice_under_distinct_aliases(project: Path) -> None:
    raw = _base()
    raw["joins"] = [
        {"right": "customers", "foreign_key": ["purchaser"], "type": "left", "as": "buyer"},
        {"right": "customers", "foreign_key": ["recipient"], "as": "recipient"},
    ]
    raw["select"] = {
        "order_id": "orders.id",
        "buyer_email": "buyer.email",
        "recipient_email": "recipient.email",
    }
    cfg = load_config(_write(project, raw))

    assert [j.alias for j in cfg.joins] == ["buyer", "recipient"]
    assert [j.type for j in cfg.joins] == [JoinType.LEFT, JoinType.INNER]
    assert cfg.right_sources == ("customers",)
    assert cfg.join_for_alias("recipient").foreign_key == ("recipient",)
    assert cfg.subscription_path(cfg.joins[0]) != cfg.subscription_path(cfg.joins[1])
    with pytest.raises(KeyError):
        cfg.join_for_alias("customers")


def test_composite_foreign_key_matching_composite_primary_key_loads(project: Path) -> None:
    raw = _base()
    raw["sources"]["customers"]["primary_key"] = ["tenant", "id"]
    raw["joins"][0]["foreign_key"] = ["tenant", "purchaser"]
    cfg = load_config(_write(project, raw))

    assert cfg.joins[0].foreign_key == ("tenant", "purchaser")
    assert cfg.sources["customers"].primary_key == ("tenant", "id")


# -- sources ---------------------------------------------------------------------------------


def test_bronze_source_is_accepted_instead_of_landing(project: Path) -> None:
    (project / "existing" / "customers").mkdir(parents=True)
    raw = _base()
    raw["sources"]["customers"] = {"bronze": "existing/customers", "primary_key": ["id"]}
    cfg = load_config(_write(project, raw))

    customers = cfg.sources["customers"]
    assert customers.landing is None
    assert customers.bronze == str((project / "existing" / "customers").resolve())
    assert cfg.bronze_path("customers") == customers.bronze
    assert cfg.bronze_path("orders") == f"{cfg.lake}/bronze/orders"


def test_bronze_source_given_as_uri_is_kept_as_is(project: Path) -> None:
    raw = _base()
    raw["sources"]["orders"] = {"bronze": "s3://other/bronze/orders", "primary_key": ["id"]}
    cfg = load_config(_write(project, raw))

    assert cfg.bronze_path("orders") == "s3://other/bronze/orders"


@pytest.mark.parametrize(
    ("sequence_by", "expected"),
    [
        ("source.lsn", ("source.lsn",)),
        (["source.lsn"], ("source.lsn",)),
        (["source.ts_ms", "source.lsn"], ("source.ts_ms", "source.lsn")),
        (
            ["source.change_lsn", "source.commit_lsn", "source.event_serial_no"],
            ("source.change_lsn", "source.commit_lsn", "source.event_serial_no"),
        ),
        (["ts_ms"], ("ts_ms",)),
    ],
)
def test_sequence_by_accepts_a_string_or_a_list_of_dotted_paths(
    project: Path, sequence_by: Any, expected: tuple[str, ...]
) -> None:
    raw = _base()
    raw["sources"]["orders"]["sequence_by"] = sequence_by
    assert load_config(_write(project, raw)).sources["orders"].sequence_by == expected


def test_sequence_by_defaults_to_empty(project: Path) -> None:
    raw = _base()
    del raw["sources"]["orders"]["sequence_by"]
    assert load_config(_write(project, raw)).sources["orders"].sequence_by == ()


def test_primary_key_given_as_a_string_is_one_column(project: Path) -> None:
    raw = _base()
    raw["sources"]["orders"]["primary_key"] = "id"
    assert load_config(_write(project, raw)).sources["orders"].primary_key == ("id",)


@pytest.mark.parametrize("connector", ["postgresql", "mysql", "sqlserver"])
def test_known_connectors_are_accepted(project: Path, connector: str) -> None:
    raw = _base()
    raw["sources"]["orders"]["connector"] = connector
    assert load_config(_write(project, raw)).sources["orders"].connector == connector


def test_connector_defaults_to_none(project: Path) -> None:
    assert load_config(_write(project, DESIGN_EXAMPLE)).sources["orders"].connector is None


def test_description_and_quality_are_accepted(project: Path) -> None:
    raw = _base()
    raw["description"] = "orders with the buyer's email"
    raw["quality"] = {"max_null_fraction": 0.1}
    cfg = load_config(_write(project, raw))

    assert cfg.quality == {"max_null_fraction": 0.1}


# -- select expressions ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "expr",
    [
        "'a.b'",
        "concat('x.y', orders.a)",
        '"quoted.text"',
        "'it''s a.b'",
        "concat(orders.a, customers.b)",
        "orders.amount * 1.5",
        "round(1.25, 1)",
        "orders.payload.nested.field",
        "`orders`.`id`",
        "orders . id",
        "coalesce(customers.email, 'none@x.org')",
        "CASE WHEN orders.qty > 0.5 THEN 'big.order' ELSE customers.tier END",
        "transform(orders.items, x -> x.price * 2)",
        "aggregate(orders.items, 0D, (acc, x) -> acc + x.price)",
        "current_timestamp()",
    ],
)
def test_select_expression_with_literals_calls_and_decimals_is_accepted(project: Path, expr: str) -> None:
    raw = _base()
    raw["select"]["value"] = expr
    cfg = load_config(_write(project, raw))

    assert cfg.select[-1] == ("value", expr)


# -- errors: every one names the file and the dotted key -------------------------------------


def test_unknown_left_source_names_key_and_file(project: Path) -> None:
    raw = _base()
    raw["left"] = "order"
    err = _fails(_write(project, raw), "left")
    assert "'order'" in str(err)


def test_unknown_join_right_source_names_key_and_file(project: Path) -> None:
    raw = _base()
    raw["joins"][0]["right"] = "customer"
    err = _fails(_write(project, raw), "joins[0].right")
    assert "'customer'" in str(err)


def test_second_join_with_unknown_right_is_indexed(project: Path) -> None:
    raw = _base()
    raw["joins"].append({"right": "payments", "foreign_key": ["payment_id"]})
    _fails(_write(project, raw), "joins[1].right")


def test_join_of_the_left_source_to_itself_names_key_and_file(project: Path) -> None:
    raw = _base()
    raw["joins"][0]["right"] = "orders"
    _fails(_write(project, raw), "joins[0].right")


def test_foreign_key_shorter_than_composite_primary_key_names_key_and_file(project: Path) -> None:
    raw = _base()
    raw["sources"]["customers"]["primary_key"] = ["tenant", "id"]
    err = _fails(_write(project, raw), "joins[0].foreign_key")
    assert "tenant" in str(err)


def test_foreign_key_longer_than_primary_key_names_key_and_file(project: Path) -> None:
    raw = _base()
    raw["joins"][0]["foreign_key"] = ["tenant", "purchaser"]
    _fails(_write(project, raw), "joins[0].foreign_key")


def test_foreign_key_listing_a_column_twice_names_key_and_file(project: Path) -> None:
    raw = _base()
    raw["sources"]["customers"]["primary_key"] = ["tenant", "id"]
    raw["joins"][0]["foreign_key"] = ["purchaser", "purchaser"]
    _fails(_write(project, raw), "joins[0].foreign_key")


def test_duplicate_yaml_key_in_select_names_key_and_file(project: Path) -> None:
    text = DESIGN_EXAMPLE.replace(
        "  customer_email: customers.email\n",
        "  customer_email: customers.email\n  order_id: customers.id\n",
    )
    err = _fails(_write(project, text), "select.order_id")
    assert "duplicate" in str(err)
    assert "line 21" in str(err)


def test_case_insensitive_duplicate_output_columns_name_key_and_file(project: Path) -> None:
    raw = _base()
    raw["select"]["Order_ID"] = "customers.id"
    err = _fails(_write(project, raw), "select.Order_ID")
    assert "'order_id'" in str(err)


def test_duplicate_yaml_key_in_sources_names_key_and_file(project: Path) -> None:
    text = DESIGN_EXAMPLE.replace(
        "left: orders\n", "  orders:\n    landing: landing/orders\n    primary_key: [id]\nleft: orders\n"
    )
    _fails(_write(project, text), "sources.orders")


def test_duplicate_yaml_key_inside_a_join_names_key_and_file(project: Path) -> None:
    text = DESIGN_EXAMPLE.replace("    type: left ", "    right: orders\n    type: left ")
    _fails(_write(project, text), "joins[0].right")


def test_duplicate_top_level_yaml_key_names_key_and_file(project: Path) -> None:
    _fails(_write(project, DESIGN_EXAMPLE + "left: customers\n"), "left")


def test_missing_landing_folder_names_key_and_file(project: Path) -> None:
    raw = _base()
    raw["sources"]["orders"]["landing"] = "landing/ordres"
    err = _fails(_write(project, raw), "sources.orders.landing")
    assert str((project / "landing" / "ordres").resolve()) in str(err)


@pytest.mark.parametrize("join_type", ["outer", "full", "right", "left_outer", 1, True])
def test_bad_join_type_names_key_and_file(project: Path, join_type: Any) -> None:
    raw = _base()
    raw["joins"][0]["type"] = join_type
    _fails(_write(project, raw), "joins[0].type")


def _chain(project: Path) -> dict[str, Any]:
    """The example with ``nations`` joined from ``customers`` (a chain of two hops)."""
    (project / "landing" / "nations").mkdir(exist_ok=True)
    raw = _base()
    raw["sources"]["nations"] = {"landing": "landing/nations", "primary_key": ["id"]}
    nations = {"right": "nations", "from": "customers", "foreign_key": ["nation_id"], "type": "left"}
    raw["joins"].append(nations)
    raw["select"]["nation"] = "nations.name"
    return raw


def test_a_chained_join_names_the_source_that_holds_its_foreign_key(project: Path) -> None:
    cfg = load_config(_write(project, _chain(project)))
    customers, nations = cfg.joins
    assert (customers.source, nations.source) == ("orders", "customers")
    assert cfg.hop_left(nations) is cfg.sources["customers"]
    assert cfg.hop_sources == ("orders", "customers")
    assert cfg.hops_from("customers") == (nations,)
    assert cfg.chained


def test_a_join_from_the_left_source_named_explicitly_is_no_chain(project: Path) -> None:
    raw = _base()
    raw["joins"][0]["from"] = "orders"
    cfg = load_config(_write(project, raw))
    assert cfg.joins[0].source == "orders" and not cfg.chained


def test_from_must_name_a_source_joined_earlier(project: Path) -> None:
    raw = _chain(project)
    raw["joins"].reverse()  # nations before customers
    err = _fails(_write(project, raw), "joins[0].from")
    assert "'customers' is not joined before this join" in str(err)


def test_from_naming_an_unknown_alias_lists_the_ones_it_may_name(project: Path) -> None:
    raw = _chain(project)
    raw["joins"][1]["from"] = "customer"
    err = _fails(_write(project, raw), "joins[1].from")
    assert "'orders', 'customers'" in str(err)


def test_a_source_joined_twice_in_a_chain_needs_an_alias(project: Path) -> None:
    raw = _chain(project)
    raw["joins"].append({"right": "nations", "from": "customers", "foreign_key": ["home_nation_id"]})
    err = _fails(_write(project, raw), "joins[2]")
    assert "alias 'nations' is used twice" in str(err)


def _collect(project: Path) -> dict[str, Any]:
    """Customers as the left source with their orders nested (``type: collect``)."""
    raw = _base()
    raw["left"] = "customers"
    raw["joins"] = [{"right": "orders", "type": "collect", "foreign_key": ["purchaser"], "as": "purchases"}]
    raw["select"] = {"id": "customers.id", "orders": "purchases", "n": "size(purchases)"}
    return raw


def test_a_collect_join_nests_the_children_whose_foreign_key_names_the_left_key(project: Path) -> None:
    cfg = load_config(_write(project, _collect(project)))
    (join,) = cfg.joins
    assert join.collects and join.max_children == 10_000
    assert cfg.hop_left(join) is cfg.sources["orders"]  # the children hold the foreign key
    assert cfg.hop_sources == ("customers", "orders")
    assert not cfg.chained


def test_a_collect_foreign_key_must_be_as_long_as_the_parent_key(project: Path) -> None:
    raw = _collect(project)
    raw["joins"][0]["foreign_key"] = ["purchaser", "id"]
    err = _fails(_write(project, raw), "joins[0].foreign_key")
    assert "'customers' has a primary key of 1" in str(err)


def test_max_children_must_be_a_positive_number_on_a_collect_join(project: Path) -> None:
    raw = _collect(project)
    raw["joins"][0]["max_children"] = 0
    _fails(_write(project, raw), "joins[0].max_children")
    raw = _base()
    raw["joins"][0]["max_children"] = 5
    err = _fails(_write(project, raw), "joins[0].max_children")
    assert "collect join only" in str(err)


def test_no_join_hangs_off_a_collect_join(project: Path) -> None:
    raw = _collect(project)
    raw["sources"]["nations"] = {"landing": "landing/orders", "primary_key": ["id"]}
    raw["joins"].append({"right": "nations", "from": "purchases", "foreign_key": ["nation_id"]})
    err = _fails(_write(project, raw), "joins[1].from")
    assert "'purchases' is a collect join" in str(err)


@pytest.mark.parametrize("key", ["name", "lake", "sources", "left", "select", "output"])
def test_missing_required_top_level_key_names_key_and_file(project: Path, key: str) -> None:
    raw = _base()
    del raw[key]
    _fails(_write(project, raw), key)


@pytest.mark.parametrize("key", ["name", "lake", "left", "output"])
def test_empty_required_top_level_value_names_key_and_file(project: Path, key: str) -> None:
    raw = _base()
    raw[key] = None
    _fails(_write(project, raw), key)


def test_missing_primary_key_names_key_and_file(project: Path) -> None:
    raw = _base()
    del raw["sources"]["orders"]["primary_key"]
    _fails(_write(project, raw), "sources.orders.primary_key")


def test_empty_primary_key_names_key_and_file(project: Path) -> None:
    raw = _base()
    raw["sources"]["orders"]["primary_key"] = []
    _fails(_write(project, raw), "sources.orders.primary_key")


@pytest.mark.parametrize("key", ["right", "foreign_key"])
def test_missing_required_join_key_names_key_and_file(project: Path, key: str) -> None:
    raw = _base()
    del raw["joins"][0][key]
    _fails(_write(project, raw), f"joins[0].{key}")


@pytest.mark.parametrize(
    ("where", "typo", "key"),
    [
        ((), "joinz", "joinz"),
        (("sources", "orders"), "primary_keys", "sources.orders.primary_keys"),
        (("sources", "orders"), "sequence", "sources.orders.sequence"),
        (("joins", 0), "alias", "joins[0].alias"),
        (("joins", 0), "foreign_keys", "joins[0].foreign_keys"),
    ],
)
def test_unknown_key_names_key_and_file(project: Path, where: tuple[Any, ...], typo: str, key: str) -> None:
    raw = _base()
    node: Any = raw
    for part in where:
        node = node[part]
    node[typo] = ["x"]
    _fails(_write(project, raw), key)


def test_source_with_both_landing_and_bronze_names_key_and_file(project: Path) -> None:
    raw = _base()
    raw["sources"]["orders"]["bronze"] = "existing/orders"
    err = _fails(_write(project, raw), "sources.orders")
    assert "landing" in str(err)
    assert "bronze" in str(err)


def test_source_with_neither_landing_nor_bronze_names_key_and_file(project: Path) -> None:
    raw = _base()
    del raw["sources"]["orders"]["landing"]
    _fails(_write(project, raw), "sources.orders")


@pytest.mark.parametrize(
    ("edit", "key"),
    [
        (lambda r: r.update(name="orders-enriched"), "name"),
        (lambda r: r.update(name="1st"), "name"),
        (lambda r: r.update(output="silver table"), "output"),
        (
            lambda r: r["sources"].update(
                {"my-source": {"landing": "landing/orders", "primary_key": ["id"]}}
            ),
            "sources.my-source",
        ),
        (lambda r: r["joins"][0].update({"as": "bad alias"}), "joins[0].as"),
        (lambda r: r["select"].update({"order id": "orders.id"}), "select.order id"),
        (lambda r: r["sources"]["orders"].update(primary_key=["id;drop"]), "sources.orders.primary_key[0]"),
        (lambda r: r["sources"]["orders"].update(primary_key=["id", ""]), "sources.orders.primary_key[1]"),
        (lambda r: r["joins"][0].update(foreign_key=["a.b"]), "joins[0].foreign_key[0]"),
        (
            lambda r: r["sources"]["orders"].update(sequence_by=["source..lsn"]),
            "sources.orders.sequence_by[0]",
        ),
        (
            lambda r: r["sources"]["orders"].update(sequence_by=["source.lsn-x"]),
            "sources.orders.sequence_by[0]",
        ),
    ],
)
def test_invalid_name_names_key_and_file(project: Path, edit: Any, key: str) -> None:
    raw = _base()
    edit(raw)
    _fails(_write(project, raw), key)


def test_empty_sequence_by_list_names_key_and_file(project: Path) -> None:
    raw = _base()
    raw["sources"]["orders"]["sequence_by"] = []
    _fails(_write(project, raw), "sources.orders.sequence_by")


@pytest.mark.parametrize("connector", ["postgres", "informix", "PostgreSQL", 5])
def test_unknown_connector_names_key_and_file(project: Path, connector: Any) -> None:
    raw = _base()
    raw["sources"]["orders"]["connector"] = connector
    _fails(_write(project, raw), "sources.orders.connector")


@pytest.mark.parametrize(
    "expr",
    ["payments.amount", "concat(orders.a, payment.b)", "coalesce('x.y', cust.email)"],
)
def test_select_referring_to_an_unknown_alias_names_key_and_file(project: Path, expr: str) -> None:
    raw = _base()
    raw["select"]["value"] = expr
    _fails(_write(project, raw), "select.value")


def test_select_referring_to_a_right_source_by_name_when_aliased_names_key_and_file(project: Path) -> None:
    raw = _base()
    raw["joins"][0]["as"] = "buyer"
    _fails(_write(project, raw), "select.customer_email")


def test_a_source_that_is_not_joined_names_key_and_file(project: Path) -> None:
    # It would be ingested and kept in state for nothing, and stop every run until its first event.
    raw = _base()
    raw["joins"] = []
    with pytest.raises(ConfigErrors) as info:
        load_config(_write(project, raw))
    keys = [p.key for p in info.value.problems]
    assert keys == ["sources.customers", "select.customer_email"]
    assert "not joined" in str(info.value.problems[0])


# -- several mistakes: all reported at once --------------------------------------------------


def test_every_mistake_is_reported_at_once_each_naming_its_key(project: Path) -> None:
    raw = _base()
    raw["sources"]["orders"]["connector"] = "informix"
    raw["sources"]["customers"]["primary_key"] = []
    raw["joins"][0]["type"] = "outer"
    raw["select"]["_hidden"] = "orders.id"
    raw["select"]["amount"] = "orders.amount + reflect('java.lang.Runtime', 'exit')"
    raw["on_quarantine"] = "ignore"
    raw["tombstone_horizon_days"] = -1
    raw["colour"] = "blue"
    path = _write(project, raw)
    with pytest.raises(ConfigErrors) as info:
        load_config(path)
    err = info.value
    assert sorted(p.key for p in err.problems) == sorted(
        [
            "colour",
            "sources.customers.primary_key",
            "sources.orders.connector",
            "joins[0].type",
            "select._hidden",
            "select.amount",
            "on_quarantine",
            "tombstone_horizon_days",
        ]
    )
    text = str(err)
    assert text.startswith(f"{path}: 8 problems:")
    assert all(f"\n  {p.key}: " in text for p in err.problems)


def test_a_mistake_is_not_reported_again_through_what_depends_on_it(project: Path) -> None:
    # An unknown left source: the select list's `orders.…` is not blamed for it.
    raw = _base()
    raw["left"] = "order"
    err = _fails(_write(project, raw), "left")
    assert not isinstance(err, ConfigErrors)
    # A broken source: joins naming it are not "unknown source" too.
    raw = _base()
    raw["sources"]["customers"]["connector"] = "informix"
    err = _fails(_write(project, raw), "sources.customers.connector")
    assert not isinstance(err, ConfigErrors)


def test_the_cli_prints_every_config_mistake_and_exits_2(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from cdc_join.cli.main import CONFIG_ERROR, main

    raw = _base()
    raw["joins"][0]["type"] = "outer"
    raw["output"] = "orders enriched"
    path = _write(project, raw)
    assert main(["run", str(path)]) == CONFIG_ERROR
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"cdc-join: error: {path}: 2 problems:"
    assert err[1] == "    joins[0].type: must be 'inner', 'left' or 'collect', got 'outer'"
    assert err[2] == "    output: 'orders enriched' is not a valid name (letters, digits, _)"
    assert err[3] == "  next: fix the pipeline YAML and run again"


def test_select_referring_to_an_alias_that_is_not_joined_names_key_and_file(project: Path) -> None:
    raw = _base()
    raw["select"]["name"] = "products.name"
    _fails(_write(project, raw), "select.name")


@pytest.mark.parametrize("column", ["_op", "_cdc_seq", "__x"])
def test_output_column_starting_with_underscore_names_key_and_file(project: Path, column: str) -> None:
    raw = _base()
    raw["select"][column] = "orders.id"
    err = _fails(_write(project, raw), f"select.{column}")
    assert "reserved" in str(err)


@pytest.mark.parametrize("value", [{}, None])
def test_empty_select_names_key_and_file(project: Path, value: Any) -> None:
    raw = _base()
    raw["select"] = value
    _fails(_write(project, raw), "select")


@pytest.mark.parametrize("value", [1, "", None])
def test_non_string_select_expression_names_key_and_file(project: Path, value: Any) -> None:
    raw = _base()
    raw["select"]["order_id"] = value
    _fails(_write(project, raw), "select.order_id")


def test_same_right_source_joined_twice_without_as_names_key_and_file(project: Path) -> None:
    raw = _base()
    raw["joins"].append({"right": "customers", "foreign_key": ["recipient"]})
    err = _fails(_write(project, raw), "joins[1]")
    assert "'customers'" in str(err)


def test_two_joins_with_the_same_as_names_key_and_file(project: Path) -> None:
    raw = _base()
    raw["joins"] = [
        {"right": "customers", "foreign_key": ["purchaser"], "as": "c"},
        {"right": "customers", "foreign_key": ["recipient"], "as": "c"},
    ]
    raw["select"] = {"order_id": "orders.id"}
    _fails(_write(project, raw), "joins[1]")


def test_join_alias_equal_to_the_left_source_names_key_and_file(project: Path) -> None:
    raw = _base()
    raw["joins"][0]["as"] = "orders"
    _fails(_write(project, raw), "joins[0]")


@pytest.mark.parametrize(("key", "value"), [("sources", []), ("sources", {}), ("joins", {"right": "x"})])
def test_wrongly_shaped_section_names_key_and_file(project: Path, key: str, value: Any) -> None:
    raw = _base()
    raw[key] = value
    _fails(_write(project, raw), key)


def test_source_settings_that_are_not_a_mapping_name_key_and_file(project: Path) -> None:
    raw = _base()
    raw["sources"]["orders"] = "landing/orders"
    _fails(_write(project, raw), "sources.orders")


def test_join_that_is_not_a_mapping_names_key_and_file(project: Path) -> None:
    raw = _base()
    raw["joins"] = ["customers"]
    _fails(_write(project, raw), "joins[0]")


def test_quality_that_is_not_a_mapping_names_key_and_file(project: Path) -> None:
    raw = _base()
    raw["quality"] = ["x"]
    _fails(_write(project, raw), "quality")


@pytest.mark.parametrize("text", ["", "- a\n- b\n", "just a string\n"])
def test_document_that_is_not_a_mapping_names_the_file(project: Path, text: str) -> None:
    _fails(_write(project, text), None)


def test_invalid_yaml_names_the_file(project: Path) -> None:
    err = _fails(_write(project, "name: [unclosed\n"), None)
    assert "YAML" in str(err)


def test_missing_config_file_names_the_file(tmp_path: Path) -> None:
    _fails(tmp_path / "nope.yaml", None)


def test_error_is_raised_with_check_paths_false_too(tmp_path: Path) -> None:
    raw = _base()
    raw["left"] = "nobody"
    _fails(_write(tmp_path, raw), "left", check_paths=False)


# -- tables by name (delta-spark backend) ----------------------------------------------------


def _by_name_config(tmp_path, **extra):
    (tmp_path / "landing/orders").mkdir(parents=True, exist_ok=True)
    (tmp_path / "landing/customers").mkdir(parents=True, exist_ok=True)
    text = """
name: enriched
tables: main.cdc
sources:
  orders: {landing: landing/orders, primary_key: [id]}
  customers: {bronze: main.raw.customers_bronze, primary_key: [id]}
left: orders
joins: [{right: customers, foreign_key: [purchaser]}]
select: {order_id: orders.id}
output: orders_enriched
"""
    path = tmp_path / "p.yml"
    path.write_text(text + "".join(f"{k}: {v}\n" for k, v in extra.items()))
    return load_config(path)


def test_tables_key_addresses_every_table_by_name_in_that_schema(tmp_path):
    cfg = _by_name_config(tmp_path)
    assert cfg.tables == "main.cdc"
    assert cfg.bronze_path("orders") == "main.cdc.bronze_orders"
    assert cfg.bronze_path("customers") == "main.raw.customers_bronze"
    assert cfg.silver_path == "main.cdc.orders_enriched"
    assert cfg.state_path("orders") == "main.cdc.cdc_join__enriched__state__orders"
    assert cfg.subscription_path(cfg.joins[0]) == "main.cdc.cdc_join__enriched__subscription__customers"
    assert cfg.runs_path == "main.cdc.cdc_join__enriched__runs"
    assert cfg.lock_path is None


def test_a_given_lake_replaces_tables_and_a_file_may_then_have_neither(tmp_path):
    # The CLI's --lake: a Databricks pipeline YAML (tables by name) run against a local folder.
    cfg = _by_name_config(tmp_path)
    lake = str(tmp_path / "elsewhere")
    moved = load_config(cfg.config_path, lake=lake + "/")
    assert moved.tables is None and moved.lake == lake
    assert moved.silver_path == f"{lake}/silver/orders_enriched"
    assert moved.bronze_path("orders") == f"{lake}/bronze/orders"
    assert moved.bronze_path("customers") == "main.raw.customers_bronze"  # a source's own bronze stays
    raw = _base()
    del raw["lake"]
    path = _write(tmp_path, raw)
    (tmp_path / "landing" / "customers").mkdir(parents=True, exist_ok=True)
    assert load_config(path, lake=lake).silver_path == f"{lake}/silver/orders_enriched"
    assert load_config(path, tables="dev.x").silver_path == "dev.x.orders_enriched"
    _fails(path, "lake")  # without either, the file must name one


def test_given_tables_replace_the_files_and_are_checked(tmp_path):
    cfg = _by_name_config(tmp_path)
    assert load_config(cfg.config_path, tables="dev.cdc").silver_path == "dev.cdc.orders_enriched"
    with pytest.raises(ConfigError) as e:
        load_config(cfg.config_path, tables="a.b.c.d")
    assert e.value.key == "tables"


def test_bad_tables_value_names_the_key(tmp_path):
    with pytest.raises(ConfigError) as e:
        _bad_tables(tmp_path)
    assert e.value.key == "tables"
    assert "bad.yml" in str(e.value)


def _bad_tables(tmp_path):
    (tmp_path / "landing").mkdir(parents=True, exist_ok=True)
    path = tmp_path / "bad.yml"
    path.write_text(
        "name: p\ntables: a.b.c.d\nsources: {o: {landing: landing, primary_key: [id]}}\n"
        "left: o\nselect: {x: o.id}\noutput: out\n"
    )
    return load_config(path)


def test_delta_rs_backend_refuses_table_names_with_a_clear_error():
    from cdc_join.errors import StorageError
    from cdc_join.storage.delta_rs import table_root

    with pytest.raises(StorageError, match="delta-spark"):
        table_root("main.cdc.orders_enriched")


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("(SELECT max(id) FROM other.secret_table)", "subquery"),
        ("orders.id IN (select id from t)", "subquery"),
        ("reflect('java.lang.Runtime', 'getRuntime')", r"reflect\(\)"),
        ("JAVA_METHOD('java.lang.System', 'exit', 1)", r"JAVA_METHOD\(\)"),
        ("concat(orders.id, secret('scope', 'key'))", r"secret\(\)"),
        # However a call is written, it is the same call to Spark's lexer:
        ("`reflect`('java.lang.Runtime', 'getRuntime')", r"reflect\(\)"),
        ("reflect/* a comment */('java.lang.Runtime', 'getRuntime')", r"reflect\(\)"),
        ("reflect -- a comment\n ('java.lang.Runtime', 'getRuntime')", r"reflect\(\)"),
        ("IDENTIFIER('reflect')('java.lang.Runtime', 'getRuntime')", r"IDENTIFIER\(\)"),
        ("concat(r'\\', java_method('java.lang.System', 'exit', 1), '\\\\')", r"java_method\(\)"),
        ("concat('it\\'s', reflect('a', 'b'))", r"reflect\(\)"),
        ("main.tools.run_shell(orders.id)", r"stored function \(main\.tools\.run_shell\(\)\)"),
        ("orders.id IN (TABLE secrets)", r"subquery \(TABLE\)"),
    ],
)
def test_select_expressions_may_not_run_code_or_read_other_data(tmp_path, expression, message):
    raw = {
        "name": "p",
        "lake": "lake",
        "sources": {"orders": {"landing": "landing/orders", "primary_key": ["id"]}},
        "left": "orders",
        "select": {"x": expression},
        "output": "out",
    }
    with pytest.raises(ConfigError, match=rf"select\.x: may not .*{message}"):
        parse_config(raw, base_dir=tmp_path, check_paths=False)


def test_an_expression_spark_cannot_read_names_the_key(tmp_path):
    raw = {
        "name": "p",
        "lake": "lake",
        "sources": {"orders": {"landing": "landing/orders", "primary_key": ["id"]}},
        "left": "orders",
        "select": {"x": "concat('unclosed, orders.id)", "y": "orders.id /* open"},
        "output": "out",
    }
    with pytest.raises(ConfigErrors) as info:
        parse_config(raw, base_dir=tmp_path, check_paths=False)
    assert [str(p) for p in info.value.problems] == [
        "select.x: is not a valid expression: a string literal ('…') is not closed",
        "select.y: is not a valid expression: a comment (/* … */) is not closed",
    ]


def test_words_like_select_inside_strings_and_names_are_fine(tmp_path):
    raw = {
        "name": "p",
        "lake": "lake",
        "sources": {"orders": {"landing": "landing/orders", "primary_key": ["id"]}},
        "left": "orders",
        "select": {
            "x": "concat('select ', orders.selected, ' reflect(')",
            "y": "orders.reflection",
            "z": "concat(r'C:\\dir\\', orders.table, /* reflect( */ 'it''s') -- java_method(",
            "w": "transform(orders.items, x -> x.price * 2)",
        },
        "output": "out",
    }
    assert len(parse_config(raw, base_dir=tmp_path, check_paths=False).select) == 4


@pytest.mark.parametrize("hours", [0, -1, "24", True])
def test_landing_lookback_must_be_a_positive_number_of_hours(project: Path, hours: Any) -> None:
    raw = _base()
    raw["landing_lookback_hours"] = hours
    with pytest.raises(ConfigError, match=r"landing_lookback_hours.*positive number of hours"):
        load_config(_write(project, raw))
    raw["landing_lookback_hours"] = 24
    assert load_config(_write(project, raw)).landing_lookback_hours == 24.0


@pytest.mark.parametrize("value", ["no", "false", 0, None])
def test_silver_change_feed_must_be_true_or_false(project: Path, value: Any) -> None:
    raw = _base()
    assert load_config(_write(project, raw)).silver_change_feed is True  # on unless turned off
    raw["silver_change_feed"] = value
    with pytest.raises(ConfigError, match=r"silver_change_feed.*must be true or false"):
        load_config(_write(project, raw))
    raw["silver_change_feed"] = False
    assert load_config(_write(project, raw)).silver_change_feed is False
