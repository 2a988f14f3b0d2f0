"""Lint test: mypy over one package's Python files (config: mypy.ini at the repository root).

It runs in the test's runfiles, where every target of the package brings its dependencies: the
other first-party packages it imports and the generated `*_pb2.py` with their `*_pb2.pyi` stubs
lie at their repository paths. mypy follows those imports silently (their own package's test
reports their errors) and reports errors in the files given only.
"""

import os
import subprocess
import sys
from xml.sax.saxutils import escape


def write_junit(failed: bool, output: str) -> None:
    """The test's result as JUnit XML in $XML_OUTPUT_FILE. Without it Bazel makes one in a
    separate step after the test, which the remote cache does not keep: a second checkout
    then ran that step for every cached mypy_test (tools/cache/prove_remote_cache.sh)."""
    path = os.environ.get("XML_OUTPUT_FILE")
    if not path:
        return
    name = escape(os.environ.get("TEST_TARGET", "mypy_test"), {'"': "&quot;"})
    failure = f'<failure message="mypy found type errors">{escape(output)}</failure>'
    with open(path, "w") as f:
        f.write(
            f'<?xml version="1.0" encoding="UTF-8"?>\n<testsuites><testsuite name="{name}" '
            f'tests="1" failures="{int(failed)}"><testcase name="mypy">'
            f"{failure if failed else ''}</testcase></testsuite></testsuites>\n"
        )


def main() -> int:
    config, *files = sys.argv[1:]
    if not files:
        write_junit(False, "")
        return 0
    # A test runs once per change: a cache would be written and never read.
    cmd = [sys.executable, "-m", "mypy", "--config-file", config, "--cache-dir", os.devnull]
    done = subprocess.run([*cmd, *files], capture_output=True, text=True)
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr)
    write_junit(done.returncode != 0, done.stdout + done.stderr)
    if done.returncode:
        print("mypy found type errors above (config: mypy.ini)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
