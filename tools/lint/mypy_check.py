"""Lint test: mypy over one package's Python files (config: mypy.ini at the repository root).

It runs in the test's runfiles, where every target of the package brings its dependencies: the
other first-party packages it imports and the generated `*_pb2.py` with their `*_pb2.pyi` stubs
lie at their repository paths. mypy follows those imports silently (their own package's test
reports their errors) and reports errors in the files given only.
"""

import os
import subprocess
import sys

from tools.lint.junit import write_junit


def main() -> int:
    config, *files = sys.argv[1:]
    if not files:
        write_junit("mypy", False, "")
        return 0
    # A test runs once per change: a cache would be written and never read.
    cmd = [sys.executable, "-m", "mypy", "--config-file", config, "--cache-dir", os.devnull]
    done = subprocess.run([*cmd, *files], capture_output=True, text=True)
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr)
    write_junit("mypy", done.returncode != 0, done.stdout + done.stderr)
    if done.returncode:
        print("mypy found type errors above (config: mypy.ini)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
