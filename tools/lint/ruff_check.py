"""Lint test: ruff's checks and formatting over one package's Python files."""

import subprocess
import sys

from tools.lint.junit import write_junit


def main() -> int:
    config, *files = sys.argv[1:]
    if not files:
        write_junit("ruff", False, "")
        return 0
    ruff = [sys.executable, "-m", "ruff"]
    check = subprocess.run(
        [*ruff, "check", "--config", config, *files], capture_output=True, text=True
    )
    fmt = subprocess.run(
        [*ruff, "format", "--check", "--diff", "--config", config, *files],
        capture_output=True,
        text=True,
    )
    output = check.stdout + check.stderr + fmt.stdout + fmt.stderr
    sys.stdout.write(output)
    failed = bool(check.returncode or fmt.returncode)
    write_junit("ruff", failed, output)
    if failed:
        print("fix with: ruff check --fix && ruff format (config: ruff.toml)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
