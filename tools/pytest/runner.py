"""The `main` of every pytest_test: runs pytest on the target's test files inside Bazel.

Bazel reads the JUnit XML from $XML_OUTPUT_FILE; pytest's cache is off and its temporary
directories live in $TEST_TMPDIR, because a test must not depend on a previous run.
Exit code 5 ("no tests ran") is a failure: a test target that collects nothing is a mistake.
"""

import os
import sys

import pytest


def main() -> int:
    args = ["-p", "no:cacheprovider", "-q", "-rfEs", "--import-mode=importlib"]
    # Temporary files under the test's own TEST_TMPDIR, never a /tmp shared with other runs.
    if os.environ.get("TEST_TMPDIR"):
        args.append(f"--basetemp={os.path.join(os.environ['TEST_TMPDIR'], 'pytest')}")
    xml = os.environ.get("XML_OUTPUT_FILE")
    if xml:
        args.append(f"--junitxml={xml}")
    return pytest.main(args + sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
