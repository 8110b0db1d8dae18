"""The Databricks bundle, checked without a workspace: ``databricks.yml`` and ``resources/*.yml``
parse and load into Databricks' own typed bundle models, every reference resolves, every task's
entry point exists and accepts its parameters (job parameters filled in), and the entry points
work locally.

``databricks bundle validate`` needs a workspace and the ``databricks`` CLI; these tests check
the same structure from the files alone.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from cdc_join.cli import main as cli

ROOT = Path(__file__).resolve().parents[2]
BUNDLE = ROOT / "databricks.yml"
FILE_PATH = "/Workspace/Users/someone/.bundle/cdc_join/dev/files"  # what ${workspace.file_path} becomes
_REFERENCE = re.compile(r"\$\{([^}]+)\}")
_JOB_PARAMETER = re.compile(r"\{\{job\.parameters\.([A-Za-z_]+)\}\}")


def _load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def bundle() -> dict[str, Any]:
    return _load(BUNDLE)


@pytest.fixture(scope="module")
def resource_files(bundle) -> list[Path]:
    files = sorted(p for pattern in bundle["include"] for p in ROOT.glob(pattern))
    assert files, f"include {bundle['include']} matches no file"
    return files


@pytest.fixture(scope="module")
def jobs(resource_files) -> dict[str, tuple[Path, dict[str, Any]]]:
    """Every job of every resource file, with the file it is defined in (paths are relative to it)."""
    found: dict[str, tuple[Path, dict[str, Any]]] = {}
    for path in resource_files:
        for name, job in _load(path)["resources"].get("jobs", {}).items():
            assert name not in found, f"job {name} is defined twice"
            found[name] = (path, job)
    return found


def _variables(bundle: dict[str, Any], target: str = "dev") -> dict[str, str]:
    values = {name: str(spec.get("default", "")) for name, spec in bundle["variables"].items()}
    values.update({k: str(v) for k, v in (bundle["targets"][target].get("variables") or {}).items()})
    return values


def _resolve(text: str, variables: dict[str, str], target: str = "dev") -> str:
    known = {
        "workspace.file_path": FILE_PATH,
        "workspace.current_user.userName": "someone",
        "bundle.name": "cdc_join",
        "bundle.target": target,
        "resources.schemas.cdc_join.name": variables["schema"],
    }

    def value(match: re.Match[str]) -> str:
        ref = match.group(1)
        if ref.startswith("var."):
            assert ref[4:] in variables, f"${{{ref}}} names no declared variable"
            return _resolve(variables[ref[4:]], variables, target)
        assert ref in known, f"${{{ref}}} is not a reference this bundle may use"
        return known[ref]

    return _REFERENCE.sub(value, text)


def _entry_point(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bundle_entry_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tasks(jobs) -> list[tuple[str, Path, dict[str, Any], dict[str, Any]]]:
    return [(name, path, job, task) for name, (path, job) in jobs.items() for task in job["tasks"]]


def _parameters(job: dict[str, Any], task: dict[str, Any], variables: dict[str, str]) -> list[str]:
    """A task's parameters as the task receives them: job parameters at their defaults."""
    defaults = {p["name"]: _resolve(str(p["default"]), variables) for p in job.get("parameters", [])}

    def value(match: re.Match[str]) -> str:
        assert match.group(1) in defaults, f"{{{{job.parameters.{match.group(1)}}}}} is not a job parameter"
        return defaults[match.group(1)]

    python = task.get("python_wheel_task") or task["spark_python_task"]
    return [_JOB_PARAMETER.sub(value, _resolve(p, variables)) for p in python["parameters"]]


def _parser(path: Path, task: dict[str, Any]):  # type: ignore[no-untyped-def]
    """The argument parser of a task's entry point: the wheel's ``cdc-join``, or a file."""
    if "python_wheel_task" in task:
        return cli.build_parser()
    return _entry_point(path.parent / task["spark_python_task"]["python_file"]).build_parser()


# -- databricks.yml ----------------------------------------------------------------------------------


def test_bundle_declares_the_wheel_variables_and_targets(bundle):
    artifact = bundle["artifacts"]["cdc_join_wheel"]
    assert artifact["type"] == "whl"
    assert (ROOT / artifact["path"] / "pyproject.toml").is_file()
    assert {"catalog", "schema", "config_path"} <= set(bundle["variables"])
    assert bundle["targets"]["dev"]["mode"] == "development"
    assert bundle["targets"]["dev"]["default"] is True
    assert bundle["targets"]["prod"]["mode"] == "production"


def test_every_reference_in_the_bundle_resolves(bundle, resource_files):
    for target in bundle["targets"]:
        variables = _variables(bundle, target)
        for path in [BUNDLE, *resource_files]:
            resolved = _resolve(path.read_text(), variables, target)
            assert "${" not in resolved, f"{path.name}: unresolved reference for target {target}"


def test_target_variables_are_declared(bundle):
    for target, spec in bundle["targets"].items():
        unknown = set(spec.get("variables") or {}) - set(bundle["variables"])
        assert not unknown, f"target {target} sets undeclared variables {unknown}"


# -- jobs ---------------------------------------------------------------------------------------------


def test_bundle_defines_the_three_jobs(jobs):  # and the schema and volume (below)
    assert set(jobs) == {"cdc_join_incremental", "cdc_join_full_refresh", "cdc_join_integration_tests"}


def test_tasks_reference_existing_entry_points_compute_tasks_and_the_wheel(jobs, bundle):
    built = (ROOT / bundle["artifacts"]["cdc_join_wheel"]["path"] / "dist").resolve()
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for name, path, job, task in _tasks(jobs):
        where = f"{name}.{task['task_key']}"
        if "python_wheel_task" in task:
            wheel_task = task["python_wheel_task"]
            assert wheel_task["package_name"] == "cdc_join" and wheel_task["entry_point"] in scripts, where
        else:
            assert (path.parent / task["spark_python_task"]["python_file"]).is_file(), where
        keys = {t["task_key"] for t in job["tasks"]}
        assert {d["task_key"] for d in task.get("depends_on", [])} <= keys, where
        if "environment_key" in task:  # serverless: the wheel is a dependency of the environment
            (env,) = [e for e in job["environments"] if e["environment_key"] == task["environment_key"]]
            wheels = [d for d in env["spec"]["dependencies"] if d.endswith(".whl")]
        else:
            assert task["job_cluster_key"] in {c["job_cluster_key"] for c in job["job_clusters"]}, where
            wheels = [lib["whl"] for lib in task["libraries"] if "whl" in lib]
        assert [(path.parent / w).parent.resolve() for w in wheels] == [built], where
        assert "max_retries" in task, where


def test_every_task_s_parameters_are_accepted_by_its_entry_point(jobs, bundle):
    variables = _variables(bundle)
    for name, path, job, task in _tasks(jobs):
        params = _parameters(job, task, variables)
        try:
            _parser(path, task).parse_args(params)
        except SystemExit:
            pytest.fail(f"{name}.{task['task_key']}: its entry point rejects {params}")


def test_pipeline_tasks_are_cdc_join_commands_on_the_job_s_parameters(jobs, bundle):
    variables = _variables(bundle)
    expected = {
        ("cdc_join_incremental", "run"): "run",
        ("cdc_join_incremental", "quality"): "check",
        ("cdc_join_incremental", "maintain"): "optimize",
        ("cdc_join_full_refresh", "full_refresh"): "full-refresh",
        ("cdc_join_full_refresh", "verify"): "verify",
    }
    seen = {}
    for name, _, job, task in _tasks(jobs):
        if (name, task["task_key"]) not in expected:
            continue
        assert "python_wheel_task" in task, f"{name}.{task['task_key']} runs the wheel's cdc-join"
        assert {p["name"] for p in job["parameters"]} == {"catalog", "schema", "config_path"}
        args = cli.build_parser().parse_args(_parameters(job, task, variables))
        seen[(name, task["task_key"])] = args.command
        assert args.config == _resolve("${var.config_path}", variables)
        assert args.tables == f"{variables['catalog']}.{variables['schema']}"
        assert args.storage == "delta-spark"
    assert seen == expected


def test_the_incremental_job_runs_on_serverless_compute(jobs):
    _, job = jobs["cdc_join_incremental"]
    assert "job_clusters" not in job
    (env,) = job["environments"]
    assert env["spec"]["environment_version"] and any(d.endswith(".whl") for d in env["spec"]["dependencies"])
    assert {t["environment_key"] for t in job["tasks"]} == {env["environment_key"]}


def test_the_schema_and_the_landing_volume_are_bundle_resources(resource_files, bundle):
    schemas = pytest.importorskip("databricks.bundles.schemas")
    volumes = pytest.importorskip("databricks.bundles.volumes")
    found: dict[str, Any] = {}
    for path in resource_files:
        for kind, items in _load(path)["resources"].items():
            found.setdefault(kind, {}).update(items)
    schema, volume = found["schemas"]["cdc_join"], found["volumes"]["landing"]
    schemas.Schema.from_dict(schema)  # Databricks' models reject unknown fields and wrong shapes
    volumes.Volume.from_dict(volume)
    assert (schema["catalog_name"], schema["name"]) == ("${var.catalog}", "${var.schema}")
    assert volume["schema_name"] == "${resources.schemas.cdc_join.name}"
    shipped = _resolve("${var.config_path}", _variables(bundle)).replace(FILE_PATH, str(ROOT))
    landing = {s["landing"] for s in _load(Path(shipped))["sources"].values()}
    assert all(f.startswith("/Volumes/main/cdc_join/landing/") for f in landing)


def test_production_runs_as_a_service_principal_with_permissions_outside_shared(bundle):
    prod = bundle["targets"]["prod"]
    assert prod["run_as"] == {"service_principal_name": "${var.service_principal}"}
    assert not prod["workspace"]["root_path"].startswith("/Workspace/Shared")
    assert {p["level"] for p in prod["permissions"]} >= {"CAN_MANAGE", "CAN_VIEW"}


def test_incremental_job_runs_one_at_a_time_on_a_schedule_and_checks_after_the_run(jobs, bundle):
    _, job = jobs["cdc_join_incremental"]
    assert job["max_concurrent_runs"] == 1
    schedule = job["schedule"]
    assert len(schedule["quartz_cron_expression"].split()) in (6, 7)  # quartz: seconds first
    assert schedule["pause_status"] == "${var.schedule_pause_status}"
    assert _variables(bundle, "dev")["schedule_pause_status"] == "PAUSED"
    assert _variables(bundle, "prod")["schedule_pause_status"] == "UNPAUSED"
    tasks = {t["task_key"]: t for t in job["tasks"]}
    assert tasks["quality"]["depends_on"] == [{"task_key": "run"}]
    assert tasks["maintain"]["depends_on"] == [{"task_key": "run"}]
    assert tasks["run"]["max_retries"] > 0


def test_full_refresh_job_verifies_after_refreshing(jobs):
    _, job = jobs["cdc_join_full_refresh"]
    assert job["max_concurrent_runs"] == 1
    assert "schedule" not in job  # manual
    tasks = {t["task_key"]: t for t in job["tasks"]}
    assert tasks["verify"]["depends_on"] == [{"task_key": "full_refresh"}]


def test_integration_test_job_runs_the_contract_and_scenario_suites_on_delta_spark(jobs, bundle):
    path, job = jobs["cdc_join_integration_tests"]
    (task,) = job["tasks"]
    args = _parser(path, task).parse_args(_parameters(job, task, _variables(bundle)))
    assert args.storage == "delta-spark"
    assert str(args.project_dir) == FILE_PATH
    assert {"tests/contract", "tests/scenarios"} <= set(args.pytest_args)
    (cluster,) = job["job_clusters"]
    assert cluster["new_cluster"]["spark_env_vars"]["CDC_JOIN_STORAGE"] == "delta-spark"
    assert cluster["new_cluster"]["num_workers"] == 0  # tests write to the driver's local disk
    packages = {lib["pypi"]["package"].split(">")[0] for lib in task["libraries"] if "pypi" in lib}
    assert {"pytest", "hypothesis"} <= packages


def test_every_job_loads_into_databricks_typed_bundle_models(jobs):
    """Databricks' own bundle models reject unknown fields and wrong shapes."""
    models = pytest.importorskip("databricks.bundles.jobs", reason="databricks-bundles is not installed")
    for name, (_, job) in jobs.items():
        loaded = models.Job.from_dict(job)
        assert [t.task_key for t in loaded.tasks] == [t["task_key"] for t in job["tasks"]], name
    broken = {**jobs["cdc_join_incremental"][1], "max_concurent_runs": 1}
    with pytest.raises(ValueError, match="max_concurent_runs"):
        models.Job.from_dict(broken)


def test_the_shipped_pipeline_is_the_one_the_jobs_run_and_it_loads(bundle):
    from cdc_join.config import load_config

    shipped = _resolve("${var.config_path}", _variables(bundle)).replace(FILE_PATH, str(ROOT))
    config = load_config(shipped, check_paths=False)  # its landing folders are in the workspace
    assert config.tables == "main.cdc_join"
    assert {config.left, *config.sources} == {"orders", "customers", "products"}
    args = cli.build_parser().parse_args(
        ["--tables", "dev.cdc_join_dev", "--storage", "delta-rs", "run", shipped]
    )
    assert args.tables == "dev.cdc_join_dev"


# -- the wheel and the entry points ----------------------------------------------------------------


def test_wheel_console_script_is_the_cli():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"cdc-join": "cdc_join.cli.main:main"}
    (installed,) = importlib.metadata.entry_points(group="console_scripts", name="cdc-join")
    assert installed.value == scripts["cdc-join"]
    assert installed.load() is cli.main


def test_the_cli_runs_a_job_s_command_locally_with_a_lake_override(tmp_path, spark, capsys):
    (tmp_path / "landing" / "orders").mkdir(parents=True)
    config = tmp_path / "pipeline.yml"
    config.write_text(
        yaml.safe_dump(
            {
                "name": "local",
                "lake": "lake",
                "sources": {"orders": {"landing": "landing/orders", "primary_key": ["id"]}},
                "left": "orders",
                "select": {"order_id": "orders.id"},
                "output": "orders_out",
            }
        )
    )
    lake = str(tmp_path / "elsewhere")
    args = cli.build_parser().parse_args(["--lake", lake, "--storage", "delta-rs", "check", str(config)])
    assert cli.open_pipeline(args).config.silver_path == f"{lake}/silver/orders_out"
    assert cli.main(["--lake", lake, "--storage", "delta-rs", "check", str(config)]) == 0
    assert "nothing checked" in capsys.readouterr().out


def test_test_entry_point_runs_pytest_locally(monkeypatch):
    # run_tests.py sets these, changes folder and stops bytecode writes; monkeypatch restores them.
    for name in ("CDC_JOIN_STORAGE", "CDC_JOIN_TEST_STORAGE"):
        monkeypatch.setenv(name, os.environ.get(name, ""))
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "dont_write_bytecode", sys.dont_write_bytecode)
    task = _entry_point(ROOT / "jobs" / "run_tests.py")
    selected = ["tests/unit/test_config.py", "-q", "-k", "design_example"]
    assert task.main(["--storage", "delta-rs", "--project-dir", str(ROOT), "--", *selected]) == 0
