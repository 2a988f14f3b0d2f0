"""The lint checks write their own JUnit XML (junit.py): a failure carries the checker's output
and names the target; a pass has no failure element. Real ruff and buildifier, on files here."""

import os
import sys
import xml.etree.ElementTree as ET

import pytest

from tools.lint import buildifier_check, ruff_check

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUFF_TOML = os.environ.get("RUFF_TOML", os.path.join(ROOT, "ruff.toml"))
BUILDIFIER = os.environ.get("BUILDIFIER", "")  # the Bazel target's; by hand, skipped


def run(monkeypatch, tmp_path, main, *argv) -> tuple[int, ET.Element]:
    xml = tmp_path / "test.xml"
    monkeypatch.setenv("XML_OUTPUT_FILE", str(xml))
    monkeypatch.setenv("TEST_TARGET", "//pkg:some_test")
    monkeypatch.setattr(sys, "argv", ["check", *argv])
    code = main()
    return code, ET.parse(xml).getroot()


def test_ruff_writes_a_failure_with_its_output_and_a_pass(monkeypatch, tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n")  # unused import
    code, root = run(monkeypatch, tmp_path, ruff_check.main, RUFF_TOML, str(bad))
    assert code == 1
    suite = root.find("testsuite")
    assert suite is not None and suite.get("name") == "//pkg:some_test"
    assert suite.get("failures") == "1"
    failure = root.find("testsuite/testcase/failure")
    assert failure is not None and "F401" in (failure.text or "")

    bad.write_text('"""Fine."""\n')
    code, root = run(monkeypatch, tmp_path, ruff_check.main, RUFF_TOML, str(bad))
    assert code == 0 and root.find("testsuite/testcase/failure") is None


@pytest.mark.skipif(not BUILDIFIER, reason="BUILDIFIER unset (set by the Bazel target)")
def test_buildifier_writes_a_failure_with_its_output(monkeypatch, tmp_path):
    build = tmp_path / "BUILD.bazel"
    build.write_text('py_library(name="x",srcs=["x.py"])\n')  # not formatted
    code, root = run(monkeypatch, tmp_path, buildifier_check.main, BUILDIFIER, str(build))
    assert code != 0
    failure = root.find("testsuite/testcase/failure")
    assert failure is not None and "BUILD.bazel" in (failure.text or "")
