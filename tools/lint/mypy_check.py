"""Lint test: mypy over one package's Python files (config: mypy.ini at the repository root).

It runs in the test's runfiles, where every target of the package brings its dependencies: the
other first-party packages it imports and the generated `*_pb2.py` with their `*_pb2.pyi` stubs
lie at their repository paths. mypy follows those imports silently (their own package's test
reports their errors) and reports errors in the files given only.
"""

import os
import subprocess
import sys


def main() -> int:
    config, *files = sys.argv[1:]
    if not files:
        return 0
    # A test runs once per change: a cache would be written and never read.
    cmd = [sys.executable, "-m", "mypy", "--config-file", config, "--cache-dir", os.devnull]
    if subprocess.run([*cmd, *files]).returncode:
        print("mypy found type errors above (config: mypy.ini)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
