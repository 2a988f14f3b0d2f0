"""A lint test's result as JUnit XML in $XML_OUTPUT_FILE, written by the test itself.

A test that writes none gets its XML from a separate action Bazel runs after it (`TestRunner`),
and the remote cache did not always keep that one: a second checkout then ran it although the
test's result was a hit (tools/cache/prove_remote_cache.sh's misses: 20 mypy_tests on
2026-12-01, one buildifier_test on 2026-12-03). pytest_test writes its own (tools/pytest).
"""

import os
from xml.sax.saxutils import escape


def write_junit(check: str, failed: bool, output: str) -> None:
    """One test case named `check` (ruff, mypy, buildifier), failed with `output` or passed."""
    path = os.environ.get("XML_OUTPUT_FILE")
    if not path:  # run by hand
        return
    name = escape(os.environ.get("TEST_TARGET", check), {'"': "&quot;"})
    message = escape(f"{check} found problems", {'"': "&quot;"})
    failure = f'<failure message="{message}">{escape(output)}</failure>'
    with open(path, "w") as f:
        f.write(
            f'<?xml version="1.0" encoding="UTF-8"?>\n<testsuites><testsuite name="{name}" '
            f'tests="1" failures="{int(failed)}"><testcase name="{check}">'
            f"{failure if failed else ''}</testcase></testsuite></testsuites>\n"
        )
