"""The committed dashboard JSON is what the code renders, and it is wired up consistently."""

import json

import yaml

from observability.dashboards import generate
from observability.dashboards.panels import DATASOURCE_UID
from observability.queries import DASHBOARDS_DIR, dashboard_files
from protos import metric_catalog, metric_panels
from protos.metric_catalog import ANY, CATALOG

PROVISIONING_DIR = DASHBOARDS_DIR.parent / "provisioning"


def boards() -> dict[str, dict]:
    return {path.stem: json.loads(path.read_text()) for path in dashboard_files()}


def test_committed_json_is_current():
    stale = generate.stale_files(DASHBOARDS_DIR)
    assert not stale, f"{stale} stale: run `bazel run //observability/dashboards:generate`"
    assert sorted(generate.render_all()) == [p.name for p in dashboard_files()]


def test_stale_json_is_detected(tmp_path):
    for name, text in generate.render_all().items():
        (tmp_path / name).write_text(text.replace('"Loss"', '"Loss (old)"'))
    assert generate.stale_files(tmp_path) == ["kitchen-run.json"]


def test_generate_writes_every_dashboard_into_the_workspace(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("BUILD_WORKSPACE_DIRECTORY", str(tmp_path))
    written = tmp_path / "observability/grafana/dashboards"
    assert generate.main(["--check"]) == 1 and not written.exists()
    assert generate.main([]) == 0
    assert generate.stale_files(written) == [] and generate.main(["--check"]) == 0
    assert sorted(p.name for p in written.iterdir()) == sorted(generate.render_all())
    assert capsys.readouterr().out.count("wrote: ") == len(generate.render_all())


def test_every_panel_has_an_id_a_query_a_unit_and_help():
    for uid, board in boards().items():
        assert board["uid"] == uid
        panels = board["panels"]
        assert [p["id"] for p in panels] == list(range(1, len(panels) + 1))
        for panel in panels:
            if panel["type"] == "row":
                continue
            where = f"{uid}: {panel['title']}"
            assert panel["targets"] and all(t["expr"].strip() for t in panel["targets"]), where
            assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]), where
            assert panel["fieldConfig"]["defaults"]["unit"], where
            assert len(panel["description"]) > 20, where


def _titles(board: dict) -> set[str]:
    return {p["title"] for p in board["panels"] if p["type"] != "row"}


def test_run_dashboard_answers_is_my_run_healthy():
    board = boards()["kitchen-run"]
    assert {
        "Loss",
        "MFU",
        "Throughput",
        "Step time p50 / p99",
        "Goodput",
        "Peak memory",
        "Padding fraction",
        "Restarts and preemptions",
        "Gradient norm",
    } <= _titles(board)
    (variable,) = board["templating"]["list"]
    assert variable["name"] == "job_id" and variable["multi"] and variable["includeAll"]
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            assert 'job_id=~"$job_id"' in target["expr"], panel["title"]


def test_fleet_dashboard_shows_queue_waits_states_and_pools():
    titles = _titles(boards()["kitchen-fleet"])
    assert {
        "Queue depth",
        "Queue wait p50 / p99",
        "Jobs by state",
        "Pool throughput",
        "Pool usage",
        "GPUs in use",
        "Running jobs per pool",
    } <= titles


def test_provisioning_points_grafana_at_the_datasource_the_panels_use():
    (datasource,) = yaml.safe_load(
        (PROVISIONING_DIR / "datasources" / "kitchen-prometheus.yml").read_text()
    )["datasources"]
    assert datasource["uid"] == DATASOURCE_UID and datasource["type"] == "prometheus"
    (provider,) = yaml.safe_load((PROVISIONING_DIR / "dashboards" / "kitchen.yml").read_text())[
        "providers"
    ]
    assert provider["type"] == "file" and provider["options"]["path"]
    for uid, board in boards().items():
        for panel in board["panels"]:
            if panel["type"] != "row":
                assert panel["datasource"] == {"type": "prometheus", "uid": DATASOURCE_UID}, uid


def _rows(board: dict) -> dict[str, dict[str, dict]]:
    """Row title -> panel title -> panel, of one committed dashboard."""
    rows: dict[str, dict[str, dict]] = {}
    current = rows.setdefault("", {})
    for panel in board["panels"]:
        if panel["type"] == "row":
            current = rows.setdefault(panel["title"], {})
        else:
            current[panel["title"]] = panel
    return rows


def test_every_catalog_metric_is_drawn_where_the_catalog_says():
    """protos/metric_catalog.py and the committed JSON agree: each metric that names a panel is
    a target of that panel, on its row of its dashboard, with the panel's unit."""
    committed = {uid: _rows(board) for uid, board in boards().items()}
    for m in CATALOG:
        if (spec := m.panel) is None:
            continue
        row = committed[spec.row.board.value].get(spec.row.title, {})
        panel = row.get(spec.title)
        assert panel, f"{m.name}: no panel {spec.title!r} on row {spec.row.title!r}"
        assert panel["fieldConfig"]["defaults"]["unit"] == spec.unit, spec.title
        exprs = [t["expr"] for t in panel["targets"]]
        assert any(e.startswith(m.sample + "{") for e in exprs), f"{m.name} not in {exprs}"


def test_a_new_metric_and_panel_need_only_catalog_lines(monkeypatch):
    """#30: a metric (here a stand-in on gradient_noise_scale, a field the catalog does not
    export) joins an existing panel, or brings its own, with no edit to the dashboard code."""
    noise = metric_panels.Panel(metric_panels.RUN_RL, "Noise scale", "none", "B_simple " * 4)
    new = [
        metric_catalog.Metric(
            "gradient_noise_scale", "kitchen_x_noise", "x.", ANY, panel=metric_panels.GRAD_NORM
        ),
        metric_catalog.Metric("gradient_noise_scale", "kitchen_y_noise", "y.", ANY, panel=noise),
    ]
    monkeypatch.setattr(metric_catalog, "CATALOG", (*CATALOG, *new))
    rows = _rows(json.loads(generate.render_all()["kitchen-run.json"]))
    grad = rows[metric_panels.RUN_MEMORY.title][metric_panels.GRAD_NORM.title]
    assert [t["expr"] for t in grad["targets"]] == [
        'kitchen_train_grad_norm{job_id=~"$job_id"}',
        'kitchen_x_noise{job_id=~"$job_id"}',
    ]
    assert rows[metric_panels.RUN_RL.title]["Noise scale"]["targets"][0]["expr"].startswith(
        "kitchen_y_noise{"
    )
