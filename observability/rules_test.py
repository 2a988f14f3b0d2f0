"""promtool checks the committed Prometheus config and rules, and runs their unit tests."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from observability.queries import PROMETHEUS_CONFIG, RULE_FILES, rule_queries

PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
RULE_TESTS_DIR = PROMETHEUS_CONFIG.parent / "tests"
ALERTS_TEST = RULE_TESTS_DIR / "alerts_test.yml"
RECORDING_TEST = RULE_TESTS_DIR / "recording_test.yml"
GUIDE = Path(__file__).absolute().parent.parent / "docs" / "observability.md"


def promtool(*args: str) -> str:
    result = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, (
        f"promtool {' '.join(args)} failed:\n{result.stdout}{result.stderr}"
    )
    return result.stdout


def test_config_is_valid_and_loads_every_rule_file():
    out = promtool("check", "config", str(PROMETHEUS_CONFIG))
    assert f"{len(RULE_FILES)} rule files found" in out


@pytest.mark.parametrize("path", RULE_FILES, ids=lambda p: p.name)
def test_rule_file_passes_promtool_check(path):
    out = promtool("check", "rules", str(path))
    assert f"{len(rule_queries(path))} rules found" in out


@pytest.mark.parametrize("path", [RECORDING_TEST, ALERTS_TEST], ids=lambda p: p.name)
def test_rule_unit_tests_pass(path):
    promtool("test", "rules", str(path))


def test_promtool_test_fails_on_a_wrong_expectation(tmp_path):
    """The unit tests can fail: the same fixtures with one expected value changed do."""
    doc = yaml.safe_load(RECORDING_TEST.read_text())
    doc["rule_files"] = [str(RULE_TESTS_DIR / f) for f in doc["rule_files"]]
    doc["tests"][0]["promql_expr_test"][0]["exp_samples"][0]["value"] += 1
    broken = tmp_path / "broken_test.yml"
    broken.write_text(yaml.safe_dump(doc))
    result = subprocess.run(
        [PROMTOOL, "test", "rules", str(broken)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0
    assert 'expr: "job_id:kitchen_train_tokens:rate1m"' in result.stdout + result.stderr


def _alert_names() -> list[str]:
    return [q.name for path in RULE_FILES for q in rule_queries(path) if q.kind == "alert"]


def test_every_alert_has_a_firing_and_a_quiet_case():
    cases = [
        case
        for test in yaml.safe_load(ALERTS_TEST.read_text())["tests"]
        for case in test.get("alert_rule_test", [])
    ]
    for name in _alert_names():
        mine = [case for case in cases if case["alertname"] == name]
        assert any(case.get("exp_alerts") for case in mine), f"{name}: no firing case"
        assert any(not case.get("exp_alerts") for case in mine), f"{name}: no quiet case"


def test_every_recording_rule_is_unit_tested():
    tested = " ".join(
        case["expr"]
        for test in yaml.safe_load(RECORDING_TEST.read_text())["tests"]
        for case in test["promql_expr_test"]
    )
    records = [q.name for path in RULE_FILES for q in rule_queries(path) if q.kind == "record"]
    untested = [name for name in records if not re.search(re.escape(name) + r"\b", tested)]
    assert not untested


def test_every_alert_explains_itself_and_links_its_guide_section():
    anchors = {
        re.sub(r"[^a-z0-9-]", "", line.lstrip("#").strip().lower().replace(" ", "-"))
        for line in GUIDE.read_text().splitlines()
        if line.startswith("#")
    }
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                if "alert" not in rule:
                    continue
                annotations = rule["annotations"]
                assert {"summary", "description", "runbook"} <= annotations.keys(), rule["alert"]
                assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
                doc, anchor = annotations["runbook"].split("#")
                assert doc == "docs/observability.md" and anchor in anchors, rule["alert"]
