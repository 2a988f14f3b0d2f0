"""Lint test: buildifier's formatting and lint warnings over one package's BUILD/.bzl files."""

import subprocess
import sys

from tools.lint.junit import write_junit


def main() -> int:
    buildifier, *files = sys.argv[1:]
    # native-py: buildifier wants py_* rules loaded from rules_python, which cannot be fetched
    # offline with Bazel 4.2.3; Kitchen uses the native rules on purpose.
    result = subprocess.run(
        [buildifier, "--mode=check", "--lint=warn", "--warnings=-native-py", *files],
        capture_output=True,
        text=True,
    )
    output = result.stdout + result.stderr
    sys.stdout.write(output)
    write_junit("buildifier", result.returncode != 0, output)
    if result.returncode:
        print(f"fix with: buildifier --lint=fix {' '.join(files)}", file=sys.stderr)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
